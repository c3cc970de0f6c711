"""Preemption: a real signal on one rank (or the launcher) stops every rank at one agreed step,
the state there is saved atomically, the job exits 75, and ``tfdist launch --max-restarts``
starts it again, resuming at that step: bit-identical to an uninterrupted run, every step
trained once. Pure tables first, then real 2-worker runs (MWMS and Horovod).

The Slurm cluster's preemption and requeue are tested in test_slurm_jobs.py, the job-script
keys in test_jobs.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import HOROVOD_PYTHON, ROOT, WORKERS, clean_env, full_matrix_only, require

from tfdist import preemption
from tfdist.backends.single import SingleDistributed
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError
from tfdist.keras import input_position
from tfdist.keras.input_position import Position, Resume
from tfdist.keras.versions import keras2_package

WORKER = str(WORKERS / "preempt_worker.py")
HVD_PY = HOROVOD_PYTHON
STEPS_PER_EPOCH = 16  # 512 rows, global batch 32
REPEAT_STEPS_PER_EPOCH = 12  # PREEMPT_TEST_INPUT=repeat: steps_per_epoch over the repeated data


# --- pure ------------------------------------------------------------------------------------

FORKED_CHILD = """
import multiprocessing, signal, sys, time
from tfdist import preemption
# What TensorFlow's preemption notifier and tfdist's own handler do: record SIGTERM, go on.
signal.signal(signal.SIGTERM, lambda signum, frame: None)
if sys.argv[1] == "tfdist":
    preemption.default_signals_in_children()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
child.start()
time.sleep(0.5)
child.terminate()  # what a process pool's terminate() sends each child: SIGTERM
child.join(3)
print(child.exitcode)
if child.exitcode is None:
    child.kill()
"""


@pytest.mark.parametrize(("hook", "exitcode"), [("tfdist", str(-signal.SIGTERM)),
                                                ("control", "None")])
def test_a_forked_child_ends_on_sigterm_that_its_parent_only_records(hook, exitcode):
    # A PyDataset's process pool (use_multiprocessing=True) under MWMS hung the script at its
    # exit: its forked children inherited a handler that records SIGTERM, so the pool's
    # terminate() waited for them forever. The control, without tfdist's fork hook: alive.
    run = subprocess.run([sys.executable, "-c", FORKED_CHILD, hook], cwd=ROOT, env=clean_env(),
                         capture_output=True, text=True, timeout=60, check=False)
    assert (run.returncode, run.stdout.split()) == (0, [exitcode]), run.stderr[-3000:]


@pytest.mark.parametrize(("text", "expected"), [
    ("USR2", signal.SIGUSR2), ("SIGUSR2", signal.SIGUSR2), ("usr1", signal.SIGUSR1),
    (str(int(signal.SIGTERM)), signal.SIGTERM)])
def test_parse_signal(text, expected):
    assert preemption.parse_signal(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("USR9", "is not a signal"), ("KILL", "cannot be caught"), ("9", "cannot be caught")])
def test_parse_signal_refuses(text, message):
    with pytest.raises(ConfigError, match=message):
        preemption.parse_signal(text)


def test_the_users_signal_joins_term_and_usr1(monkeypatch):
    monkeypatch.setenv("TFDIST_PREEMPT_SIGNAL", "USR2")
    assert preemption.signals() == (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    monkeypatch.setenv("TFDIST_PREEMPT_SIGNAL", "TERM")
    assert preemption.signals() == (signal.SIGTERM, signal.SIGUSR1)


def _one_process() -> SingleDistributed:
    return SingleDistributed(ClusterEnvironment("single"),
                             SimpleNamespace(num_replicas_in_sync=1), "none", 0)


@pytest.mark.parametrize(("previous", "proposal", "expected"), [
    (1, 212.0, 2),  # a fast first step proposes 212: the interval only doubles
    (32, 40.5, 40),  # the mean of the ranks' proposals, rounded down
    (64, 37.0, 37),  # steps got slower: down at once
    (512, 5000.0, preemption.MAX_INTERVAL),
    (8, 0.4, 1),  # slower than check_seconds per step: every step
])
def test_the_check_interval_follows_the_proposals_doubling_at_most(previous, proposal, expected):
    assert preemption.next_interval(previous, proposal) == expected


def test_a_signal_is_recorded_and_stops_at_the_next_check():
    watch = preemption.Watch(_one_process(), check_seconds=3600, catch=[signal.SIGUSR2])
    previous = signal.getsignal(signal.SIGUSR2)
    watch.install()
    try:
        # However fast the steps, the interval after step 1's check doubles: 2, 4, 8, 16...
        checked = []
        for step in range(1, 33):
            before = watch.checks
            assert not watch.step()
            checked += [step] * (watch.checks - before)
        assert checked == [1, 3, 7, 15, 31]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert watch.signal == signal.SIGUSR2
        assert not any(watch.step() for _ in range(30))  # the next check: step 31 + 32
        assert watch.step() and watch.checks == 6 and watch.step()  # then it stays stopped
        assert watch.checks == 6
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_an_epochs_end_checks_at_once():
    watch = preemption.Watch(_one_process(), check_seconds=3600, catch=[signal.SIGUSR2])
    watch.install()
    try:
        assert not watch.step()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert watch.check() and watch.step()  # an epoch's end checks; then it stays stopped
        assert watch.checks == 2
    finally:
        watch.uninstall()


def test_a_signal_never_acted_on_goes_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        watch = preemption.Watch(_one_process(), catch=[signal.SIGUSR2])
        watch.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == []  # recorded by tfdist only
        watch.uninstall()  # training ended before a check
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("failed", [False, True])
def test_a_late_signal_is_named_as_it_ended(monkeypatch, caplog, failed):
    # A signal after fit ended (a preemption in the script's last work, or a launcher's SIGTERM
    # after another rank failed): "ends normally" only where no exception went uncaught.
    monkeypatch.setitem(preemption._late, "signal", signal.SIGTERM)
    if failed:  # what Python sets when an exception reached the top
        monkeypatch.setattr(sys, "last_type", RuntimeError, raising=False)
    else:
        monkeypatch.delattr(sys, "last_type", raising=False)
    with caplog.at_level("WARNING", logger="tfdist"):
        preemption._say_late(1)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("tfdist: rank 1: SIGTERM came after training had ended"), line
    assert ("ends normally" in line) != failed, line
    assert ("while the script ended with an error (RuntimeError" in line) == failed, line


def test_commit_keeps_the_newest_and_the_one_before_complete_at_every_moment(tmp_path):
    def state(folder: Path, step: int) -> Path:
        folder.mkdir()
        (folder / preemption.STATE_FILE).write_text(json.dumps({"step": step}))
        return folder

    final = tmp_path / preemption.CHECKPOINT_DIR
    preemption.commit(str(state(tmp_path / "partial1", 1)), str(final))
    assert preemption.read_state(str(tmp_path))["step"] == 1
    # A kill between the two renames of the next commit leaves only the old one, still read.
    os.replace(final, f"{final}.old")
    assert preemption.read_state(str(tmp_path))["path"] == f"{final}.old"
    preemption.commit(str(state(tmp_path / "partial2", 2)), str(final))
    assert [s["step"] for s in preemption.read_states(str(tmp_path))] == [2, 1]
    # The next commit drops the oldest: the newest and the one before it stay.
    preemption.commit(str(state(tmp_path / "partial3", 3)), str(final))
    assert [s["step"] for s in preemption.read_states(str(tmp_path))] == [3, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        preemption.CHECKPOINT_DIR, f"{preemption.CHECKPOINT_DIR}.old"]
    assert preemption.read_state(str(tmp_path / "nothing")) is None


REQUEUE = {
    # name: (environment, max_requeues, scontrol, expected command or None, words in the reason)
    "srun step": (ClusterEnvironment("slurm", job_id="42"), 20, "/usr/bin/scontrol",
                  ["/usr/bin/scontrol", "requeue", "42"], "requeue 1 of 20"),
    "array task": (ClusterEnvironment("slurm", job_id="43", array_job_id="40",
                                      array_task_id="3", restart_count=2), 20, "scontrol",
                   ["scontrol", "requeue", "40_3"], "requeue 3 of 20"),
    "past the limit": (ClusterEnvironment("slurm", job_id="42", restart_count=20), 20,
                       "scontrol", None, "already requeued 20 times"),
    "no scontrol in the container": (ClusterEnvironment("slurm", job_id="42"), 20, None, None,
                                     "the job script requeues the job when srun exits with 75"),
    "not a Slurm job": (ClusterEnvironment("local"), 20, "scontrol", None, "--max-restarts"),
    "tfdist launch inside an allocation": (ClusterEnvironment("local", job_id="42"), 20,
                                           "scontrol", None, "--max-restarts"),
    "a step of tfdist survive": (ClusterEnvironment("slurm", job_id="42", step_loop="survive"),
                                 20, "scontrol", None, "tfdist survive runs this step"),
}


@pytest.mark.parametrize("case", sorted(REQUEUE))
def test_requeue_plan(case):
    environment, limit, scontrol, command, words = REQUEUE[case]
    found, reason = preemption.requeue_plan(environment, limit, scontrol)
    assert found == command and words in reason, (found, reason)


PLANS = {
    # name: (saved position, epoch, step, epoch_done, recreates, expected Resume)
    "mid-epoch, an iterator per epoch": (Position(3, 5), 1, 5, False, True, Resume(1, 5, 3, 5)),
    "mid-epoch, one iterator for all": (Position(1, 29), 2, 5, False, False,
                                        Resume(2, 5, 1, 29)),
    "at an epoch's end, an iterator per epoch": (Position(3, 16), 1, 16, True, True,
                                                 Resume(2, 0, 4, 0)),
    # Keras 3 made the next iterator already when the data ran out: its position says 0.
    "at an epoch's end, one iterator for all": (Position(2, 0), 1, 12, True, False,
                                                Resume(2, 0, 2, 0)),
    "while validating, one iterator for all": (Position(1, 24), 1, 12, True, False,
                                               Resume(2, 0, 1, 24)),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_resume_plan(case):
    saved, epoch, step, done, recreates, expected = PLANS[case]
    assert input_position.plan(saved, epoch, step, epoch_done=done, recreates=recreates) == expected


# --- real processes --------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    env = clean_env()
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **extra)
    return env


def _python(backend: str) -> str:
    """The Python that runs ``backend``'s workers; skips the test where Horovod's lacks it."""
    if backend != "horovod":
        return sys.executable
    require("horovod", python=HVD_PY)
    return str(HVD_PY)


def _launch(python: str, backend: str, args: list[str], *extra: str, workers: int = 2,
            worker: str = WORKER) -> list[str]:
    horovod = ["--backend", "horovod"] if backend == "horovod" else []
    return [python, "-m", "tfdist", "launch", *horovod, *extra, "-n", str(workers), worker,
            *args]


def _results(out: Path, run: int = 0, workers: int = 2) -> list[dict]:
    return [json.loads((out / f"result-{rank}-{run}.json").read_text())
            for rank in range(workers)]


def _check_stopped_together(out: Path, model: Path, signal_step: int, output: str) -> None:
    results = _results(out)
    assert [r["code"] for r in results] == [75, 75], output[-3000:]
    stops = {(r["epoch"], r["step"]) for r in results}
    assert len(stops) == 1, results  # one agreed step on every rank
    epoch, step = stops.pop()
    assert epoch * STEPS_PER_EPOCH + step >= signal_step, results
    assert epoch * STEPS_PER_EPOCH + step < 3 * STEPS_PER_EPOCH, results  # stopped early
    state = preemption.read_state(str(model))
    assert state and (state["epoch"], state["step"]) == (epoch, step), state
    assert state["path"] == str(model / preemption.CHECKPOINT_DIR)
    with zipfile.ZipFile(model / preemption.CHECKPOINT_DIR / "model.keras") as archive:
        assert archive.testzip() is None
    assert not list(model.glob(".preempted*")), list(model.iterdir())


CASES = {
    # name: (backend, Keras legacy flag, signal rank, signal step, signal). MWMS with Keras 3:
    # the soak below, each of its runs signalled on one rank or both (USR1 or TERM).
    "mwms-tf_keras-term-on-rank-0": ("mwms", "1", "0", "11", "TERM"),
    "horovod-keras3-term-on-rank-1": ("horovod", "0", "1", "11", "TERM"),
    "horovod-tf_keras-usr1-on-rank-0": ("horovod", "1", "0", "20", "USR1"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_signal_on_one_rank_stops_every_rank_at_one_step_with_the_state_saved(tmp_path, case):
    backend, legacy, rank, step, sig = CASES[case]
    python = _python(backend)
    out, model = tmp_path / "out", tmp_path / "model"
    out.mkdir()
    # Checks every 20 ms of training, so that the agreement also falls inside an epoch.
    run = subprocess.run(_launch(python, backend, [str(out), str(model), backend, rank, step,
                                                   sig]),
                         cwd=ROOT, env=_env(TF_USE_LEGACY_KERAS=legacy,
                                            TFDIST_PREEMPT_CHECK_SECONDS="0.02"),
                         capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 75, run.stdout[-3000:] + run.stderr[-3000:]
    _check_stopped_together(out, model, int(step), run.stdout)
    assert [r["signal"] for r in _results(out)][int(rank)] == f"SIG{sig}"
    assert "was preempted and saved its state" in run.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["mwms", pytest.param("horovod", marks=full_matrix_only(
    "the launcher forwards the signal under MWMS, and Horovod's ranks agree on the stop in the "
    "signal-on-one-rank cases"))])
def test_a_signal_to_the_launcher_reaches_every_worker(tmp_path, backend):
    python = _python(backend)
    out, model = tmp_path / "out", tmp_path / "model"
    out.mkdir()
    proc = subprocess.Popen(_launch(python, backend, [str(out), str(model), backend, "-1",
                                                      "0"]),
                            cwd=ROOT, env=_env(TFDIST_PREEMPT_CHECK_SECONDS="0.02"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "tfdist-test: rank 0 step 12" in line:
                proc.send_signal(signal.SIGUSR1)  # as Slurm's --signal=USR1@... would
        code = proc.wait(timeout=240)
    finally:
        proc.kill()
    output = "".join(lines)
    assert code == 75, output[-3000:]
    _check_stopped_together(out, model, 12, output)
    assert [r["signal"] for r in _results(out)] == ["SIGUSR1", "SIGUSR1"]


def _run(python: str, backend: str, out: Path, model: Path, rank: str, step: str, *extra: str,
         workers: int = 2, worker: str = WORKER, sig: str | None = None, timeout: float = 300,
         **env: str) -> subprocess.CompletedProcess[str]:
    out.mkdir(exist_ok=True)
    args = [str(out), str(model), backend, rank, step, *([sig] if sig else [])]
    return subprocess.run(_launch(python, backend, args, *extra, workers=workers, worker=worker),
                          cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout, check=False)


RESUME = {
    # name: (backend, TF_USE_LEGACY_KERAS, input (PREEMPT_TEST_INPUT), the rank signalled,
    #        after which step ("v10": at the tenth validation batch), steps in all)
    "mwms-keras3": ("mwms", "0", "epochs", "1", "20", 3 * STEPS_PER_EPOCH),
    "horovod-keras3": ("horovod", "0", "epochs", "0", "27", 3 * STEPS_PER_EPOCH),
    "horovod-tf_keras": ("horovod", "1", "epochs", "1", "23", 3 * STEPS_PER_EPOCH),
    # steps_per_epoch=12 over a repeated 16-batch dataset: one iterator for several epochs
    # (tf_keras's: its stop at an epoch's last step below skips the batches of that iterator
    # across an epoch's end, and its safety-save case resumes mid-epoch).
    "mwms-keras3-steps_per_epoch": ("mwms", "0", "repeat", "0", "22", 36),
    # Signalled at an epoch's last step: the stop waits for the epoch's end (resuming at
    # step 12 of 12 would leave tf_keras an epoch without steps).
    "mwms-tf_keras-at-an-epochs-last-step": ("mwms", "1", "repeat", "0", "12", 36),
    "mwms-keras3-at-an-epochs-last-step": ("mwms", "0", "repeat", "0", "12", 36),
    # A signal during validation: the soak below (its moments include one in every five runs).
    # Signalled at the last step of the last epoch: the resumed fit has nothing left to train,
    # and must still remove the state (left behind, the next fit would resume from it).
    "mwms-keras3-at-the-last-epochs-end": ("mwms", "0", "repeat", "0", "36", 36),
    # Keras 3 on JAX (KERAS_BACKEND=jax): a dataset reshuffled every epoch, and one iterator
    # over several epochs. JAX's iterators are generators: tfdist counts those drawn from.
    "jax-keras3": ("jax", "0", "epochs", "1", "20", 3 * STEPS_PER_EPOCH),
    "jax-keras3-steps_per_epoch": ("jax", "0", "repeat", "0", "22", 36),
}


_straight_runs: dict[tuple[str, ...], Path] = {}


def _straight(python: str, backend: str, folder: Path, env: dict[str, str]) -> Path:
    """The results folder of an uninterrupted run with ``env``: made once per interpreter,
    backend and environment, for every resume case that compares with it."""
    key = (python, backend, *sorted(env.items()))
    if key not in _straight_runs:
        straight = _run(python, backend, folder / "straight", folder / "m1", "-1", "0", **env)
        assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
        _straight_runs[key] = folder / "straight"
    return _straight_runs[key]


def _by_straight_run(cases: list[str], resume: dict[str, str] | None = None,
                     full_only: dict[str, str] | None = None) -> list:
    """``cases`` as parameters, each in the xdist group of its uninterrupted run (``resume``:
    each case's :data:`RESUME` case, where it is not the case itself): the tests that compare
    with one such run go to one test process, which makes it once (:func:`_straight`), not
    once in each process. ``full_only``: cases run in the full matrix only, each with what
    covers it in make test (tests/helpers.py)."""
    return [pytest.param(case, marks=[pytest.mark.xdist_group(
        "preemption-straight-" + "-".join(RESUME[(resume or {}).get(case, case)][:3])),
        *([full_matrix_only((full_only or {})[case])] if case in (full_only or {}) else [])])
        for case in cases]


def _resume_case(tmp_path_factory: pytest.TempPathFactory, case: str
                 ) -> tuple[str, str, Path, dict[str, str], Path]:
    """A :data:`RESUME` case's interpreter, backend, fresh folder, environment and the results
    folder of its uninterrupted run. The dataset reshuffles every epoch: a resumed run must see
    the stopped run's order, and draw the stopped run's Dropout masks."""
    backend, legacy, data = RESUME[case][:3]
    python = _python(backend)
    tmp_path = tmp_path_factory.mktemp(case)
    env = {"TF_USE_LEGACY_KERAS": legacy, "PREEMPT_TEST_INPUT": data, "PREEMPT_TEST_DROPOUT": "1",
           **({"KERAS_BACKEND": "jax"} if backend == "jax" else {})}
    return python, backend, tmp_path, env, _straight(python, backend, tmp_path, env)


# Run elsewhere, so not here (CI's time): a stop mid-epoch and its resume on MWMS with Keras 3
# in the soak and by the walltime guard of the Slurm job without a signal; on JAX (an epoch's
# dataset) by the walltime guard (the same agreement as a signal's); on JAX and on MWMS with
# tf_keras over one iterator from a safety save after a hard kill (the same state, the same
# resume); a stop at an epoch's last step by the soak's epoch-end moments; the rest in the full
# matrix (tests/helpers.py). Their uninterrupted runs are the references of those tests.
RESUMED_ELSEWHERE = {"mwms-keras3", "horovod-tf_keras", "mwms-keras3-at-an-epochs-last-step",
                     "jax-keras3", "jax-keras3-steps_per_epoch"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", _by_straight_run(sorted(set(RESUME) - RESUMED_ELSEWHERE)))
def test_a_resumed_run_trains_every_step_once_and_ends_bit_identical(tmp_path_factory, case):
    *_, rank, step, total = RESUME[case]
    python, backend, tmp_path, env, straight = _resume_case(tmp_path_factory, case)
    # A check after every step, so the stop comes at the first step after the signal.
    run = _run(python, backend, tmp_path / "out", tmp_path / "m2", rank, step,
               "--max-restarts", "2", TFDIST_PREEMPT_CHECK_SECONDS="0.00001", **env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "restarting all workers (1 of --max-restarts 2) after a preemption" in run.stderr
    assert "(2 of --max-restarts 2)" not in run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
    stopped, resumed = _results(tmp_path / "out", 0), _results(tmp_path / "out", 1)
    assert [r["code"] for r in stopped + resumed] == [75, 75, 0, 0]
    assert "resuming at step" in run.stdout and "backup instead" not in run.stdout
    expected = _results(straight)
    for before, after, alone in zip(stopped, resumed, expected, strict=True):
        assert before["steps"] + after["steps"] == alone["steps"] == total, (
            before, after)  # no step trained twice, none skipped
        assert after["digest"] == alone["digest"], (after, alone)  # weights and optimizer
    if int(step) == total:  # stopped at the end of training: the resumed fit trains nothing
        assert [r["steps"] for r in resumed] == [0, 0], resumed
    else:  # stopped inside an epoch
        assert stopped[0]["step"] > 0 and stopped[0]["steps"] < total, stopped
    assert not list((tmp_path / "m2").glob("preempted*"))  # removed once an epoch finished


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", _by_straight_run(
    ["mwms-keras3", "horovod-tf_keras", "jax-keras3", "jax-keras3-steps_per_epoch"], full_only={
        "mwms-keras3": "the guard stops MWMS's ranks in the Slurm test cluster's job without a "
                       "signal (tests/test_slurm_failures.py, the example, bit-identical) and "
                       "JAX's here, with the same agreement",
        "horovod-tf_keras": "the guard stops MWMS's and JAX's ranks here, Horovod's ranks "
                            "agree on a stop in the signal-on-one-rank cases, and tf_keras "
                            "under Horovod resumes mid-epoch after a hard kill",
        "jax-keras3-steps_per_epoch": "JAX's guard stops an epoch's dataset here (the hard "
                                      "kill's uninterrupted run serves both), and MWMS resumes "
                                      "over one iterator"}))
def test_the_walltime_guard_saves_in_time_with_no_signal_and_the_next_run_resumes(
        tmp_path_factory, case):
    # No signal at all: `tfdist launch --time-limit 60s` gives the workers their end, and the
    # margin (25 s) is reached 35 s after the launch, while the slowed steps (1 s each, 48 s of
    # training; 36 s with steps_per_epoch) run. The guard stops both ranks at one step, saves
    # and exits 75 before the launch's own stop at 60 s; the next launch (the requeued job)
    # resumes there. A start-up and first step slower than 35 s would be refused at the first
    # step, the margin stopping every run there (a restart loop): JAX's on CI's loaded 2 cores
    # took 28 s.
    total = RESUME[case][-1]
    python, backend, tmp_path, env, straight = _resume_case(tmp_path_factory, case)
    first = _run(python, backend, tmp_path / "out", tmp_path / "m2", "-1", "0",
                 "--time-limit", "60s", TFDIST_WALLTIME_MARGIN="25",
                 PREEMPT_TEST_STEP_SLEEP="1", TFDIST_PREEMPT_CHECK_SECONDS="0.00001", **env)
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-3000:]
    assert "[0] tfdist: walltime: " in first.stdout and "margin is 25 s" in first.stdout
    assert "--time-limit) is reached" not in first.stderr  # the guard stopped them, in time
    second = _run(python, backend, tmp_path / "out2", tmp_path / "m2", "-1", "0", **env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    stopped, resumed = _results(tmp_path / "out"), _results(tmp_path / "out2")
    assert [r["code"] for r in stopped + resumed] == [75, 75, 0, 0]
    assert [r["signal"] for r in stopped] == [None, None]
    assert len({(r["epoch"], r["step"]) for r in stopped}) == 1, stopped  # one agreed step
    for before, after, alone in zip(stopped, resumed, _results(straight), strict=True):
        assert 0 < before["steps"] < total, before  # stopped mid-training
        assert before["steps"] + after["steps"] == alone["steps"] == total, (before, after)
        assert after["digest"] == alone["digest"], (after, alone)


HARD_KILLS = {
    # name: (RESUME case, environment, rank 1 SIGKILLed after this step, the state it resumes
    #        from was saved after at most this step)
    # TFDIST_CHECKPOINT_EVERY=2s: every 2 s of training (0.25 s a step) and at each epoch's
    # end every rank saves the exact state and trains on: at most 2 s of steps lost.
    "safety-saves-horovod-tf_keras": ("horovod-tf_keras", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1"}, 30, 29),
    # tf_keras on MWMS over one iterator for several epochs: the uninterrupted run of the stop at
    # an epoch's last step serves both (on Horovod tf_keras reads an epoch's dataset).
    "safety-saves-mwms-tf_keras": ("mwms-tf_keras-at-an-epochs-last-step", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1"}, 30, 29),
    # No safety saves: the exact state saved at each epoch's end (in place of Keras's
    # BackupAndRestore) is where the next run starts, the end of epoch 1.
    "epoch-end-mwms-keras3": ("mwms-keras3", {}, 20, STEPS_PER_EPOCH),
    "epoch-end-horovod-keras3": ("horovod-keras3", {}, 20, STEPS_PER_EPOCH),
    # Keras 3 on JAX: a safety save mid-epoch reads the values fit keeps aside.
    "safety-saves-jax-keras3": ("jax-keras3", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1"}, 30, 29),
    # The same saves written in the background (TFDIST_BACKGROUND_SAVES=1): the step waits
    # for a copy of the state; the kill comes whenever, during a write too.
    "background-saves-mwms-keras3": ("mwms-keras3", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1", "TFDIST_BACKGROUND_SAVES": "1"}, 30, 29),
    "background-saves-mwms-tf_keras": ("mwms-tf_keras-at-an-epochs-last-step", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1", "TFDIST_BACKGROUND_SAVES": "1"}, 30, 29),
    "background-saves-jax-keras3": ("jax-keras3", {
        "TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
        "TFDIST_VERBOSE": "1", "TFDIST_BACKGROUND_SAVES": "1"}, 30, 29),
}
HARD_KILLS_FULL_ONLY = {
    # Background saves (off by default while they are built, issue 51): a file-level test of
    # the commit in make test (test_background.py); one of these failed once in 18 runs.
    "background-saves-mwms-keras3": "synchronous safety saves resume on MWMS; the background "
                                    "commit's parts in test_background.py",
    "background-saves-mwms-tf_keras": "synchronous safety saves resume on MWMS; the background "
                                      "commit's parts in test_background.py",
    "background-saves-jax-keras3": "synchronous safety saves resume on JAX; the background "
                                   "commit's parts in test_background.py",
    "epoch-end-horovod-keras3": "the exact state of an epoch's end resumes on MWMS, and "
                                "Horovod's resume after a signal",
    "safety-saves-horovod-tf_keras": "safety saves resume on MWMS (tf_keras) and JAX, and "
                                     "Horovod's ranks agree on a stop and resume after a signal",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", _by_straight_run(
    sorted(HARD_KILLS), {name: kill[0] for name, kill in HARD_KILLS.items()},
    HARD_KILLS_FULL_ONLY))
def test_a_hard_kill_loses_at_most_the_safety_interval_and_the_resume_is_exact(
        tmp_path_factory, name):
    # Rank 1 is killed (SIGKILL: no handler, no save) after its Nth step; the next launch
    # resumes from the last state saved and trains every step after it once, ending
    # bit-identical to an uninterrupted run.
    case, extra, kill_after, saved_by = HARD_KILLS[name]
    total = RESUME[case][-1]
    python, backend, tmp_path, env, straight = _resume_case(tmp_path_factory, case)
    killed = _run(python, backend, tmp_path / "out", tmp_path / "m2", "1", str(kill_after),
                  sig="KILL", **extra, **env)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stdout[-3000:] + killed.stderr
    if "TFDIST_CHECKPOINT_EVERY" in extra:  # each safety save's line (TFDIST_VERBOSE=1)
        assert "tfdist: safety save after step" in killed.stdout, killed.stdout[-3000:]
    state = preemption.read_state(str(tmp_path / "m2"))
    assert state is not None, list((tmp_path / "m2").iterdir())
    per_epoch = REPEAT_STEPS_PER_EPOCH if RESUME[case][2] == "repeat" else STEPS_PER_EPOCH
    saved = state["epoch"] * per_epoch + state["step"]
    assert 0 < saved <= saved_by, state  # saved before the kill, no earlier than it must be
    if "TFDIST_BACKGROUND_SAVES" in extra:  # written by the writer thread, committed whole
        assert state.get("background") and (Path(state["path"]) / "variables.json").exists(), \
            state
    if "TFDIST_CHECKPOINT_EVERY" not in extra:
        assert saved == saved_by and state["epoch_done"], state
        # The exact state of epoch 1's end: the model from the chief, each rank's random
        # generators and input position, the step.
        assert sorted(p.name for p in (tmp_path / "m2" / "preempted").iterdir()) == [
            "model.keras", "rank-0.npz", "rank-1.npz", "state.json"]
    assert not (tmp_path / "m2" / "backup").exists()  # the exact state is the epoch's save
    resumed = _run(python, backend, tmp_path / "again", tmp_path / "m2", "-1", "0", **env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming at step" in resumed.stdout and "backup instead" not in resumed.stdout
    for after, alone in zip(_results(tmp_path / "again"), _results(straight), strict=True):
        assert after["steps"] == total - saved, (after, state)  # each step after the save once
        assert after["digest"] == alone["digest"], (after, alone)
    assert not list((tmp_path / "m2").glob("preempted*"))  # the fit that ended removed it


IN_WRITE = {
    # name: (RESUME case, PREEMPT_TEST_IN_WRITE, the rank): background saves every 2 s of
    # training (0.25 s a step), the signal inside the rank's second write, which then goes
    # on 3 s later (a slow disk's stand-in: a dozen steps train meanwhile).
    "signal-mwms-keras3": ("mwms-keras3", "USR1:2:3", "1"),
    "kill-mwms-keras3": ("mwms-keras3", "KILL:2:0", "0"),
    "signal-jax-keras3": ("jax-keras3", "USR1:2:3", "0"),
    "kill-jax-keras3": ("jax-keras3", "KILL:2:0", "1"),
}
BACKGROUND_SAVES = {"TFDIST_CHECKPOINT_EVERY": "2s", "PREEMPT_TEST_STEP_SLEEP": "0.25",
                    "TFDIST_VERBOSE": "1", "TFDIST_BACKGROUND_SAVES": "1"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", _by_straight_run(
    sorted(IN_WRITE), {name: kill[0] for name, kill in IN_WRITE.items()}, {
        "signal-jax-keras3": "the same writer and stop on MWMS here; JAX's background saves "
                             "after a hard kill in the full matrix",
        "kill-jax-keras3": "the same writer and commit on MWMS here"}))
def test_a_signal_or_kill_during_a_background_write_loses_no_complete_state(
        tmp_path_factory, name):
    # A signal during a background write: the agreed stop waits for that write (committed)
    # and saves the final state at the stop, which the next run resumes from. A SIGKILL during
    # one: the save before it is the state found, its partial folder is never read, and the
    # next run resumes from the save before, every step after it once. Both end bit-identical
    # to an uninterrupted run.
    case, spec, rank = IN_WRITE[name]
    total = RESUME[case][-1]
    python, backend, tmp_path, env, straight = _resume_case(tmp_path_factory, case)
    model = tmp_path / "m2"
    # TFDIST_SIGNAL_LEAD=5: shorter than any save needs (twice it and 10 s), named once.
    first = _run(python, backend, tmp_path / "out", model, rank, "0",
                 TFDIST_PREEMPT_CHECK_SECONDS="0.00001", PREEMPT_TEST_IN_WRITE=spec,
                 TFDIST_SIGNAL_LEAD="5", **BACKGROUND_SAVES, **env)
    output = first.stdout[-3000:] + first.stderr[-3000:]
    signalled = spec.split(":")[0]
    assert f"tfdist-test: {signalled} in background save 2 on rank {rank}" in first.stdout, output
    lead = "the 5 s between the signal and the kill (TFDIST_SIGNAL_LEAD)"
    assert first.stdout.count(lead) == 1 and "Fix: signal at least 1" in first.stdout, output
    states = preemption.read_states(str(model))
    if signalled == "KILL":
        assert first.returncode == 128 + signal.SIGKILL, output
        saved = states[0]
        assert saved.get("background"), saved  # the first background save, committed whole
        unfinished = model / ".preempted.partial-2"
        assert unfinished.is_dir() and not (unfinished / f".done-{rank}").exists(), list(
            model.iterdir())  # killed inside the second: never committed, never read
        steps = saved["epoch"] * STEPS_PER_EPOCH + saved["step"]
    else:
        assert first.returncode == 75, output
        stopped = _results(tmp_path / "out")
        assert [r["code"] for r in stopped] == [75, 75], stopped
        assert len({(r["epoch"], r["step"]) for r in stopped}) == 1, stopped
        final, before = states
        assert (final["epoch"], final["step"]) == (stopped[0]["epoch"], stopped[0]["step"])
        assert stopped[int(rank)]["signal"] == f"SIG{signalled}", stopped
        assert (before["epoch"], before["step"]) < (final["epoch"], final["step"]), states
        assert before.get("background"), before  # the write in flight, finished first
        steps = final["epoch"] * STEPS_PER_EPOCH + final["step"]
        assert stopped[0]["steps"] == steps, stopped
    assert 0 < steps < total, states
    again = {k: v for k, v in BACKGROUND_SAVES.items() if k != "PREEMPT_TEST_STEP_SLEEP"}
    resumed = _run(python, backend, tmp_path / "again", model, "-1", "0", **again, **env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for after, alone in zip(_results(tmp_path / "again"), _results(straight), strict=True):
        assert after["steps"] == total - steps, (after, states)  # each step after it once
        assert after["digest"] == alone["digest"], (after, alone)
    assert not list(model.glob("*preempted*")), list(model.iterdir())  # partials too


# The soak: 3 preemptions in make test (three of the five kinds, drawn by the seed), 20 in make
# test-full (TFDIST_TEST_SOAK_CYCLES; about 4 minutes here); a failure names its seed, which
# TFDIST_TEST_SOAK_SEED replays.
SOAK_CYCLES = int(os.environ.get("TFDIST_TEST_SOAK_CYCLES", "3"))
SOAK_SEED = int(os.environ.get("TFDIST_TEST_SOAK_SEED") or random.SystemRandom().randrange(10**6))


@pytest.mark.multiprocess
def test_a_job_preempted_again_and_again_at_random_moments_ends_bit_identical(tmp_path):
    # One launch, preempted in each of its first SOAK_CYCLES runs at a moment drawn from the
    # seed (tests/workers/preempt_worker.py's soak_moment: mid-step on one rank, on both ranks
    # at once, during validation, at an epoch's end, while the epoch's save is written; each
    # kind once in every five runs), requeued by `tfdist launch --max-restarts` each time. It
    # ends bit-identical to an uninterrupted run, every step trained once over all runs.
    cycles, seed = SOAK_CYCLES, SOAK_SEED
    python, why = sys.executable, f"soak seed {seed} (TFDIST_TEST_SOAK_SEED={seed} replays it)"
    print(f"{cycles} cycles, {why}")  # shown with -s, and by pytest when the test fails
    env = {"TF_USE_LEGACY_KERAS": "0", "PREEMPT_TEST_INPUT": "validation",
           "PREEMPT_TEST_DROPOUT": "1", "PREEMPT_TEST_SOAK": f"{seed}:{cycles}"}
    timeout = 120 + 20 * cycles
    straight = _run(python, "mwms", tmp_path / "straight", tmp_path / "m1", "-1", "0",
                    timeout=timeout, **env)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run = _run(python, "mwms", tmp_path / "out", tmp_path / "m2", "0", "0", "--max-restarts",
               str(cycles + 1), TFDIST_PREEMPT_CHECK_SECONDS="0.00001", timeout=timeout, **env)
    assert run.returncode == 0, (why, run.stdout[-3000:] + run.stderr[-3000:])
    runs = [_results(tmp_path / "out", r) for r in range(cycles + 1)]
    for r, found in enumerate(runs[:-1]):
        assert f"tfdist-test: soak run {r}: " in run.stdout, (why, r)  # its moment came
        assert [f["code"] for f in found] == [75, 75], (why, r, found)
        assert len({(f["epoch"], f["step"]) for f in found}) == 1, (why, r, found)  # one step
    assert [f["code"] for f in runs[-1]] == [0, 0], (why, runs[-1])
    total = (2 * cycles + 1) * STEPS_PER_EPOCH
    for rank, alone in enumerate(_results(tmp_path / "straight")):
        assert sum(found[rank]["steps"] for found in runs) == alone["steps"] == total, (
            why, [found[rank]["steps"] for found in runs])  # no step twice, none skipped
        assert runs[-1][rank]["digest"] == alone["digest"], (why, rank)
    assert not list((tmp_path / "m2").glob("preempted*")), why


@pytest.mark.multiprocess
def test_a_signal_after_fit_lets_the_script_finish_and_end_normally(tmp_path):
    # SIGUSR1 to rank 1 once fit has returned, while the script still evaluates (a walltime
    # warning or a preemption in its last work): the script finishes on both ranks and exits
    # 0, so --max-restarts starts nothing again (before: rank 1 died of the signal, exit 138,
    # and the restart trained from scratch over the finished result).
    run = _run(_python("mwms"), "mwms", tmp_path / "out", tmp_path / "m", "1", "a",
               "--max-restarts", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "restarting" not in run.stderr, run.stderr[-3000:]
    results = _results(tmp_path / "out", 0)
    assert [r["code"] for r in results] == [0, 0], results
    assert [r["steps"] for r in results] == [3 * STEPS_PER_EPOCH] * 2, results
    assert results[0]["evaluated"] == results[1]["evaluated"], results  # the last work ran
    assert not (tmp_path / "out" / "result-0-1.json").exists()  # no second run
    assert "tfdist: rank 1: SIGUSR1 came after training had ended: the script finished its " \
        "work and ends normally" in run.stdout + run.stderr, run.stdout[-3000:]
    assert not list((tmp_path / "m").glob("preempted*"))


@pytest.mark.multiprocess
def test_a_signal_between_two_fits_stops_the_second_at_its_first_step(tmp_path):
    # SIGUSR1 to rank 0 after a first fit of one epoch: the second fit (epochs 2 and 3) starts,
    # every rank agrees at its first check (after its first step) and saves: exit 75.
    run = _run(_python("mwms"), "mwms", tmp_path / "out", tmp_path / "m", "0", "b",
               TFDIST_PREEMPT_CHECK_SECONDS="0.00001")
    assert run.returncode == 75, run.stdout[-3000:] + run.stderr[-3000:]
    results = _results(tmp_path / "out", 0)
    assert [r["code"] for r in results] == [75, 75], results
    assert [r["steps"] for r in results] == [STEPS_PER_EPOCH + 1] * 2, results
    assert [(r["epoch"], r["signal"]) for r in results] == [(1, "SIGUSR1"), (1, None)], results
    assert (tmp_path / "m" / "preempted").is_dir()


@pytest.mark.multiprocess
def test_the_control_keras2_dropout_on_legacy_random_ops_resumes_with_other_masks(tmp_path):
    # Keras 2's Dropout on TensorFlow's legacy stateful random ops (Keras 2's default, which
    # tfdist.init switches to tf.random.Generator): their state is in no checkpoint, so the
    # resumed run draws a fresh process's masks. A control: run once, in the TensorFlow 2.15
    # lane (its own Keras 2 as tf.keras), for CI's time; tf_keras is a copy of that Keras.
    if keras2_package() != "keras":
        pytest.skip("the control runs in the TensorFlow 2.15 lane (Keras 2 as tf.keras)")
    legacy = "0"
    env = {"TF_USE_LEGACY_KERAS": legacy, "PREEMPT_TEST_DROPOUT": "1",
           "PREEMPT_TEST_LEGACY_RNG": "1"}
    straight = _run(sys.executable, "mwms", tmp_path / "straight", tmp_path / "m1", "-1", "0",
                    **env)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run = _run(sys.executable, "mwms", tmp_path / "out", tmp_path / "m2", "1", "20",
               "--max-restarts", "2", TFDIST_PREEMPT_CHECK_SECONDS="0.00001", **env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    stopped, resumed = _results(tmp_path / "out", 0), _results(tmp_path / "out", 1)
    expected = _results(tmp_path / "straight")
    for before, after, alone in zip(stopped, resumed, expected, strict=True):
        assert before["steps"] + after["steps"] == alone["steps"], (before, after)
        assert after["digest"] != alone["digest"], (after, alone)
    assert resumed[0]["digest"] == resumed[1]["digest"]  # still in sync: other masks, not ranks


@pytest.mark.multiprocess
def test_a_run_resumed_on_fewer_workers_says_so_and_trains_every_step_once(tmp_path):
    # The global batch is the script's (32) and dist.shard splits every global batch over the
    # workers, so the saved step is the same place in the data on 1 worker as on 2. Not
    # bit-identical (1 replica sums in another order than 2), but within rounding.
    straight = _run(sys.executable, "mwms", tmp_path / "straight", tmp_path / "m1", "-1", "0")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    # The learning rate scaled by the replicas (dist.scale_lr): 0.01 on 2 workers, the script's
    # 0.005 on one; the restored optimizer trains on at the saved 0.01, and the line says so.
    stopped = _run(sys.executable, "mwms", tmp_path / "out", tmp_path / "m2", "1", "20",
                   TFDIST_PREEMPT_CHECK_SECONDS="0.02", PREEMPT_TEST_SCALE_LR="1")
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    resumed = _run(sys.executable, "mwms", tmp_path / "again", tmp_path / "m2", "-1", "0",
                   workers=1, PREEMPT_TEST_SCALE_LR="1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "it ran on 2 workers, now 1: the global batch is what the script sets; the " \
           "learning rate is the saved 0.01, not the 0.005 the script set" in (
               resumed.stdout + resumed.stderr), resumed.stdout[-3000:] + resumed.stderr[-3000:]
    before, (after,) = _results(tmp_path / "out"), _results(tmp_path / "again", workers=1)
    assert before[0]["steps"] > 0 and before[0]["steps"] + after["steps"] == 3 * STEPS_PER_EPOCH
    with np.load(tmp_path / "again" / "weights-0-0.npz") as got, \
            np.load(tmp_path / "straight" / "weights-0-0.npz") as want:
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


# A job preempted in every run gives up past the restart limit: the launcher's count and exit 75
# (tests/test_launch.py::test_max_restarts_runs_the_workers_again_with_the_restart_count, its
# workers exiting 75 in every run); a resumed run preempted again and saving, as a real worker:
# the soak above, whose runs 1 to 4 are such runs.


TORCH_STOPS = {
    # name: (the rank that signals itself and after which step, launch options, environment)
    "signal": ("1", "20", ("--max-restarts", "1"), {}),
    # No signal: each run ends 30 s after its start (--time-limit), the guard stops it 14 s
    # before, 16 s in, while the slowed steps (0.3 s each, 14.4 s of training) run: the first
    # run stops unless it started in under 2 s, and a run that started in S s trains
    # (16 - S) / 0.3 steps. A loaded machine's slower start-ups take more runs: with 25 s and
    # 0.2 s steps, start-ups of 7 to 11 s (two test processes' workers on 2 cores) trained 19,
    # 18, 8 and 2 steps in the 4 runs --max-restarts 3 allowed, of 48.
    "walltime": ("-1", "0", ("--max-restarts", "5", "--time-limit", "30s"),
                 {"TFDIST_WALLTIME_MARGIN": "14", "PREEMPT_TEST_STEP_SLEEP": "0.3"}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stop", [pytest.param(stop, marks=full_matrix_only(
    "the torch shim's ranks agree on a signal's stop and resume bit-identical, and the "
    "walltime guard stops MWMS's and JAX's ranks")) if stop == "walltime" else stop
    for stop in sorted(TORCH_STOPS)])
def test_the_torch_shim_agrees_saves_and_resumes_bit_identical(tmp_path, stop):
    pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")
    worker = str(WORKERS / "torch_preempt_worker.py")

    def launch(out: Path, checkpoint: Path, rank: str, step: str, *extra: str, **env: str
               ) -> subprocess.CompletedProcess[str]:
        out.mkdir()
        return subprocess.run([sys.executable, "-m", "tfdist", "launch", *extra, "-n", "2",
                               worker, str(out), str(checkpoint), rank, step], cwd=ROOT,
                              env={**_env(), **env}, capture_output=True, text=True,
                              timeout=240, check=False)

    straight = launch(tmp_path / "straight", tmp_path / "a.pt", "-1", "0")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    rank, step, options, env = TORCH_STOPS[stop]
    run = launch(tmp_path / "out", tmp_path / "b.pt", rank, step, *options, **env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runs = sorted({int(p.stem.split("-")[2]) for p in (tmp_path / "out").glob("result-*")})
    assert len(runs) >= 2, runs  # stopped once at least, then finished
    results = [_results(tmp_path / "out", r) for r in runs]
    for stopped in results[:-1]:
        assert [r["code"] for r in stopped] == [75, 75]
        assert len({(r["epoch"], r["step"]) for r in stopped}) == 1  # one agreed step
    if stop == "walltime":
        assert "[0] tfdist: walltime: " in run.stdout and "margin is 14 s" in run.stdout
        assert "--time-limit) is reached" not in run.stderr  # the guard stopped them in time
    for rank_runs, alone in zip(zip(*results, strict=True), _results(tmp_path / "straight"),
                                strict=True):
        # every step trained once over the runs, and the last ends as the uninterrupted one
        assert sum(r["steps"] for r in rank_runs) == alone["steps"] == 3 * STEPS_PER_EPOCH
        assert rank_runs[-1]["resumed"] and rank_runs[-1]["digest"] == alone["digest"]


TORCH_IN_WRITE = {
    # name: (PREEMPT_TEST_IN_WRITE on rank 0, the chief that writes; exit code of the first run)
    "signal": ("USR1:3:2", 75),
    "kill": ("KILL:3:2", 128 + signal.SIGKILL),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(TORCH_IN_WRITE))
def test_a_torch_background_save_survives_a_signal_or_kill_inside_its_write(tmp_path, case):
    # Background saves (TFDIST_BACKGROUND_SAVES=1) every 0.3 s of 0.05 s steps; the chief's
    # third is held 2 s inside its write (the file written, not yet flushed and renamed) and
    # the signal comes there. A signal: that write is finished and the final state written
    # after it before the exit. A kill: the file is the save before, whole, and the next run
    # resumes from it; either way bit-identical, every step after the state resumed once.
    pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")
    worker = str(WORKERS / "torch_preempt_worker.py")
    hold, first_code = TORCH_IN_WRITE[case]
    env = {**_env(), "TFDIST_BACKGROUND_SAVES": "1", "TFDIST_CHECKPOINT_EVERY": "0.3",
           "PREEMPT_TEST_STEP_SLEEP": "0.05"}

    def launch(out: Path, checkpoint: Path, *extra: str, **more: str
               ) -> subprocess.CompletedProcess[str]:
        out.mkdir()
        return subprocess.run([sys.executable, "-m", "tfdist", "launch", *extra, "-n", "2",
                               worker, str(out), str(checkpoint), "-1", "0"], cwd=ROOT,
                              env={**env, **more}, capture_output=True, text=True, timeout=240,
                              check=False)

    straight = launch(tmp_path / "straight", tmp_path / "a.pt")
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run = launch(tmp_path / "out", tmp_path / "b.pt", "--max-restarts", "1",
                 PREEMPT_TEST_IN_WRITE=hold)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    # written on the writer thread, while the training thread went on
    assert (f"tfdist-test: {hold.split(':')[0]} in background save 3 on thread "
            "tfdist-background-save") in output, output[-3000:]
    assert f"exit code {first_code}" in output or first_code == 75, output[-3000:]
    resumed, alone = _results(tmp_path / "out", 1), _results(tmp_path / "straight")
    stopped = (_results(tmp_path / "out", 0) if case == "signal" else None)
    for rank, (after, before) in enumerate(zip(resumed, alone, strict=True)):
        epoch, step = after["from"]
        saved = epoch * STEPS_PER_EPOCH + step
        assert after["resumed"] and after["digest"] == before["digest"], (after, before)
        assert after["steps"] == before["steps"] - saved  # every step after the state once
        if stopped is not None:  # the final save: where the agreed stop was
            assert stopped[rank]["code"] == 75
            assert [stopped[rank]["epoch"], stopped[rank]["step"]] == [epoch, step]
            assert stopped[rank]["steps"] == saved


KILLED_WRITER = """
import json, os, signal, sys
from tfdist import preemption
from tfdist.keras import input_position
model_dir, when = sys.argv[1], sys.argv[2]

def state(name, step):
    folder = os.path.join(model_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, preemption.STATE_FILE), "w") as f:
        f.write(json.dumps({"step": step}) if when != "mid-write" or step == 1 else '{"st')
    return folder

preemption.commit(state("p1", 1), os.path.join(model_dir, preemption.CHECKPOINT_DIR))
partial = state("p2", 2)
if when == "mid-write":
    os.kill(os.getpid(), signal.SIGKILL)  # the second state is half written
replace = os.replace
def killed_on_the_second(src, dst, calls=[]):
    calls.append(src)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # between the two renames of the commit
    replace(src, dst)
os.replace = killed_on_the_second
preemption.commit(partial, os.path.join(model_dir, preemption.CHECKPOINT_DIR))
"""


@pytest.mark.parametrize("when", ["mid-write", "between-renames"])
def test_kill_9_while_saving_leaves_the_last_good_state(tmp_path, when):
    run = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path), when], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == -signal.SIGKILL, run.stderr
    state = preemption.read_state(str(tmp_path))
    assert state is not None and state["step"] == 1, (state, sorted(os.listdir(tmp_path)))


@pytest.mark.multiprocess
# Keras 2's optimizers in a custom loop: the TensorFlow 2.15 lane runs "mwms-keras3" on its
# Keras 2 (tf_keras is a copy of it), for CI's time.
@pytest.mark.parametrize(("backend", "legacy", "background"), [
    pytest.param("mwms", "0", "0", id="mwms-keras3"),
    # The state written by each process's writer thread (tfdist/keras/loop_saves.py), the
    # optimizer built at the resume before the values are assigned (Keras builds it at its
    # first step).
    pytest.param("mwms", "0", "1", id="mwms-keras3-background"),
    pytest.param("horovod", "0", "0", id="horovod-keras3", marks=full_matrix_only(
        "a custom loop resumes at the agreed step under MWMS, and Horovod's ranks agree on "
        "the stop in fit's cases"))])
def test_a_custom_loop_resumes_at_the_agreed_step_bit_identical(tmp_path, backend, legacy,
                                                                background):
    python = _python(backend)
    worker = str(WORKERS / "preempt_loop_worker.py")
    straight = _run(python, backend, tmp_path / "straight", tmp_path / "m1", "-1", "0",
                    worker=worker, TF_USE_LEGACY_KERAS=legacy)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run = _run(python, backend, tmp_path / "out", tmp_path / "m2", "1", "21", "--max-restarts",
               "1", worker=worker, TF_USE_LEGACY_KERAS=legacy,
               TFDIST_BACKGROUND_SAVES=background)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved = json.loads((tmp_path / "m2" / preemption.CHECKPOINT_DIR / "state.json").read_text())
    assert saved.get("background", False) == (background == "1"), saved
    stopped, resumed = _results(tmp_path / "out", 0), _results(tmp_path / "out", 1)
    expected = _results(tmp_path / "straight")
    assert [r["code"] for r in stopped + resumed] == [75, 75, 0, 0]
    assert len({(r["epoch"], r["step"]) for r in stopped}) == 1, stopped  # one agreed step
    assert "resuming the loop at" in run.stdout + run.stderr
    for before, after, alone in zip(stopped, resumed, expected, strict=True):
        assert before["steps"] + after["steps"] == alone["steps"] == 3 * STEPS_PER_EPOCH
        assert after["resumed"] and after["digest"] == alone["digest"], (after, alone)
