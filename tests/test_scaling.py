"""``tfdist scaling``: sizes, the meter's records, the report, and real runs.

The pure parts are tables. The runner is tested with real ``tfdist launch`` runs of a stand-in
worker (no TensorFlow: it writes records of the meter's schema itself), which makes order,
failure and timeout cheap to check; one run trains tests/workers/scaling_worker.py for real on
1 and 2 workers, whose records come from tfdist's own throughput meter.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, WORKERS, installed, needs

from tfdist import cli, scaling
from tfdist.errors import ConfigError, TfdistError
from tfdist.scaling import Epoch, Run

multiprocess = pytest.mark.multiprocess  # starts real worker processes on loopback
HAS_MATPLOTLIB = installed("matplotlib")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(epoch: int, workers: int, rate: float | None, *, batch: int | None = 64,
           step_s: float | None = None, backend: str = "mwms") -> dict[str, Any]:
    """One epoch as tfdist's throughput meter writes it: ``rate`` examples/s in total."""
    median = step_s if step_s is not None else (batch or 64) / (rate or 1000.0)
    examples = None if rate is None else {"total": rate, "per_worker": rate / workers}
    return {"event": "epoch", "epoch": epoch, "workers": workers, "replicas": workers,
            "backend": backend, "global_batch": batch, "steps": 64, "timed_steps": 63,
            "step_time_s": {"median": median, "q1": 0.9 * median, "q3": 1.2 * median,
                            "min": 0.8 * median, "max": 3 * median},
            "examples_per_s": examples, "epoch_s": 1.0, "busy": 0.8, "time": 1795445905.6}


def jsonl(*records: dict[str, Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def make_run(workers: int, rates: list[float | None], repeat: int = 1, **kw: Any) -> Run:
    epochs = scaling.parse_epochs(jsonl(*(record(i, workers, rate, **kw)
                                          for i, rate in enumerate(rates))))
    return Run(workers, repeat, tuple(epochs), f"n{workers}-r{repeat}.jsonl")


# --------------------------------------------------------------------------------------------
# Sizes and the plan


@pytest.mark.parametrize(("text", "sizes"), [
    ("1", (1,)), ("1,2,4", (1, 2, 4)), ("4,1,2", (1, 2, 4)), (" 1, 2 ", (1, 2)),
    ("16,8", (8, 16)),
])
def test_sizes_parse_into_increasing_numbers(text: str, sizes: tuple[int, ...]) -> None:
    assert scaling.parse_sizes(text) == sizes


@pytest.mark.parametrize(("text", "fragments"), [
    ("", ["-n needs sizes, e.g. -n 1,2,4"]),
    (",", ["-n needs sizes"]),
    ("1,x", ["'x' is not a whole number", "e.g. -n 1,2,4"]),
    ("1-4", ["'1-4' is not a whole number"]),
    ("1,,2", ["'' is not a whole number"]),
    ("1,2,", ["'' is not a whole number"]),
    ("1.5", ["'1.5' is not a whole number"]),
    ("²", ["'²' is not a whole number"]),
    ("0,1", ["at least 1, got 0"]),
    ("1,2,2", ["-n: size 2 is given twice; e.g. -n 1,2,4 (each size once; --repeat K"]),
])
def test_bad_sizes_are_errors_that_show_the_form(text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        scaling.parse_sizes(text)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(("total", "sizes"), [
    (1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)),
    (8, (1, 2, 4, 8)), (12, (1, 2, 4, 8, 12)),
])
def test_default_sizes_are_powers_of_two_and_the_total(total: int,
                                                       sizes: tuple[int, ...]) -> None:
    assert scaling.default_sizes(total) == sizes


@pytest.mark.parametrize(("sizes", "repeat", "runs"), [
    ((1, 2), 1, [(1, 1), (2, 1)]),
    ((1, 2), 2, [(1, 1), (2, 1), (1, 2), (2, 2)]),
    ((4, 1, 2), 1, [(1, 1), (2, 1), (4, 1)]),
    ((1, 2, 4), 3, [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (1, 3), (2, 3), (4, 3)]),
])
def test_plan_takes_the_sizes_in_turn(sizes: tuple[int, ...], repeat: int,
                                      runs: list[tuple[int, int]]) -> None:
    assert scaling.plan(sizes, repeat) == runs


@pytest.mark.parametrize(("name", "parsed"), [
    ("n1-r1.jsonl", (1, 1)), ("n16-r3.jsonl", (16, 3)), ("n0-r1.jsonl", None),
    ("n2-r1.log", None), ("throughput.jsonl", None), ("n2.jsonl", None), ("xn2-r1.jsonl", None),
])
def test_run_file_names(name: str, parsed: tuple[int, int] | None) -> None:
    assert scaling.parse_run_name(name) == parsed
    if parsed:
        assert scaling.run_name(*parsed) == name


@pytest.mark.parametrize(("kwargs", "argv"), [
    ({}, ["PY", "-m", "tfdist", "launch", "-n", "2", "train.py", "--epochs=2"]),
    ({"launch_args": ("--no-pin",)},
     ["PY", "-m", "tfdist", "launch", "-n", "2", "--no-pin", "train.py", "--epochs=2"]),
    ({"module": True}, ["PY", "-m", "tfdist", "launch", "-n", "2", "-m", "train.py",
                        "--epochs=2"]),
])
def test_each_run_is_tfdist_launch_with_the_same_python(kwargs: dict[str, Any],
                                                         argv: list[str]) -> None:
    assert scaling.launch_command("train.py", ["--epochs=2"], 2, python="PY", **kwargs) == argv


@pytest.mark.parametrize("arg", ["-n", "-n3", "--num-workers", "--num-workers=3"])
def test_launch_args_cannot_set_the_size(arg: str) -> None:
    with pytest.raises(ConfigError, match="give them with tfdist scaling -n"):
        scaling.launch_command("t.py", [], 2, launch_args=(arg,))


# --------------------------------------------------------------------------------------------
# The meter's records


def test_epoch_records_are_read_and_other_lines_skipped() -> None:
    text = "\n" + jsonl(record(1, 2, 2000.0), {"event": "start", "workers": 2},
                        record(0, 2, None, batch=None, step_s=0.05)) + "\n"
    epochs = scaling.parse_epochs(text)
    assert [e.epoch for e in epochs] == [0, 1]  # ordered by epoch
    assert epochs[0] == Epoch(epoch=0, workers=2, backend="mwms", global_batch=None, steps=64,
                              step_median=0.05, step_q1=0.9 * 0.05, step_q3=1.2 * 0.05,
                              examples_per_s=None)
    assert (epochs[1].examples_per_s, epochs[1].global_batch) == (2000.0, 64)


def _broken(**changes: Any) -> str:
    good = record(0, 2, 1000.0)
    for key, value in changes.items():
        if value is None:
            good.pop(key)
        else:
            good[key] = value
    return json.dumps(good)


@pytest.mark.parametrize(("line", "fragment"), [
    ('{"event": "epoch", "epoch": 0', "f.jsonl:2 is not JSON"),
    ("[1, 2]", "f.jsonl:2 is not a JSON object"),
    (_broken(step_time_s=None), "f.jsonl:2: the epoch record's 'step_time_s' must be an object"),
    (_broken(workers="2"), "'workers' must be a whole number, got '2'"),
    (_broken(workers=0), "'workers' must be more than 0"),
    (_broken(epoch=True), "'epoch' must be a whole number, got True"),
    (_broken(step_time_s={"median": 0, "q1": 0, "q3": 0}), "'step_time_s.median' must be more"),
    (_broken(step_time_s={"median": 0.1, "q3": 0.2}), "'q1' must be a number, got None"),
    (_broken(examples_per_s={"total": "fast"}), "'total' must be a number, got 'fast'"),
    (_broken(global_batch=6.4), "'global_batch' must be a whole number"),
])
def test_bad_records_name_the_file_line_and_the_writer(line: str, fragment: str) -> None:
    with pytest.raises(TfdistError) as info:
        scaling.parse_epochs(jsonl(record(0, 2, 1000.0)) + line + "\n", "f.jsonl")
    assert fragment in str(info.value)
    assert "dist.callbacks() with TFDIST_THROUGHPUT_FILE set" in str(info.value)


def test_a_run_file_must_exist_hold_epochs_and_match_its_size(tmp_path: Path) -> None:
    path = tmp_path / "n2-r1.jsonl"
    with pytest.raises(TfdistError, match=r"wrote no throughput file .*pass dist.callbacks\(\)"):
        scaling.read_run(path, 2, 1)
    path.write_text(jsonl({"event": "start"}))
    with pytest.raises(TfdistError, match="holds no epoch record"):
        scaling.read_run(path, 2, 1)
    path.write_text(jsonl(record(0, 1, 900.0), record(1, 1, 1000.0)))
    with pytest.raises(TfdistError, match=r"the run of 2 worker\(s\), but its epochs report 1 "
                                          r"worker\(s\).*tfdist.init\(\)"):
        scaling.read_run(path, 2, 1)


def test_load_runs_reads_the_runs_folder_in_order(tmp_path: Path) -> None:
    with pytest.raises(TfdistError, match=r"holds no run files .*tfdist scaling -n 1,2 --out"):
        scaling.load_runs(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    for workers, repeat in [(2, 1), (1, 2), (1, 1), (10, 1)]:
        (runs / scaling.run_name(workers, repeat)).write_text(jsonl(record(0, workers, 100.0)))
    (runs / "n1-r1.log").write_text("the launcher's output, not a run\n")
    loaded = scaling.load_runs(tmp_path)
    assert [(run.workers, run.repeat) for run in loaded] == [(1, 1), (1, 2), (2, 1), (10, 1)]


# --------------------------------------------------------------------------------------------
# The report


@pytest.mark.parametrize(("rates", "rate"), [
    ([1000.0], 1000.0),                          # one epoch: it counts
    ([10.0, 1000.0], 1000.0),                    # the first epoch traces: left out
    ([10.0, 900.0, 1000.0, 2000.0], 1000.0),     # the median of the rest
    ([10.0, 900.0, 1000.0], 950.0),
])
def test_a_runs_throughput_is_the_median_after_the_first_epoch(rates: list[float],
                                                               rate: float) -> None:
    assert scaling.run_rate(make_run(1, list(rates)), scaling.EXAMPLES) == pytest.approx(rate)


# (workers, repeat, per-epoch rates) -> per size: (total, min, max, speed-up, efficiency %)
SUMMARIES: list[tuple[list[tuple[int, int, list[float]]], list[tuple[float, ...]]]] = [
    ([(1, 1, [5.0, 1000.0, 1000.0]), (2, 1, [5.0, 1800.0, 1800.0])],
     [(1000.0, 1000.0, 1000.0, 1.0, 100.0), (1800.0, 1800.0, 1800.0, 1.8, 90.0)]),
    # The base is the fewest workers measured: 2 here, so 8 workers are 4 times as many.
    ([(2, 1, [1, 2000.0]), (8, 1, [1, 6000.0])],
     [(2000.0, 2000.0, 2000.0, 1.0, 100.0), (6000.0, 6000.0, 6000.0, 3.0, 75.0)]),
    # Repeats: the median, and the range.
    ([(1, 1, [1, 1000.0]), (1, 2, [1, 1100.0]), (1, 3, [1, 900.0]),
      (4, 1, [1, 3000.0]), (4, 2, [1, 3600.0]), (4, 3, [1, 3500.0])],
     [(1000.0, 900.0, 1100.0, 1.0, 100.0), (3500.0, 3000.0, 3600.0, 3.5, 87.5)]),
    # Superlinear is reported as it is.
    ([(1, 1, [1000.0]), (2, 1, [2200.0])],
     [(1000.0, 1000.0, 1000.0, 1.0, 100.0), (2200.0, 2200.0, 2200.0, 2.2, 110.0)]),
]


@pytest.mark.parametrize(("runs", "expected"), SUMMARIES)
def test_speedup_and_efficiency_against_the_fewest_workers(
        runs: list[tuple[int, int, list[float]]], expected: list[tuple[float, ...]]) -> None:
    report = scaling.summarize([make_run(w, list(rates), k) for w, k, rates in runs])
    got = [(row.total, row.total_min, row.total_max, row.speedup, row.efficiency_pct)
           for row in report.rows]
    assert got == [pytest.approx(row) for row in expected]
    base = report.rows[0]
    for row in report.rows:
        assert row.per_worker == pytest.approx(row.total / row.workers)
        assert row.ideal_total == pytest.approx(row.workers * base.total / base.workers)
    assert report.unit == "examples/s"


def test_step_times_are_medians_of_the_kept_epochs_in_ms() -> None:
    epochs = [record(i, 1, None, batch=None, step_s=s) for i, s in enumerate((1.0, 0.01, 0.02))]
    run = Run(1, 1, tuple(scaling.parse_epochs(jsonl(*epochs))), "x")
    (row,) = scaling.summarize([run]).rows
    assert (row.step_ms, row.step_q1_ms, row.step_q3_ms) == pytest.approx((15.0, 13.5, 18.0))


def test_without_the_global_batch_throughput_is_in_steps_per_second() -> None:
    report = scaling.summarize([
        make_run(1, [None, None], batch=None, step_s=0.010),
        make_run(2, [None, None], batch=None, step_s=0.0125)])
    assert report.unit == "steps/s"
    assert [row.total for row in report.rows] == pytest.approx([100.0, 80.0])
    assert report.rows[1].efficiency_pct == pytest.approx(40.0)
    text = scaling.markdown(report)
    assert "| workers | steps/s (total) | steps/s per worker |" in text
    assert "The global batch size was not known to the meter" in text
    # One size without the batch is enough: sizes must be compared in one unit.
    mixed = scaling.summarize([make_run(1, [1000.0]),
                               make_run(2, [None], batch=None, step_s=0.04)])
    assert mixed.unit == "steps/s"


def test_markdown_and_csv_hold_the_same_numbers() -> None:
    report = scaling.summarize([make_run(1, [1.0, 1000.0], 1), make_run(1, [1.0, 1100.0], 2),
                                make_run(2, [1.0, 1800.0], 1), make_run(2, [1.0, 1700.0], 2)])
    text = scaling.markdown(report)
    assert text.startswith("# Scaling efficiency\n")
    assert "the median over 2 runs, with their range" in text
    assert "Global batch: 64 at every size." in text and "Backend: mwms." in text
    assert text.splitlines()[4:8] == [
        "| workers | examples/s (total) | examples/s per worker | speed-up | efficiency % "
        "| step time ms (q1..q3) |",
        "|---:|---:|---:|---:|---:|---:|",
        "| 1 | 1050.0 (1000.0..1100.0) | 1050.0 | 1.00 | 100.0 | 61.1 (55.0..73.3) |",
        "| 2 | 1750.0 (1700.0..1800.0) | 875.0 | 1.67 | 83.3 | 36.6 (32.9..43.9) |",
    ]
    rows = list(csv.DictReader(io.StringIO(scaling.csv_text(report))))
    assert list(rows[0]) == list(scaling.CSV_COLUMNS)
    assert [(r["workers"], r["runs"], r["unit"], r["total"], r["total_min"], r["speedup"],
             r["ideal_total"], r["global_batch"]) for r in rows] == [
        ("1", "2", "examples/s", "1050", "1000", "1", "1050", "64"),
        ("2", "2", "examples/s", "1750", "1700", "1.66667", "2100", "64")]
    assert float(rows[1]["efficiency_pct"]) == pytest.approx(83.3333, abs=1e-3)


def _with_ranks(epoch: int, workers: int, queued: list[float], slow: int | None = None
                ) -> dict[str, Any]:
    ranks = [{"rank": r, "host": "h", "cpu_s": 0.01, "queued_s": q, "input_s": None}
             for r, q in enumerate(queued)]
    return {**record(epoch, workers, 1000.0), "ranks": ranks,
            "slow": None if slow is None else {"rank": slow, "cause": "cpu"}}


def test_the_report_shows_the_slowest_ranks_extra_wait_and_who_was_named() -> None:
    one = Run(1, 1, tuple(scaling.parse_epochs(jsonl(record(0, 1, 1000.0),
                                                     record(1, 1, 1000.0)))), "n1-r1.jsonl")
    two = Run(2, 1, tuple(scaling.parse_epochs(jsonl(
        _with_ranks(0, 2, [0.001, 0.040], slow=1), _with_ranks(1, 2, [0.002, 0.012]),
        _with_ranks(2, 2, [0.030, 0.002], slow=0)))), "n2-r1.jsonl")
    four = Run(4, 1, tuple(scaling.parse_epochs(jsonl(*(_with_ranks(
        e, 4, [0.001, 0.002, 0.003, 0.009]) for e in range(2))))), "n4-r1.jsonl")
    assert [e.rank_excess_s for e in two.epochs] == pytest.approx([0.039, 0.010, 0.028])
    report = scaling.summarize([one, two, four])
    # 2 workers: the kept epochs' 10 and 28 ms; 4: 9 - median(1, 2, 3) = 7 ms; the first epoch
    # (and its rank named) is not counted
    assert [(r.rank_excess_ms, r.slow_ranks) for r in report.rows] == [
        (None, ()), (pytest.approx(19.0), (0,)), (pytest.approx(7.0), ())]
    text = scaling.markdown(report)
    assert "| step time ms (q1..q3) | slowest rank's extra wait ms |" in text
    assert text.count(" - |") == 1 and "| 19.0 |" in text and "| 7.0 |" in text
    assert "On 2 workers the chief named rank(s) 0 slow" in text
    assert "rank_excess_ms" in scaling.csv_text(report).splitlines()[0]


@pytest.mark.parametrize(("epochs", "says", "warns"), [
    ([[1.0, 1000.0], [1.0, 1800.0]], "(1 epoch(s) counted)", False),
    ([[1.0, 1000.0, 1000.0], [1.0, 1800.0]], "(1/2 epoch(s) counted)", False),
    ([[1000.0], [1.0, 1800.0]], "(1 epoch(s) counted)", True),
])
def test_markdown_says_which_epochs_counted(epochs: list[list[float]], says: str,
                                            warns: bool) -> None:
    text = scaling.markdown(scaling.summarize([make_run(1, epochs[0]), make_run(2, epochs[1])]))
    assert f"the median over its epochs after the first, which traces the model {says}" in text
    assert ("A run of one epoch counts that one, tracing included: train 2 or more" in text) \
        == warns


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk; fails if ``path`` is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@needs("matplotlib")
def test_the_plot_draws_the_reports_points(tmp_path: Path) -> None:
    report = scaling.summarize([make_run(1, [1000.0]), make_run(2, [1800.0]),
                                make_run(4, [3000.0])])
    points = scaling.plot(report, tmp_path / "scaling.png")
    assert points == {
        "throughput": [(1.0, 1000.0), (2.0, 1800.0), (4.0, 3000.0)],
        "ideal": [(1.0, 1000.0), (2.0, 2000.0), (4.0, 4000.0)],
        "efficiency": [(1.0, 100.0), (2.0, pytest.approx(90.0)), (4.0, pytest.approx(75.0))],
    }
    width, height = png_size(tmp_path / "scaling.png")
    assert width > 400 and height > 300
    assert (tmp_path / "scaling.png").stat().st_size > 10_000


def test_without_matplotlib_md_and_csv_are_written_and_the_hint_said_once(
        tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    for workers, rate in [(1, 1000.0), (2, 1500.0)]:
        (tmp_path / "runs" / scaling.run_name(workers, 1)).write_text(
            jsonl(record(0, workers, rate)))
    hide = "import sys; sys.modules['matplotlib'] = None; from tfdist.cli import main; " \
           "sys.exit(main(sys.argv[1:]))"
    result = subprocess.run([sys.executable, "-c", hide, "scaling", "--report", str(tmp_path)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("install tfdist[plot] for the plot") == 1, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "scaling.csv", "scaling.md"]
    assert "| 2 | 1500.0 | 750.0 | 1.50 | 75.0 |" in (tmp_path / "scaling.md").read_text()


# --------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(("argv", "fragment"), [
    (["scaling", "t.py"], "give the sizes and the script: tfdist scaling -n 1,2,4 SCRIPT.py"),
    (["scaling", "-n", "1,2"], "give the sizes and the script"),
    (["scaling", "-n", "1,two", "t.py"], "-n '1,two': 'two' is not a whole number"),
    (["scaling", "--report", "d", "t.py"], "--report DIR builds the report from DIR/runs and "
                                           "runs nothing"),
    (["scaling", "--report", "d", "-n", "1,2"], "leave out -n and SCRIPT"),
    (["scaling", "-n", "1,2", "--launch-arg=-n", "t.py"], "the sizes set tfdist launch's -n"),
])
def test_cli_errors_exit_2_and_name_the_fix(argv: list[str], fragment: str,
                                            capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist: ") and fragment in err, err
    assert not list(tmp_path.iterdir()), "nothing runs or is written"


def test_cli_report_of_an_empty_folder_says_how_to_measure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["scaling", "--report", str(tmp_path)]) == 2
    assert "measure first, with `tfdist scaling -n 1,2 --out" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Real runs of a stand-in worker: `tfdist launch` processes, no TensorFlow

# Writes the meter's records from rank 0 (epoch 0 at half speed, as tracing would make it):
# 1000 examples/s per worker on one worker, 900 on more. argv[1]: "ok", "fail" (size 2 fails),
# "hang" (size 2 sleeps), "silent" (no records); argv[2]: a file each run's rank 0 appends to.
STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    mode, order = sys.argv[1], sys.argv[2]
    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(f"stand-in rank {rank} of {workers}", flush=True)
    if rank == 0:
        with open(order, "a") as f:
            f.write(f"{workers} {os.environ['TFDIST_THROUGHPUT_FILE']}\\n")
    if workers == 2 and mode == "fail":
        print("stand-in: failing on purpose", flush=True)
        sys.exit(3)
    if workers == 2 and mode == "hang":
        time.sleep(120)
    if rank == 0 and mode != "silent":
        rate = 1000.0 * workers * (1.0 if workers == 1 else 0.9)
        with open(os.environ["TFDIST_THROUGHPUT_FILE"], "a") as f:
            for epoch in range(3):
                r = rate / 2 if epoch == 0 else rate
                f.write(json.dumps({"event": "epoch", "epoch": epoch, "workers": workers,
                    "backend": "mwms", "global_batch": 64, "steps": 8,
                    "step_time_s": {"median": 64 / r, "q1": 60 / r, "q3": 70 / r},
                    "examples_per_s": {"total": r, "per_worker": r / workers}}) + "\\n")
""")


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "stand_in.py"
    path.write_text(STAND_IN)
    return path


def _scaling(args: list[str], cwd: Path, timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TFDIST_THROUGHPUT_FILE", None)
    return subprocess.run([sys.executable, "-m", "tfdist", "scaling", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@multiprocess
def test_runs_take_turns_and_each_writes_its_own_file(tmp_path: Path, stand_in: Path) -> None:
    order = tmp_path / "order.txt"
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "n4-r1.jsonl").write_text("an earlier measurement's run\n")
    result = _scaling(["-n", "2,1", "--repeat", "2", "--out", "out", "--launch-arg=--no-pin",
                       str(stand_in), "ok", str(order)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (out / "runs" / "n4-r1.jsonl").exists()
    assert "removed 1 earlier run(s) of other sizes from out/runs: n4-r1.jsonl" in result.stdout
    runs = [line.split() for line in order.read_text().splitlines()]
    assert runs == [[str(w), str(out.resolve() / "runs" / f"n{w}-r{k}.jsonl")]
                    for w, k in [(1, 1), (2, 1), (1, 2), (2, 2)]]
    lines = [line for line in result.stdout.splitlines()  # notes: on fewer than 2 cores
             if not line.startswith(("tfdist scaling: note:", "tfdist scaling: removed"))]
    assert lines[0] == "tfdist scaling: 4 run(s) of 1, 2 worker(s), 2 time(s) each; files in out"
    assert [line.split(":")[1].split(",")[0] for line in lines[1:5]] == [
        " 1 worker(s)", " 2 worker(s)", " 1 worker(s)", " 2 worker(s)"]
    assert "2 worker(s), repeat 2/2: 1800.0 examples/s" in lines[4]
    assert lines[5:8] == [scaling.table(scaling.summarize(scaling.load_runs(out))).splitlines()[i]
                          for i in range(3)]
    assert "| 2 | 1800.0 (1800.0..1800.0) | 900.0 | 1.80 | 90.0 |" in result.stdout
    assert (out / "runs" / "n2-r2.log").read_text().count("stand-in rank") == 2
    assert {"scaling.md", "scaling.csv"} <= {p.name for p in out.iterdir()}


@multiprocess
def test_a_failed_run_stops_and_shows_its_size_and_last_lines(tmp_path: Path,
                                                              stand_in: Path) -> None:
    result = _scaling(["-n", "1,2,4", "--out", "out", "--launch-arg=--no-pin", str(stand_in),
                       "fail", str(tmp_path / "order.txt")], tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "1 worker(s), repeat 1/1: 1000.0 examples/s" in result.stdout
    err = result.stderr
    assert "tfdist scaling: the run of 2 worker(s) (repeat 1) failed with exit code 3" in err
    assert "stand-in: failing on purpose" in err and "n2-r1.log" in err
    assert len((tmp_path / "order.txt").read_text().splitlines()) == 2, "4 workers never ran"
    assert not (tmp_path / "out" / "scaling.md").exists()


@multiprocess
def test_a_run_past_its_timeout_is_stopped(tmp_path: Path, stand_in: Path) -> None:
    result = _scaling(["-n", "1,2", "--timeout", "3", "--out", "out", "--launch-arg=--no-pin",
                       str(stand_in), "hang", str(tmp_path / "order.txt")], tmp_path, timeout=60)
    assert result.returncode == 124, result.stdout + result.stderr
    assert "the run of 2 worker(s) (repeat 1) did not end within --timeout 3 s and was " \
           "stopped" in result.stderr
    assert "stand-in rank 1 of 2" in result.stderr  # its last lines


@multiprocess
def test_a_run_without_records_names_the_callbacks(tmp_path: Path, stand_in: Path) -> None:
    result = _scaling(["-n", "1", "--out", "out", str(stand_in), "silent",
                       str(tmp_path / "order.txt")], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the run of 1 worker(s) wrote no throughput file" in result.stderr
    assert "pass dist.callbacks() to model.fit" in result.stderr


# --------------------------------------------------------------------------------------------
# End to end: Keras training measured by tfdist's own throughput meter

HAS_METER = importlib.util.find_spec("tfdist.throughput") is not None


@multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_METER, reason="tfdist.throughput (the meter) is not there yet")
def test_scaling_a_keras_script_on_1_and_2_workers(tmp_path: Path) -> None:
    result = _scaling(["-n", "1,2", "--out", "out", str(WORKERS / "scaling_worker.py"),
                       "--epochs=2", "--steps=32"], tmp_path, timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = tmp_path / "out"
    rows = list(csv.DictReader((out / "scaling.csv").open()))
    assert [row["workers"] for row in rows] == ["1", "2"], rows
    assert all(row["unit"] == "examples/s" and row["global_batch"] == "64" for row in rows), rows
    assert all(float(row["total"]) > 0 and float(row["step_ms"]) > 0 for row in rows), rows
    assert float(rows[0]["efficiency_pct"]) == 100.0 and float(rows[0]["speedup"]) == 1.0
    assert 0 < float(rows[1]["efficiency_pct"]) < 200, rows
    table = (out / "scaling.md").read_text()
    assert table.count("\n| 1 | ") == 1 and table.count("\n| 2 | ") == 1, table
    for workers in (1, 2):  # the meter's records: 2 epochs each, from the chief alone
        epochs = scaling.parse_epochs((out / "runs" / f"n{workers}-r1.jsonl").read_text())
        assert [(e.epoch, e.workers) for e in epochs] == [(0, workers), (1, workers)]
    if HAS_MATPLOTLIB:
        width, height = png_size(out / "scaling.png")
        assert width > 400 and height > 300 and (out / "scaling.png").stat().st_size > 10_000
    else:
        assert "install tfdist[plot] for the plot" in result.stdout
