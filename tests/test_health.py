"""Per-rank health (tfdist/health.py): the straggler's verdict, the gather's packing, the
two-epochs rule and the input advice, as tables; then real 2-worker runs: a noisy neighbour on
one rank's core under MWMS and Horovod (the rank named), and a torch loop starved by its input
(the advice, no rank named). That balanced runs name nobody: benchmarks/rank_profile.py."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
from helpers import HOROVOD_PYTHON, ROOT, WORKERS, clean_env, full_matrix_only, require

from tfdist import health
from tfdist.health import RankProfile


def _ranks(*rows: tuple[float | None, float | None, float | None]) -> list[RankProfile]:
    return [RankProfile(rank, f"n{rank}", *row) for rank, row in enumerate(rows)]


STEP = 0.1
SLOWEST = {
    # name: (each rank's (cpu_s, queued_s, input_s) per step, (rank, cause) named or None)
    "balanced": ([(0.08, 0.004, None), (0.081, 0.006, None)], None),
    "balanced, four ranks, one a little off": (
        [(0.08, 0.004, 0.001), (0.08, 0.005, 0.001), (0.09, 0.01, 0.002), (0.08, 0.004, 0.001)],
        None),
    "a neighbour on rank 1's core": ([(0.08, 0.004, None), (0.07, 0.09, None)], (1, "cpu")),
    "a loaded machine, balanced: queue waits 0.35 of the step apart": (
        [(0.08, 0.1, None), (0.08, 0.135, None)], None),
    "rank 2 of 3 waits for its input": (
        [(0.05, 0.0, 0.001), (0.05, 0.0, 0.002), (0.05, 0.0, 0.07)], (2, "input")),
    "rank 0 computes slowly": ([(0.09, 0.0, None), (0.03, 0.0, None)], (0, "compute")),
    "a busier rank that is not 1.5 times the median": (
        [(0.3, 0.0, None), (0.42, 0.0, None)], None),
    "the queue before the computation: a neighbour makes its work slower too": (
        [(0.05, 0.0, None), (0.09, 0.06, None)], (1, "cpu")),
    "a rank without schedstat: the queue is not judged": (
        [(0.08, None, None), (0.08, 0.09, None)], None),
    "one rank": ([(0.08, 0.5, 0.5)], None),
}


@pytest.mark.parametrize("case", sorted(SLOWEST))
def test_the_rank_that_slows_everyone_is_found_with_its_cause(case):
    rows, expected = SLOWEST[case]
    found = health.slowest(_ranks(*rows), STEP)
    assert (None if found is None else (found.rank, found.cause)) == expected
    if found is not None:
        assert found.host == f"n{found.rank}" and found.excess_s > health.THRESHOLD * STEP


VERDICT = {
    # name: (each rank's (cpu_s, queued_s, input_s) per step, (rank, cause) named, advised)
    # Every rank's pipeline too slow (measured in fit on 2 workers: 22 and 1.5 ms of a 31 ms
    # step, the rank waiting turning between epochs): the advice, no rank named.
    "2 ranks input-bound, one shows the wait": (
        [(0.008, 0.0, 0.07), (0.008, 0.0, 0.005)], None, True),
    "rank 2 of 3 alone waits for its input": (
        [(0.05, 0.0, 0.001), (0.05, 0.0, 0.002), (0.05, 0.0, 0.07)], (2, "input"), False),
    "every rank waits for its input": ([(0.05, 0.0, 0.04), (0.05, 0.0, 0.04)], None, True),
    "a neighbour, and the input": ([(0.05, 0.09, 0.04), (0.05, 0.0, 0.04)], (0, "cpu"), True),
    "balanced": ([(0.08, 0.004, 0.001), (0.081, 0.006, 0.001)], None, False),
}


@pytest.mark.parametrize("case", sorted(VERDICT))
def test_a_rank_is_not_named_for_its_input_when_the_whole_job_waits_for_input(case):
    rows, named, advised = VERDICT[case]
    finding, advice = health.verdict(_ranks(*rows), STEP)
    assert (None if finding is None else (finding.rank, finding.cause)) == named
    assert (advice is not None) is advised
    # A first epoch: its reads include the pipeline's start; the input is not judged.
    finding, advice = health.verdict(_ranks(*rows), STEP, judge_input=False)
    assert advice is None and (finding is None or finding.cause != "input")


def test_the_sum_of_every_ranks_slots_is_every_ranks_profile():
    rows = [(0, 0.08, 0.004, None), (1, 0.07, 0.06, 0.01), (1, 0.08, None, 0.0)]
    summed = [0.0] * (3 * len(health.FIELDS))
    for rank, (node, *figures) in enumerate(rows):
        mine = health.pack(rank, 3, node, *figures)
        assert len(mine) == len(summed) and sum(1 for v in mine if v != 0) <= len(health.FIELDS)
        summed = [a + b for a, b in zip(summed, mine, strict=True)]
    profiles = health.unpack(summed, ("n9", "n10"))
    assert profiles == [RankProfile(0, "n9", 0.08, 0.004, None),
                        RankProfile(1, "n10", 0.07, 0.06, 0.01),
                        RankProfile(2, "n10", 0.08, None, 0.0)]
    assert health.unpack(health.pack(0, 1, 5, 0.1, 0.0, None), ("n9",))[0].host == "node 5"


def test_a_rank_is_named_after_two_epochs_in_a_row_and_once_per_stretch():
    watch = health.Watch()
    slow = health.Finding(1, "n10", "cpu", 0.05, 0.1)
    other = health.Finding(0, "n9", "compute", 0.05, 0.1)
    seen = [watch.see(f) for f in (slow, None, slow, other, slow, slow, slow)]
    assert [s is not None for s in seen] == [False, False, False, False, False, True, True]
    line = seen[5]
    assert line is not None and line.startswith("rank 1 (host n10) is slow in 2 epochs in a row")
    assert "Likely cause: cpu" in line and "top -H on n10" in line and "50 % of the 100 ms" in line


@pytest.mark.parametrize("cause", ["cpu", "input", "compute"])
def test_each_cause_names_the_rank_its_host_and_a_fix(cause):
    line = health.Finding(3, "gpu17", cause, 0.03, 0.12).line(2)
    assert line.startswith("rank 3 (host gpu17) is slow") and f"Likely cause: {cause}." in line
    assert "25 % of the 120 ms step" in line


INPUT_ADVICE = {
    # name: (each rank's input_s per step, advice given)
    "starved": ([0.06, 0.07], True),
    "fed": ([0.001, 0.002], False),
    # fit's reads of an in-memory dataset fed in time, a 7 ms step on a loaded machine
    "fed, each read costing its millisecond": ([0.021, 0.015], False),
    "one rank starved is a straggler, not advice": ([0.001, 0.09, 0.001], False),
    "not measured": ([None, None], False),
}


@pytest.mark.parametrize("case", sorted(INPUT_ADVICE))
def test_the_input_advice_comes_when_the_median_rank_waits_for_input(case):
    waits, advised = INPUT_ADVICE[case]
    profiles = [RankProfile(r, "h", 0.05, 0.0, w) for r, w in enumerate(waits)]
    advice = health.input_advice(profiles, STEP)
    assert (advice is not None) is advised
    if advice:
        assert advice.startswith("waiting for input takes 65 % of each step (65 ms of 100 ms)")
        assert "num_parallel_calls=tf.data.AUTOTUNE" in advice and "--cpus-per-task" in advice


def test_this_processs_counters_are_read():
    cpu, queued = health.cpu_counters()
    assert cpu > 0
    assert queued is None or queued >= 0


NOISY_FROM, EPOCHS = 3, 8


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["mwms", pytest.param("horovod", marks=full_matrix_only(
    "the timing and the verdict run under MWMS, and Horovod's dist.sum_over_ranks, which "
    "gathers them, in the Keras-traps launch on tf_keras"))])
def test_a_rank_sharing_its_core_is_named_slow(tmp_path, backend):
    # Epochs 1-3 as they come, then a busy process on rank 1's core for 5 epochs, with rank 1's
    # threads at nice 10 (straggler_worker.py says why): the chief names rank 1 for a CPU, and
    # no other rank, once it was found in two in a row.
    # Nothing is asserted of the first epochs here: beside CI's other tests a core is not quiet
    # (a run named rank 1 in them, rightly: another test's worker shared its core). That a
    # balanced run names nobody is benchmarks/rank_profile.py's count on a quiet machine, and
    # the tables above.
    python = sys.executable
    if backend == "horovod":
        require("horovod", python=HOROVOD_PYTHON)
        python = str(HOROVOD_PYTHON)
    run = subprocess.run(
        [python, "-m", "tfdist", "launch", *(["--backend", "horovod"] * (backend == "horovod")),
         "-n", "2", str(WORKERS / "straggler_worker.py"), str(tmp_path), backend,
         str(NOISY_FROM), str(EPOCHS)],
        cwd=ROOT, env=clean_env(TF_CPP_MIN_LOG_LEVEL="2",
                                TF_USE_LEGACY_KERAS=str(int(backend == "horovod"))),
        capture_output=True, text=True, timeout=300, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    cores = [json.loads((tmp_path / f"cores-{rank}.json").read_text()) for rank in (0, 1)]
    assert not set(cores[0]) & set(cores[1]), cores  # pinned apart: the neighbours are rank 1's
    records = [json.loads(line) for line in
               (tmp_path / "model" / "throughput.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    for record in records:  # every epoch carries both ranks' figures
        assert [p["rank"] for p in record["ranks"]] == [0, 1], record
        assert record["profile_s"] > 0, record
    noisy = records[NOISY_FROM:]
    # Rank 1 waits longer for a CPU in most noisy epochs: all five, but in a clean-clone run
    # (Horovod) where another test's workers shared both cores and one epoch's order turned.
    more = [r["ranks"][1]["queued_s"] > r["ranks"][0]["queued_s"] for r in noisy]
    assert sum(more) >= 3, noisy
    # Under CI's load an epoch may stay below the threshold (at nice 0 a CI run found it in
    # none of 5): the rank found, whenever one is, is rank 1, for a CPU.
    found = [(r["slow"]["rank"], r["slow"]["cause"]) for r in noisy if r["slow"]]
    assert len(found) >= 2 and set(found) == {(1, "cpu")}, noisy
    second = output.index(f"tfdist: epoch {NOISY_FROM + 2}: ")  # the second noisy epoch's line
    named = re.findall(r"tfdist: rank (\d) \(host [^)]+\) is slow in (\d) epochs in a row: its "
                       r"threads waited \d+ ms a step longer than the others' for a CPU",
                       output[second:])
    assert named and all(rank == "1" for rank, _ in named), output[-4000:]
    assert "Likely cause: cpu" in output and "waiting for input takes" not in output


@pytest.mark.multiprocess
@pytest.mark.parametrize("loop", ["torch", "fit"])
def test_a_loop_starved_by_its_input_gets_the_advice_and_no_rank_is_named(tmp_path, loop):
    # torch: StepMeter.batches times each rank's waits; fit (Keras 3, MWMS): the steps time
    # their own reads of the batch inside their graph. Every rank's input is too slow.
    if loop == "torch":
        pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")
    run = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2",
         str(WORKERS / "starved_worker.py"), str(tmp_path), loop],
        cwd=ROOT, env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True,
        timeout=240, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert output.count("tfdist: waiting for input takes") == 1, output[-4000:]  # once
    assert " is slow " not in output, output[-4000:]
    records = [json.loads(line) for line in (tmp_path / "throughput.jsonl").read_text()
               .splitlines()]
    assert len(records) == 3, records
    assert {r["backend"] for r in records} == {"ddp" if loop == "torch" else "mwms"}, records
    for record in records:
        waits = [p["input_s"] for p in record["ranks"]]
        if loop == "torch":
            assert all(w > 0.5 * record["step_time_s"]["median"] for w in waits), record
        else:  # the rank whose batch comes last waits for it, the other for that rank
            assert statistics.median(waits) > health.INPUT_SHARE * record["step_time_s"][
                "median"], record
    if loop == "fit":  # the records hold what each rank's steps timed, epoch by epoch
        for rank in (0, 1):
            found = json.loads((tmp_path / f"waited-{rank}.json").read_text())
            waited = found["waited_s"]
            recorded = sum(r["ranks"][rank]["input_s"] * r["steps"] for r in records)
            assert waited > 0 and recorded == pytest.approx(waited, abs=1e-4), (waited, records)
            # The control, the same workers' conv net fed from a cache: its reads are a sliver
            # of its fit (0.6 %). The clock once counted the step's first ops too: 23-25 % here,
            # 75 % of the 18k net's Horovod steps, and the advice on a cached dataset.
            fed = found["fed"]
            assert fed["waited_s"] < 0.05 * fed["fit_s"], fed


@pytest.mark.multiprocess
def test_one_process_fit_times_its_input_reads_too(tmp_path):
    # One process (and Horovod) read through a plain tf.data iterator, not MWMS's per-worker
    # one: each 60 ms batch is waited for nearly whole, the step being a few ms.
    run = subprocess.run([sys.executable, str(WORKERS / "starved_worker.py"), str(tmp_path),
                          "fit"], cwd=ROOT, env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"),
                         capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    waited = json.loads((tmp_path / "waited-0.json").read_text())
    assert waited["waited_s"] > 0.5 * 0.06 * waited["steps"], waited
