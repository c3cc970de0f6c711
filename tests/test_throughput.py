"""The throughput meter: its arithmetic (tables), the batch size it reads off a dataset, where it
writes, and a real custom loop in one process. The meter inside ``fit`` on 2 workers is checked
by tests/test_keras_traps.py (``model_dir``: one file, from the chief, one line per epoch)."""

from __future__ import annotations

import json
import time

import pytest

from tfdist import throughput

MS = 1e-3

SUMMARIES = {  # stamps, global batch, workers -> (timed steps, median s, examples/s total)
    "one report: nothing timed": ([(0, 1.0)], 64, 2, None),
    "steady 10 ms steps": ([(i, 1.0 + i * 10 * MS) for i in range(5)], 64, 2,
                           (4, 10 * MS, 6400.0)),
    "the first step is not counted": ([(0, 5.0), (1, 5.010), (2, 5.020)], 32, 1,
                                      (2, 10 * MS, 3200.0)),
    "steps_per_execution=3: one report per execution": (
        [(2, 0.0), (5, 0.030), (8, 0.060)], 30, 3, (6, 10 * MS, 3000.0)),
    "unknown batch size": ([(0, 0.0), (1, 0.020), (2, 0.040)], None, 2, (2, 20 * MS, None)),
}


@pytest.mark.parametrize("case", sorted(SUMMARIES))
def test_summarise(case):
    stamps, batch, workers, expected = SUMMARIES[case]
    found = throughput.summarise(stamps, global_batch=batch, workers=workers)
    if expected is None:
        assert found is None
        return
    steps, median, total = expected
    assert found["timed_steps"] == steps
    assert found["step_time_s"]["median"] == pytest.approx(median)
    eps = 1e-12  # the clock's differences round
    times = found["step_time_s"]
    assert times["min"] - eps <= times["q1"] <= median + eps <= times["q3"] + 2 * eps
    assert times["q3"] <= times["max"] + eps
    if total is None:
        assert found["examples_per_s"] is None
    else:
        assert found["examples_per_s"]["total"] == pytest.approx(total)
        assert found["examples_per_s"]["per_worker"] == pytest.approx(total / workers)


def test_spread_shows_a_slow_step():
    stamps = [(0, 0.0), (1, 0.010), (2, 0.020), (3, 0.030), (4, 0.130)]  # one 100 ms step
    found = throughput.summarise(stamps, global_batch=8, workers=1)
    assert found["step_time_s"]["median"] == pytest.approx(10 * MS)
    assert found["step_time_s"]["max"] == pytest.approx(100 * MS)


def test_describe_says_examples_or_steps_per_second():
    record = {"epoch": 2, "workers": 2, "step_time_s": {"median": 0.0125, "q1": 0.012,
                                                         "q3": 0.014},
              "examples_per_s": {"total": 5120.0, "per_worker": 2560.0}}
    # Keras's numbering: the record's 0-based index 2 is the progress bar's "Epoch 3/N"
    assert throughput.describe(record) == (
        "epoch 3: 5,120 examples/s (2,560 per worker), step 12.5 ms (12.0-14.0), 2 worker(s)")
    assert throughput.describe({**record, "examples_per_s": None}).startswith(
        "epoch 3: 80.0 steps/s, step 12.5 ms")


def _datasets():
    import tensorflow as tf

    rows = tf.data.Dataset.range(100)
    return {
        "batch": (rows.batch(32), 32),
        "batch, map, prefetch, options": (
            rows.batch(16).map(lambda x: x * 2).prefetch(2).with_options(tf.data.Options()), 16),
        "cache and shuffle after batch": (rows.batch(8).cache().shuffle(4), 8),
        "padded_batch": (rows.padded_batch(4), 4),
        "not batched": (rows.map(lambda x: x), None),
        "batched, then unbatched and re-batched": (rows.batch(10).unbatch().batch(5), 5),
    }


@pytest.mark.parametrize("case", sorted(_datasets()))
def test_batch_size_of_a_dataset(case):
    dataset, expected = _datasets()[case]
    assert throughput.batch_size_of(dataset) == expected


def test_throughput_file_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("TFDIST_THROUGHPUT_FILE", raising=False)
    assert throughput.throughput_file(None) is None
    assert throughput.throughput_file(str(tmp_path)) == str(tmp_path / "throughput.jsonl")
    monkeypatch.setenv("TFDIST_THROUGHPUT_FILE", str(tmp_path / "runs" / "a.jsonl"))
    assert throughput.throughput_file(str(tmp_path)) == str(tmp_path / "runs" / "a.jsonl")


class _OneProcess:  # what StepMeter reads of a handle
    world_size, num_replicas, backend, is_chief, sharded_batch_size = 1, 1, "single", True, 16


def _epochs(*starts_and_epochs):
    return [{"start_s": start, "epoch_s": epoch} for start, epoch in starts_and_epochs]


@pytest.mark.parametrize(("records", "advised"), [
    (_epochs((2.0, 3.0), (0.4, 1.0), (0.4, 1.0)), True),  # the first epoch does not count
    (_epochs((2.0, 3.0), (0.4, 1.0)), False),  # one later epoch: not yet
    (_epochs((0.0, 1.0), (0.4, 1.0), (0.05, 1.0)), False),  # not two in a row
    (_epochs((0.0, 1.0), (0.05, 0.2), (0.06, 0.2)), False),  # under 0.1 s
    (_epochs((0.0, 9.0), (0.5, 9.0), (0.5, 9.0)), False),  # under a tenth of the epoch
    (_epochs((0.0, 9.0), (0.5, 9.0), (0.95, 9.0), (0.95, 9.0)), True),  # the last two
    ([{"epoch_s": 1.0}, {"epoch_s": 1.0}, {"epoch_s": 1.0}], False),  # an older record
])
def test_an_epoch_start_that_is_a_clear_share_is_advised(records, advised):
    advice = throughput.start_advice(records)
    assert (advice is not None) == advised
    if advised:
        assert "dataset.repeat() and fit(steps_per_epoch=N)" in advice
        assert "tf.data's autotuning" in advice  # the cause (benchmarks/iterator_free.py)


def test_step_meter_in_a_custom_loop_writes_one_line_per_epoch(tmp_path):
    path = tmp_path / "deep" / "throughput.jsonl"
    meter = throughput.StepMeter(_OneProcess(), path=str(path), log=False)
    for epoch in range(2):
        for _ in range(6):
            time.sleep(0.005)
            meter.step()
        record = meter.epoch_end(epoch)
        assert record is not None and record["epoch"] == epoch
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1]
    for line in lines:
        assert line["steps"] == 6 and line["timed_steps"] == 5 and line["global_batch"] == 16
        assert 0.004 < line["step_time_s"]["median"] < 0.05
        assert line["examples_per_s"]["total"] == pytest.approx(
            16 / line["step_time_s"]["median"], rel=1e-3)
        assert line["epoch_s"] >= 5 * 0.005 and 0 <= line["busy"] < 0.9  # it slept
        assert 0 <= line["start_s"] < line["epoch_s"]
    assert meter.epoch_end(2) is None  # no steps: no record, no line
    assert len(path.read_text().splitlines()) == 2
