"""A ``model_dir`` a user can trust: every resume exact (one process too, and with another
global batch), one run per folder, a folder every rank sees, and storage faults named in one line
with the last complete state kept.

Pure tables first (the lock's verdict, the ranks that cannot see the folder, a foreign model's
difference, a position moved to another batch size, the fix for an errno), then real processes:
two processes holding one folder (no framework needed), and real training in one process and on
2 workers (MWMS on loopback). Faults are real where this machine allows: a read-only and a full
file system are tmpfs mounts (root; the tests skip where mounting is not allowed), and node-local
scratch is a tmpfs mounted at the same path in each rank's own mount namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import ROOT, WORKERS, clean_env

from tfdist import model_dir as layout
from tfdist import ownership, preemption
from tfdist.backends.single import SingleDistributed
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError, StorageError
from tfdist.keras import input_position
from tfdist.keras.input_position import Resume

WORKER = str(WORKERS / "preempt_worker.py")
TOTAL_STEPS = 48  # 3 epochs of 512 rows in batches of 32


# --- pure ------------------------------------------------------------------------------------

def _holder(host: str = "n9", pid: int = 100, job: str | None = None) -> ownership.Holder:
    return ownership.Holder(host, pid, None, job, 1.0e9, 7)


ME = _holder("n9", 200, "42")
VERDICTS = {
    # name: (the lock found, pid alive, job running, age, expected action, words in the why)
    "none": (None, None, None, 0.0, "take", ""),
    "this process": (_holder("n9", 200, "42"), True, None, 0.0, "own", "own"),
    "live pid here": (_holder("n9", 100), True, None, 0.0, "refuse", "running on this host"),
    "live pid here, same job": (_holder("n9", 100, "42"), True, None, 0.0, "refuse",
                                "running on this host"),
    "dead pid here": (_holder("n9", 100), False, None, 0.0, "take over", "has ended"),
    "requeued job, another node": (_holder("n10", 100, "42"), None, True, 0.0, "own",
                                   "earlier run of Slurm job 42"),
    "another job running": (_holder("n10", 100, "41"), None, True, 0.0, "refuse",
                            "job 41 is running"),
    "another job ended": (_holder("n10", 100, "41"), None, False, 0.0, "take over",
                          "job 41 is no longer running"),
    "another host, renewed": (_holder("n10", 100), None, None, 30.0, "refuse", "renewed 30 s"),
    "another host, abandoned": (_holder("n10", 100), None, None, 600.0, "take over",
                                "not renewed for 600 s"),
}


@pytest.mark.parametrize("case", sorted(VERDICTS))
def test_the_lock_verdict(case):
    held, alive, running, age, action, why = VERDICTS[case]
    found = ownership.verdict(held, ME, pid_alive=alive, job_running=running, age_s=age)
    assert found.action == action and why in found.why, found


def test_the_ranks_that_cannot_see_the_folder_are_named_with_their_host():
    rows = [[0, 0, 0], [1, 0, 0], [2, 1, 1], [3, 1, 1]]  # ranks 2 and 3 on the second node
    line = ownership.not_seen(rows, ("n9", "n10"), "/scratch/run", "n9")
    assert line is not None and line.startswith(
        "model_dir /scratch/run is not one folder that every rank sees: rank 2 on n10 (and 1 "
        "more rank(s)) cannot read /scratch/run/tfdist.lock, which rank 0 wrote on n9")
    assert "$TMPDIR" in line
    assert ownership.not_seen([[0, 0, 0], [1, 1, 0]], ("n9", "n10"), "/d", "n9") is None
    assert "rank 1 on node 3" in (ownership.not_seen([[1, 3, 1]], (), "/d", "n9") or "")


SAVED = {"weights": [[8, 16], [16], [16, 2], [2]], "dtypes": ["float32"] * 4, "optimizer": "Adam"}
DIFFERENCES = {
    "the same": (SAVED, None),
    "wider": ({**SAVED, "weights": [[8, 32], [32], [32, 2], [2]]},
              "weight 0 is 8x32, the saved model's 8x16"),
    "a layer more": ({**SAVED, "weights": [*SAVED["weights"], [2]],
                      "dtypes": ["float32"] * 5}, "it has 5 weights, the saved model 4"),
    "another type": ({**SAVED, "dtypes": ["float32", "float16", "float32", "float32"]},
                     "weight 1 is float16, the saved model's float32"),
    "another optimizer": ({**SAVED, "optimizer": "SGD"},
                          "its optimizer is SGD, the saved model's Adam"),
    "a scalar": ({**SAVED, "weights": [[8, 16], [], [16, 2], [2]]},
                 "weight 1 is a scalar, the saved model's 16"),
}


@pytest.mark.parametrize("case", sorted(DIFFERENCES))
def test_a_foreign_model_is_told_from_the_saved_one(case):
    now, expected = DIFFERENCES[case]
    assert layout.difference(SAVED, now) == expected


REBATCH = {
    # name: (planned resume, saved global batch, this run's, expected or None: not exact)
    "the same batch": (Resume(0, 3, 1, 3), 64, 64, Resume(0, 3, 1, 3)),
    "64 to 128 after 4 steps": (Resume(0, 4, 1, 4), 64, 128, Resume(0, 2, 1, 2)),
    "64 to 128 after 3 steps": (Resume(0, 3, 1, 3), 64, 128, None),
    "128 to 64": (Resume(1, 3, 2, 3), 128, 64, Resume(1, 6, 2, 6)),
    "an epoch's end, nothing to skip": (Resume(2, 0, 3, 0), 64, 96, Resume(2, 0, 3, 0)),
    "one iterator over epochs": (Resume(1, 2, 1, 14), 32, 64, Resume(1, 1, 1, 7)),
    "unknown before": (Resume(0, 3, 1, 3), None, 128, Resume(0, 3, 1, 3)),
    "unknown now": (Resume(0, 3, 1, 3), 64, None, Resume(0, 3, 1, 3)),
}


@pytest.mark.parametrize("case", sorted(REBATCH))
def test_a_position_in_rows_moves_to_another_global_batch(case):
    at, before, now, expected = REBATCH[case]
    assert input_position.rebatch(at, before, now) == expected


@pytest.mark.parametrize(("code", "words"), [
    (28, "Free space there"), (122, "Free space there"), (30, "folder this job can write"),
    (13, "folder this job can write"), (5, "Check the file system")])
def test_each_storage_fault_names_its_fix(code, words):
    assert words in layout.storage_fix(code)


# --- one run per folder: real processes, no framework ------------------------------------------

HOLDER = """
import sys, time
from types import SimpleNamespace
from tfdist import ownership
from tfdist.backends.single import SingleDistributed
from tfdist.env import ClusterEnvironment
dist = SingleDistributed(ClusterEnvironment("single", job_id=sys.argv[2] or None),
                         SimpleNamespace(num_replicas_in_sync=1), "none", 0)
ownership.claim(dist, sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _hold(folder: Path, seconds: float, job: str = "") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), job, str(seconds)],
                            cwd=ROOT, env=clean_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_a_second_live_run_is_refused_and_a_dead_runs_folder_taken_over(tmp_path):
    folder = tmp_path / "run"
    first = _hold(folder, 120)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        lock = json.loads((folder / layout.LOCK).read_text())
        assert (lock["pid"], lock["host"]) == (first.pid, socket.gethostname())
        second = _hold(folder, 0)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 78 and out == "", err[-2000:]  # one line (tfdist.uncaught)
        line = err.strip().splitlines()[-1]
        assert len(err.strip().splitlines()) == 1, err
        assert line.startswith(f"tfdist: model_dir {folder} is in use by "
                               f"another run (pid {first.pid} on {socket.gethostname()}"), line
        assert f"(if it is gone: rm {folder / layout.LOCK})" in line
    finally:
        first.kill()
        first.wait()
    # Killed: its lock stays, naming a process that has ended. The next run takes it over.
    third = _hold(folder, 0)
    out, err = third.communicate(timeout=60)
    assert (third.returncode, out) == (0, "held\n"), err[-2000:]
    assert (f"tfdist: model_dir {folder} was held by a run that is gone (pid {first.pid} on "
            f"{socket.gethostname()}") in err
    assert "its process has ended): this run takes it over" in err
    assert not (folder / layout.LOCK).exists()  # given up at its exit


def _one_process(job: str | None = None) -> SingleDistributed:
    return SingleDistributed(ClusterEnvironment("single", job_id=job),
                             SimpleNamespace(num_replicas_in_sync=1), "none", 0)


def test_a_requeued_job_takes_over_its_own_folder_quietly(tmp_path, caplog):
    folder = tmp_path / "run"
    folder.mkdir()
    # What the job's first run left on another node (its chief there is gone).
    gone = ownership.Holder("another-node", 1, None, "42", 1.0e9, 5)
    (folder / layout.LOCK).write_text(json.dumps(gone.__dict__))
    ownership.claim(_one_process("42"), folder)
    try:
        assert json.loads((folder / layout.LOCK).read_text())["pid"] == os.getpid()
        assert "was held by a run that is gone" not in caplog.text
    finally:
        ownership.release_all()
    assert not (folder / layout.LOCK).exists()


def _mount(where: Path, options: str) -> None:
    """A tmpfs at ``where`` (root, and mounts allowed), else the test skips."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def test_a_read_only_model_dir_is_named_before_the_first_step(tmp_path):
    folder = tmp_path / "ro"
    _mount(folder, "ro,size=64k")
    try:
        with pytest.raises(StorageError) as raised:
            ownership.claim(_one_process(), folder)
    finally:
        _unmount(folder)
    assert str(raised.value) == (
        f"cannot write in model_dir {folder} on rank 0 ({socket.gethostname()}): Read-only "
        "file system. Point model_dir at a folder this job can write, on a file system every "
        "node mounts")


# --- real training ---------------------------------------------------------------------------

def _train(out: Path, model_dir: Path, run: int, rank: str = "-1", step: str = "0",
           **env: str) -> subprocess.CompletedProcess[str]:
    """One plain process (no launcher: TensorFlow's default strategy), run number ``run``."""
    out.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, WORKER, str(out), str(model_dir), "auto", rank, step], cwd=ROOT,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", TFDIST_RESTART_COUNT=str(run),
                      TFDIST_PREEMPT_CHECK_SECONDS="0.00001", PREEMPT_TEST_DROPOUT="1", **env),
        capture_output=True, text=True, timeout=300, check=False)


def _result(out: Path, run: int) -> dict:
    return json.loads((out / f"result-0-{run}.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted one-process run the resumes are compared with."""
    folder = tmp_path_factory.mktemp("straight")
    done = _train(folder / "out", folder / "m", 0)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = _result(folder / "out", 0)
    assert found["iterations"] == found["steps"] == TOTAL_STEPS, found
    return found


@pytest.mark.multiprocess
def test_one_process_resumes_exactly_refuses_a_foreign_model_and_survives_a_damaged_save(
        tmp_path, straight):
    # Stopped after step 4 of epoch 2: preempted/ holds it, preempted.old/ epoch 1's end.
    stopped = _train(tmp_path / "out", tmp_path / "m", 0, "0", "20")
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    newest = tmp_path / "m" / layout.PREEMPTED
    assert json.loads((newest / "state.json").read_text())["step"] == 4
    assert json.loads((tmp_path / "m" / "preempted.old" / "state.json").read_text())[
        "epoch_done"]
    shutil.copytree(tmp_path / "m", tmp_path / "damaged")
    # Another model (a wider hidden layer) is refused in one line, nothing loaded.
    wider = _train(tmp_path / "other", tmp_path / "m", 1, PREEMPT_TEST_WIDTH="32")
    assert wider.returncode == 78
    line = [x for x in wider.stderr.splitlines() if x.startswith("tfdist: ")]
    assert line and line[-1].endswith(
        f"{newest} holds the state of another model (weight 0 is 8x32, the saved model's "
        f"8x16): resume with the model and optimizer that saved it, or start afresh with "
        f"another model_dir or rm -r {newest}*"), wider.stderr[-3000:]
    # Keras 3 without a strategy builds the optimizer at its first step: the resume used to
    # load the model before that, and Keras skipped the optimizer's state ("Skipping variable
    # loading for optimizer"): 28 iterations at the end instead of 48, other weights.
    resumed = _train(tmp_path / "out", tmp_path / "m", 1)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "resuming at step 4 of epoch 2" in output and "Skipping variable" not in output
    before, after = _result(tmp_path / "out", 0), _result(tmp_path / "out", 1)
    assert (before["steps"], after["steps"]) == (20, TOTAL_STEPS - 20)  # every step once
    assert after["iterations"] == TOTAL_STEPS and after["digest"] == straight["digest"]
    assert not (tmp_path / "m" / layout.LOCK).exists()  # each run gave the folder up
    # A truncated model file (a disk that filled, a copy cut short): the state before it.
    damaged = tmp_path / "damaged" / layout.PREEMPTED
    model_file = damaged / "model.keras"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    again = _train(tmp_path / "again", tmp_path / "damaged", 1)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert (f"tfdist: {damaged} cannot be read (" in output and
            f"resuming from the complete state before it, {damaged}.old" in output), output[-3000:]
    after = _result(tmp_path / "again", 1)
    assert after["steps"] == 2 * 16 and after["iterations"] == TOTAL_STEPS
    assert after["digest"] == straight["digest"]


@pytest.mark.multiprocess
def test_a_resume_with_another_global_batch_trains_every_row_once(tmp_path):
    rows = {"PREEMPT_TEST_COUNT_ROWS": "1"}
    # Stopped after 4 steps of 64: 256 rows.
    stopped = _train(tmp_path / "out", tmp_path / "m", 0, "0", "4", PREEMPT_TEST_BATCH="64",
                     **rows)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    # 256 rows are no whole number of batches of 96: no exact resume, refused in one line.
    refused = _train(tmp_path / "refused", tmp_path / "m", 1, PREEMPT_TEST_BATCH="96", **rows)
    assert refused.returncode == 78 and (
        f"{tmp_path / 'm' / layout.PREEMPTED} stopped after 256 rows in batches of 64, which is "
        "not a whole number of this run's global batch 96: no exact resume. Resume with a "
        "global batch that divides 256 (such as 64)") in refused.stderr, refused.stderr[-3000:]
    # At 128: 2 batches skipped, not 4, and every row of the three epochs trained once.
    resumed = _train(tmp_path / "out", tmp_path / "m", 1, PREEMPT_TEST_BATCH="128", **rows)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "its global batch was 64, now 128: it goes on after the same 256 rows" in output
    after = _result(tmp_path / "out", 1)
    assert after["steps"] == 2 + 2 * 4  # the rest of epoch 1, then two epochs of 4
    count, squares = after["rows"]
    first = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")[:, 0]
    assert count == 3 * 512  # as many rows as three epochs have ...
    assert squares == pytest.approx(3 * float(np.sum(first * first)), rel=1e-5)  # ... the same


GAN = str(WORKERS / "gan_worker.py")
GAN_STEPS = 90  # 3 epochs of 30 batches of 37


def _gan(out: Path, model_dir: Path, *args: str, workers: int = 1, run: int = 0,
         **env: str) -> subprocess.CompletedProcess[str]:
    """tests/workers/gan_worker.py: one plain process (run number ``run``), or ``workers``
    under ``tfdist launch`` (``--max-restarts 1``: a killed run is started again as run 1)."""
    out.mkdir(exist_ok=True)
    command = [sys.executable, GAN, str(out), str(model_dir), *args]
    if workers > 1:
        command[1:1] = ["-m", "tfdist", "launch", "--max-restarts", "1", "-n", str(workers)]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                      TFDIST_PREEMPT_CHECK_SECONDS="0.00001",
                      **({} if workers > 1 else {"TFDIST_RESTART_COUNT": str(run)}), **env))


def _gan_result(out: Path, run: int, rank: int = 0) -> dict:
    return json.loads((out / f"result-{rank}-{run}.json").read_text())


@pytest.fixture(scope="module")
def gan_straight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The GAN's uninterrupted one-process run."""
    folder = tmp_path_factory.mktemp("gan")
    done = _gan(folder / "out", folder / "m")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = _gan_result(folder / "out", 0)
    assert found["trained"] == GAN_STEPS and found["resumed"] is None, found
    return {**found, "state": np.load(folder / "out" / "state-0-0.npz")}


@pytest.mark.multiprocess
def test_a_gan_resumes_exactly_with_its_own_optimizers_and_unseeded_noise(tmp_path,
                                                                          gan_straight):
    # A GAN as users write one (tests/workers/gan_worker.py): no call(), its own two optimizers
    # as attributes (built at their first apply_gradients, so not yet at a resume), noise from
    # Keras's global seed generator, which no model holds. Stopped mid-epoch in one process;
    # before: the resume stopped with Keras's "Unable to automatically build the model".
    stopped = _gan(tmp_path / "out", tmp_path / "m", "USR1:35")
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert _gan_result(tmp_path / "out", 0)["trained"] == 35
    saved = tmp_path / "m" / layout.PREEMPTED
    assert [o["class"] for o in json.loads((saved / "state.json").read_text())[
        "optimizers"]] == ["RMSprop", "Adam", "Adam"]  # compile's own, never applied; the two
    for control in ("no-record", "no-noise"):
        shutil.copytree(tmp_path / "m", tmp_path / control)
    resumed = _gan(tmp_path / "out", tmp_path / "m", run=1)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert "resuming at step 5 of epoch 2" in output and "Skipping variable" not in output
    after = _gan_result(tmp_path / "out", 1)
    assert after["trained"] == GAN_STEPS - 35  # every step once
    assert after["digest"] == gan_straight["digest"]
    # The controls, from the same saved state: each must end elsewhere, or the comparison above
    # could not tell. A state saved without the optimizers' record (as before it existed): the
    # two Adams' slots and step counts are lost.
    state = tmp_path / "no-record" / layout.PREEMPTED / "state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items()
                                 if k != "optimizers"}))
    # And one without the global seed generator's state: the noise is drawn anew.
    npz = tmp_path / "no-noise" / layout.PREEMPTED / "rank-0.npz"
    with np.load(npz) as kept:
        np.savez(npz, **{k: kept[k] for k in kept.files if k != "global_seed"})
    for control in ("no-record", "no-noise"):
        again = _gan(tmp_path / control, tmp_path / control, run=1)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        found = _gan_result(tmp_path / control, 1)
        assert found["trained"] == GAN_STEPS - 35
        assert found["digest"] != gan_straight["digest"], control


@pytest.mark.multiprocess
def test_a_gan_on_two_workers_resumes_from_a_background_save_after_a_hard_kill(
        tmp_path, gan_straight):
    # Its noise drawn without a seed used to stop MWMS at the first step: Keras keeps that
    # generator per thread and each replica's trace made another ("tf.function only supports
    # singleton tf.Variables created on the first call").
    background = {"TFDIST_BACKGROUND_SAVES": "1"}
    straight = _gan(tmp_path / "straight", tmp_path / "m1", workers=2, **background)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    # Each rank SIGKILLs itself after its 40th step, once epoch 1's end is committed.
    run = _gan(tmp_path / "out", tmp_path / "m2", "KILL:40", workers=2, **background)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "resuming at step 30 of epoch 1 (its end)" in output, output[-3000:]
    alone = [_gan_result(tmp_path / "straight", 0, rank) for rank in (0, 1)]
    resumed = [_gan_result(tmp_path / "out", 1, rank) for rank in (0, 1)]
    assert [r["trained"] for r in resumed] == [GAN_STEPS - 30] * 2  # epoch 1 not again
    assert len({r["digest"] for r in alone + resumed}) == 1, (alone, resumed)
    # The same global batch in one process: the same numbers (the sums' order differs).
    ranks = np.load(tmp_path / "out" / "state-0-1.npz")
    one = gan_straight["state"]
    assert len(ranks.files) == len(one.files)
    for key in one.files:
        np.testing.assert_allclose(ranks[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)


def _on_scratch(folder: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """tests/workers/scratch_dir_worker.py on 2 workers (``--doctor``: tfdist doctor), each with
    its own tmpfs at ``folder``; the run and its output. Skips where mounts are not allowed."""
    run = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2",
         str(WORKERS / "scratch_dir_worker.py"), *args, str(folder)], cwd=ROOT,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1"), capture_output=True,
        text=True, timeout=240, check=False)
    output = run.stdout + run.stderr
    if "cannot mount a scratch folder" in output:
        pytest.skip("this machine cannot give a process a mount of its own (root, unshare)")
    return run, output


@pytest.mark.multiprocess
def test_a_model_dir_on_node_local_scratch_stops_every_rank_before_the_first_step(tmp_path):
    # The same path on both ranks, a different folder on each: rank 1 cannot read the lock
    # rank 0 wrote there. Before tfdist checked, rank 1 died at the first epoch's end with
    # FileNotFoundError: .../.preempted.partial/rank-1.npz.
    folder = tmp_path / "scratch"
    run, output = _on_scratch(folder)
    assert run.returncode == 78, output[-3000:]
    assert "tfdist-test: rank" not in output  # no step trained
    # tfdist launch names its hosts by address: both ranks are on 127.0.0.1.
    expected = (f"model_dir {folder} is not one folder that every rank sees: rank 1 on "
                f"127.0.0.1 cannot read {folder / layout.LOCK}, which rank 0 wrote on 127.0.0.1."
                " Put model_dir on a file system every node mounts (not node-local scratch "
                "such as $TMPDIR), at the same path on every rank")
    # Every rank found it: rank 0 says it, once (tfdist.uncaught).
    assert f"[0] tfdist: {expected}\n" in run.stdout, output[-3000:]
    assert run.stdout.count(expected) == 1 and "Traceback" not in output, output[-3000:]


def test_a_full_file_system_is_named_and_the_last_complete_state_kept(tmp_path):
    folder = tmp_path / "full"
    _mount(folder, "size=64k")
    dist = _one_process()

    def write(size: int):
        return lambda partial: Path(partial, "model.keras").write_bytes(b"x" * size)

    try:
        preemption.save_state(dist, str(folder), write(1000), {"step": 1})
        with pytest.raises(StorageError) as raised:
            preemption.save_state(dist, str(folder), write(200_000), {"step": 2})
        assert preemption.read_state(str(folder))["step"] == 1  # the last complete one
        assert sorted(os.listdir(folder)) == [layout.PREEMPTED]  # nothing half-written left
    finally:
        _unmount(folder)
    assert str(raised.value) == (
        f"could not save the training state in {folder / layout.PREEMPTED} (1 rank(s) failed: "
        "No space left on device). Free space there (or raise the quota), or point model_dir at "
        "a file system with room for two saves; the last complete state, "
        f"{folder / layout.PREEMPTED}, is kept and the next run resumes from it")


def test_a_custom_loops_damaged_state_resumes_from_the_one_before(tmp_path, caplog):
    tf = pytest.importorskip("tensorflow")
    dist = _one_process()
    weight = tf.Variable([1.0, 2.0])
    preemption.save_loop_state(dist, str(tmp_path), {"epoch": 0, "step": 5}, weight=weight)
    weight.assign([3.0, 4.0])
    preemption.save_loop_state(dist, str(tmp_path), {"epoch": 0, "step": 9}, weight=weight)
    newest = tmp_path / layout.PREEMPTED
    for data in newest.glob("loop.data-*"):  # cut short, as by a full disk
        data.write_bytes(data.read_bytes()[:3])
    weight.assign([0.0, 0.0])
    assert preemption.load_loop_state(str(tmp_path), weight=weight) == {"epoch": 0, "step": 5}
    preemption._restores.clear()  # kept for a loop's later variables; none here
    assert weight.numpy().tolist() == [1.0, 2.0]
    assert f"{newest} cannot be read (" in caplog.text
    assert f"resuming from the complete state before it, {newest}.old" in caplog.text
    # Both damaged: one line, and the fix.
    for data in (tmp_path / "preempted.old").glob("loop.data-*"):
        data.write_bytes(data.read_bytes()[:3])
    with pytest.raises(StorageError, match=r"cannot be read .* no earlier complete one: start "
                                           r"afresh with rm -r .*preempted\*"):
        preemption.load_loop_state(str(tmp_path), weight=weight)


def test_a_custom_loops_background_save_restores_its_models_optimizer_and_variables(
        tmp_path):
    # In this process (TensorFlow's default strategy): a Keras 3 model, its Adam (which Keras
    # builds at its first apply_gradients, so not yet at a resume) and a variable of the loop.
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from tfdist.keras import loop_saves

    def objects():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2),
                                  keras.layers.Dropout(0.5)])
        return {"model": model, "optimizer": keras.optimizers.Adam(0.1),
                "seen": tf.Variable(0, dtype=tf.int64)}

    dist = _one_process()
    saving = objects()
    model, optimizer = saving["model"], saving["optimizer"]
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones((4, 3)), training=True))
        weights = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights, strict=True))
    saving["seen"].assign(12)
    preemption.save_loop_state(dist, str(tmp_path), {"epoch": 1, "step": 3}, background=True,
                               **saving)
    expected = {k: np.array(v.numpy()) for k, v in loop_saves.variables(saving).items()}
    model.weights[0].assign(tf.zeros_like(model.weights[0]))  # the loop goes on
    loop_saves.wait_all()
    saved = tmp_path / layout.PREEMPTED
    assert (saved / "variables.json").exists() and not list(saved.glob("loop.*"))
    fresh = objects()
    assert preemption.load_loop_state(str(tmp_path), **fresh) == {"epoch": 1, "step": 3}
    found = {k: np.array(v.numpy()) for k, v in loop_saves.variables(fresh).items()}
    # The weights, Dropout's random state (Keras 3), the variable, and the Adam's step and its
    # 4 slots (and rate, Keras 3), made at the resume
    assert sorted(found) == sorted(expected), sorted(found)
    slots = [k for k in found if k.startswith("optimizer/")]
    assert len(slots) == len(loop_saves.optimizers.variables(optimizer)) >= 5, slots
    for key, value in expected.items():
        np.testing.assert_array_equal(found[key], value, err_msg=key)
    # What only a tf.train.Checkpoint takes is refused in one line that names the fix.
    with pytest.raises(ConfigError, match=r"iterator is a .*: save this loop's state with "
                                          r"dist.save_state\(\.\.\., background=False\)"):
        preemption.save_loop_state(dist, str(tmp_path), {}, background=True,
                                   iterator=iter(tf.data.Dataset.range(3)))


def test_the_doctor_names_a_rank_whose_model_dir_is_another_folder(tmp_path):
    from tfdist.doctor.report import RankReport, model_dir_problems

    reports = [RankReport(rank=0, host="n9"), RankReport(rank=1, host="n10"),
               RankReport(rank=2, host="n10")]
    found = model_dir_problems(reports, {0: True, 1: False, 2: True}, "/scratch/run")
    assert [p.line() for p in found] == [
        "error: rank 1 (host n10): model_dir /scratch/run is not the folder rank 0 sees: rank 0 "
        "cannot read the file this rank wrote there. Fix: put model_dir on a file system every "
        "node mounts (not node-local scratch such as $TMPDIR), at the same path on every rank."]


@pytest.mark.multiprocess
def test_the_doctor_finds_node_local_scratch_before_training_starts(tmp_path):
    folder = tmp_path / "scratch"
    run, output = _on_scratch(folder, "--doctor")
    assert run.returncode == 1, output[-3000:]
    assert (f"[0] tfdist doctor: error: rank 1 (host {socket.gethostname()}): model_dir "
            f"{folder} is not the folder rank 0 sees") in run.stdout, output[-3000:]
    assert "all-reduce" not in output  # stopped at the meeting, before the engine started


def test_a_batch_spec_for_the_symbolic_build_is_a_leaf_of_keras_trees():
    # The resume builds an unbuilt model from the input's spec; Keras maps its tree functions
    # over it. As a NamedTuple the spec was walked into (its shape's ints have no `shape`):
    # a subclassed model fed one array, `fit(x)`, failed to resume.
    from keras import tree

    from tfdist.keras.input_position import _Spec

    spec = _Spec((None, 3), "float32")
    assert tree.map_structure(lambda v: v.shape, spec) == (None, 3)
    assert tree.map_structure(lambda v: v.dtype, (spec, spec)) == ("float32", "float32")
