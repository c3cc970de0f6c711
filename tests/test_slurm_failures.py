"""Faults on the Slurm test cluster: the doctor's checks under srun, and a task that dies or hangs.

- ``tfdist doctor`` as an srun step on n9 and n10: an interface no node has is named for each
  rank with its node, before anything slow starts, whichever rank exits later; node names that
  do not resolve (``TFDIST_HOST_TEMPLATE``) stop both sides within the deadline, each naming the
  other.
- A rank that fails and ends at once under ``srun --kill-on-bad-exit=1`` (the output through
  srun): its error reaches srun's output.
- A 2-node MWMS fit (one task per node, ``srun --kill-on-bad-exit=1`` as the rendered scripts
  run it) whose task 1 sends itself SIGKILL (a crash) or SIGSTOP (a hang) at step 20. The step
  must end within a bound, measured from the fault: a killed task is named by srun
  (``srun: error: n10: task 1: Killed``) and srun ends the others at once; a hung task is found
  by TensorFlow's heartbeats, and rank 0 prints tfdist's line naming rank 1, its node and the
  step.
- A lost node: a rendered 3-node job with ``min_nodes: 2`` (``--no-kill``, ``tfdist survive``)
  whose node n11 has its network cut and its tasks killed mid-epoch: training goes on on n9 and
  n10 from the last epoch's exact state, every step trained once, the weights equal to an
  uninterrupted run's within rounding (3 workers, then 2: the global batch is split otherwise).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import clean_env, full_matrix_only
from slurm_faults import back, cut_off, cut_off_wholly, kill_in, wait_for_line
from slurm_jobs import cluster_config, submit_rendered
from slurmtest import TERMINAL_STATES, SlurmCluster

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "fault_fit_worker.py"
TWO_NODES = ("-N2", "--ntasks-per-node=1", "--nodelist=n[9-10]")
BOUND_S = 60  # measured: 2 s for a kill, 13 s for a hang (HANG_ENV's heartbeat timeout, 10 s)
# The hung task is named after tfdist's heartbeat timeout: 10 s, as in the lost node's job below,
# not the default 30 s (20 s of waiting more; tests/test_failures.py's local hang gives 6 s).
HANG_ENV = {"TFDIST_HEARTBEAT_TIMEOUT": "10"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [0, 1])
def test_doctor_under_srun_names_each_rank_with_a_missing_interface(
        slurm_cluster: SlurmCluster, late: int) -> None:
    # Rank `late` takes a second more to exit. srun --kill-on-bad-exit ends the step at the
    # first task that fails, and the lines its tasks wrote after their first one were then
    # lost, the failing task's own too: rank 0's problem lines went missing 6 times in 6 either
    # way, and now and then when neither was late. The ranks rank 0 stops exit 0, and rank 0
    # exits 1 once they have exited.
    site = slurm_cluster.new_workdir()
    (site / "sitecustomize.py").write_text(
        f"import atexit, os, time\nif os.environ.get('SLURM_PROCID') == '{late}':\n"
        "    atexit.register(time.sleep, 1.0)\n")
    out = slurm_cluster.srun(*TWO_NODES, "--kill-on-bad-exit=1", slurm_cluster.python, "-m",
                             "tfdist", "doctor", "--timeout", "20",
                             env=slurm_cluster.job_env(NCCL_SOCKET_IFNAME="ib0",
                                                       PYTHONPATH=str(site)))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    for rank, node in ((0, "n9"), (1, "n10")):
        assert re.search(rf"error: rank {rank} \(host {node}\): NCCL_SOCKET_IFNAME=ib0 selects "
                         r"no network interface here \(it has [^)]*\)\. Fix: ", text), text
    assert re.search(r"0 +n9 +0/1 .* n9:\d+ +mwms", text), text  # the table, in Slurm's order
    assert "all-reduce" not in text  # stopped before TensorFlow started


@pytest.mark.timeout(120)
def test_doctor_under_srun_stops_both_sides_when_node_names_do_not_resolve(
        slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun(*TWO_NODES, slurm_cluster.python, "-m", "tfdist", "doctor",
                             "--timeout", "8",
                             env=slurm_cluster.job_env(TFDIST_HOST_TEMPLATE="{host}-ib0"))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert re.search(r"error: rank 1 \(host n10\): cannot reach rank 0 at n9-ib0:\d+ within 8 s",
                     text), text
    assert re.search(r"error: rank 1 \(host n10-ib0\): did not reach rank 0's port \d+ within "
                     r"8 s", text), text
    assert re.search(r"error: rank 0 \(host n9\): cannot resolve n9-ib0 \(.*\), the name "
                     r"TFDIST_HOST_TEMPLATE=\{host\}-ib0 gives", text), text


@pytest.mark.timeout(60)
def test_a_failing_ranks_last_lines_reach_srun_even_when_it_ends_at_once(
        slurm_cluster: SlurmCluster) -> None:
    # The rendered jobs' main step: srun --kill-on-bad-exit, the output through srun. Ended at
    # the first task that fails, the step dropped what that task wrote just before: the error
    # line after a 20-frame traceback, 0 times in 8 when the process ended at once. tfdist's
    # failure hook lingers (tfdist.failures.linger).
    out = slurm_cluster.srun(*TWO_NODES, "--kill-on-bad-exit=1", slurm_cluster.python,
                             str(ROOT / "tests" / "workers" / "excepthook_worker.py"),
                             env=slurm_cluster.job_env(PYTHONPATH=str(ROOT)))
    text = out.stdout + out.stderr
    assert "srun: error: n10: task 1: Exited with exit code 1" in text, text
    assert "ValueError: the cause, on rank 1" in text, text


def _fault_job(cluster: SlurmCluster, kind: str) -> tuple[str, dict[int, str], float, int]:
    """Runs the fit with the fault; returns the batch output, each task's output, the seconds
    from the fault to the end of the step, and the step's exit code."""
    workdir = cluster.new_workdir()
    script = f"""\
        #SBATCH --nodes=2 --ntasks-per-node=1 --nodelist=n[9-10] --time=5
        #SBATCH --partition={cluster.partition} --output=job.out
        srun --kill-on-bad-exit=1 --output=task-%t.out {cluster.python} {WORKER} {kind} 1
        code=$?
        echo "step ended at $(date +%s.%N) with $code"
        """
    job = cluster.run_job(script, cwd=workdir, timeout=240,
                          env=cluster.job_env(TFDIST_NUM_THREADS="1",
                                              **(HANG_ENV if kind == "stop" else {})))
    batch = job.output
    tasks = {rank: (workdir / f"task-{rank}.out").read_text() for rank in (0, 1)}
    fault = re.search(rf"fault-fit: rank 1 {kind} at (\S+)", tasks[1])
    ended = re.search(r"step ended at (\S+) with (\d+)", batch)
    assert fault and ended, f"{job.describe()}\n{tasks}"
    return batch, tasks, float(ended.group(1)) - float(fault.group(1)), int(ended.group(2))


@pytest.mark.timeout(300)
def test_a_killed_task_ends_the_step_in_seconds_and_srun_names_it(
        slurm_cluster: SlurmCluster) -> None:
    batch, tasks, took, code = _fault_job(slurm_cluster, "kill")
    print(f"a killed task: the step ended {took:.1f} s after the kill")
    assert code != 0
    assert "srun: error: n10: task 1: Killed" in batch, batch
    # srun ends the step by SIGCONT, SIGTERM and SIGKILL to the others: rank 0, never stopped,
    # must not take that SIGCONT for a stop of its own.
    assert "was stopped (SIGSTOP" not in tasks[0], tasks[0][-3000:]
    assert took < BOUND_S, f"{took:.0f} s\n{batch}\n{tasks[0][-2000:]}"


@pytest.mark.timeout(300)
def test_a_hung_task_is_named_by_rank_0_and_ends_the_step(slurm_cluster: SlurmCluster) -> None:
    batch, tasks, took, code = _fault_job(slurm_cluster, "stop")
    print(f"a hung task: the step ended {took:.1f} s after the stop")
    assert code != 0
    assert re.search(r"^tfdist: rank 1 \(host n10\) failed or stopped responding .* rank 0 "
                     r"stops here after step \d+ of epoch 1\. Look at rank 1's own output first.*"
                     r"the task 1 file of --output", tasks[0], re.M), tasks[0][-3000:]
    assert "srun: error: n9: task 0: Exited with exit code 1" in batch, batch
    # srun continues the stopped task before it kills it: in between, it finds rank 0 gone, and
    # must not name rank 0 as the one that failed.
    assert "tfdist: rank 0 (host n9) failed" not in tasks[1], tasks[1][-3000:]
    print("task 1:", [line for line in tasks[1].splitlines() if line.startswith("tfdist:")])
    assert took < BOUND_S, f"{took:.0f} s\n{batch}\n{tasks[0][-2000:]}"


PREEMPT_WORKER = ROOT / "tests" / "workers" / "preempt_worker.py"
NODE_LOSS_ENV = {"TFDIST_HEARTBEAT_TIMEOUT": "10", "PREEMPT_TEST_STEP_SLEEP": "0.15",
                 "PREEMPT_TEST_BATCH": "48", "TF_CPP_MIN_LOG_LEVEL": "2"}
STEPS = 3 * (512 // 48)  # 3 epochs of 10 steps


def _assert_bit_identical(alone: Path, out: Path, run: int) -> None:
    """Every rank's weights after ``run`` in ``out`` are those of the uninterrupted run."""
    for rank in (0, 1):
        with np.load(alone / f"weights-{rank}-0.npz") as want, \
                np.load(out / f"weights-{rank}-{run}.npz") as got:
            for key in want.files:
                np.testing.assert_array_equal(got[key], want[key])


def _start_straight(workdir: Path, workers: int, env: dict[str, str]) -> Callable[[], Path]:
    """Starts an uninterrupted run of the preemption worker on ``workers`` local workers with
    ``env``, its steps not slowed, and returns the function that waits for it (4 minutes at
    most) and returns its results folder: a test waits for the cluster meanwhile."""
    straight = workdir / "straight"
    straight.mkdir()
    log = workdir / "straight.log"
    with log.open("w") as out:
        run = subprocess.Popen([sys.executable, "-m", "tfdist", "launch", "-n", str(workers),
                                str(PREEMPT_WORKER), str(straight), str(workdir / "m1"), "mwms",
                                "-1", "0"],
                               env=clean_env(**{**env, "PREEMPT_TEST_STEP_SLEEP": "0"}),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def finished() -> Path:
        try:
            code = run.wait(timeout=240)
        finally:
            if run.poll() is None:  # past its time: the launch and its workers
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        assert code == 0, log.read_text()[-6000:]
        return straight

    return finished


def _straight(workdir: Path, workers: int, env: dict[str, str]) -> Path:
    """The results folder of an uninterrupted run (:func:`_start_straight`), waited for."""
    return _start_straight(workdir, workers, env)()


def _wait_requeued(cluster: SlurmCluster, job_id: str, cut: float) -> float:
    """Waits until the job has been requeued, at most 120 s after the fault at ``cut``
    (monotonic); the seconds it took."""
    while (info := cluster.job_info(job_id)).get("Restarts", "0") == "0":
        assert info.get("JobState") not in TERMINAL_STATES, info
        assert time.monotonic() - cut < 120, f"not requeued 120 s after the cut: {info}"
        time.sleep(0.5)
    return time.monotonic() - cut


def _results(folder: Path, run: int) -> dict[int, dict]:
    return {rank: json.loads(path.read_text()) for rank in range(3)
            if (path := folder / f"result-{rank}-{run}.json").exists()}


@pytest.mark.timeout(480)
def test_a_node_lost_mid_epoch_is_survived_and_every_step_is_trained_once(
        slurm_cluster: SlurmCluster) -> None:
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    config = cluster_config(
        slurm_cluster, job_name="survive", nodes=3, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-11]"], min_nodes=2, node_restarts=1,
        time="00:06:00", doctor=False,  # the job's subject is the lost node, not the doctor
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=NODE_LOSS_ENV)
    job_id, script = submit_rendered(slurm_cluster, config, workdir=workdir)
    assert "#SBATCH --no-kill" in script.read_text()
    rank2 = workdir / f"survive-{job_id}-2.out"
    deadline = time.monotonic() + 180
    while "tfdist-test: rank 2 step 13" not in (rank2.read_text() if rank2.exists() else ""):
        assert time.monotonic() < deadline, slurm_cluster.job_info(job_id)
        time.sleep(0.2)
    cut_off("n11")  # in epoch 2, 3 steps after epoch 1's exact state
    try:
        result = slurm_cluster.wait(job_id, timeout=300)
        # The uninterrupted run (local, the same global batch and order) while n11 comes back
        straight = _start_straight(workdir, 3, NODE_LOSS_ENV)
    finally:
        back(slurm_cluster, "n11")
    alone_folder = straight()
    output = result.output
    assert result.ok, result.describe()
    assert "tfdist survive: the training step on n9,n10,n11 failed; n11 did not answer: " \
           "training goes on on n9, n10 (2 of 3 nodes; restart 1 of 1) from the last save" \
           in output, result.describe()
    tasks = "".join((workdir / f"survive-{job_id}-{rank}.out").read_text() for rank in (0, 1))
    assert "tfdist: rank 2 (host n11) failed or stopped responding" in tasks, tasks[-3000:]
    assert "tfdist: resuming at step 10 of epoch 1 (its end)" in tasks, tasks[-3000:]  # appended
    stopped, resumed = _results(workdir / "out", 0), _results(workdir / "out", 1)
    assert sorted(resumed) == [0, 1] and all(r["code"] == 0 for r in resumed.values()), resumed
    assert all(r["steps"] >= 13 for r in stopped.values()), stopped  # n9, n10 reached epoch 2
    for rank, after in resumed.items():  # from epoch 1's end: the 20 steps after it, once
        assert after["steps"] == STEPS - STEPS // 3, (rank, after)
    with np.load(alone_folder / "weights-0-0.npz") as alone, \
            np.load(workdir / "out" / "weights-0-1.npz") as after:
        worst = max(float(np.abs(alone[k] - after[k]).max()) for k in alone.files)
        moved = max(float(np.abs(alone[k]).max()) for k in alone.files)
        print(f"a lost node: the resumed run's weights differ from an uninterrupted run's by "
              f"{worst:.2e} at most (weights up to {moved:.2f})")
        for key in alone.files:  # 3 workers, then 2: summed in another order
            np.testing.assert_allclose(after[key], alone[key], rtol=1e-4, atol=1e-5)


WALLTIME_ENV = {"TFDIST_WALLTIME_MARGIN": "40", "PREEMPT_TEST_STEP_SLEEP": "0.4",
                "PREEMPT_TEST_DROPOUT": "1", "TFDIST_PREEMPT_CHECK_SECONDS": "0.05",
                "TF_CPP_MIN_LOG_LEVEL": "2"}
WALLTIME_STEPS = 3 * (512 // 32)  # 3 epochs of 16 steps, 0.4 s each


@pytest.mark.timeout(420)
def test_a_job_without_a_signal_stops_before_its_time_limit_and_resumes_bit_identical(
        slurm_cluster: SlurmCluster) -> None:
    # `--time=1`, requeue, and no --signal: Slurm would SIGTERM the tasks at 60 s and SIGKILL
    # them 0.2 s later. Slurm 22.05 sets no SLURM_JOB_END_TIME, so the chief asks squeue for
    # the end; with a margin of 40 s the guard stops both ranks at one step about 20 s into the
    # job, mid-training, saves the exact state, and the chief requeues the job. The second run
    # gets 5 minutes (scontrol update TimeLimit, as a user extends a job), resumes at that step
    # and ends bit-identical to an uninterrupted run, every step trained once.
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    config = cluster_config(
        slurm_cluster, job_name="walltime", nodes=2, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-10]", "--open-mode=append"],
        requeue=True, time="00:01:00", doctor=False,
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=WALLTIME_ENV)
    job_id, script = submit_rendered(slurm_cluster, config, workdir=workdir)
    assert "--signal" not in script.read_text()
    deadline = time.monotonic() + 180
    while (info := slurm_cluster.job_info(job_id)).get("Restarts", "0") == "0":
        assert info.get("JobState") not in TERMINAL_STATES, info
        assert time.monotonic() < deadline, f"never requeued: {info}"
        time.sleep(0.2)
    requeued = time.monotonic()  # released early, once its last run has left COMPLETING
    while time.monotonic() - requeued < 2 or "COMPLETING" in slurm_cluster.job_info(
            job_id).get("JobState", ""):
        assert time.monotonic() < deadline, "the requeued job never left COMPLETING"
        time.sleep(0.2)
    for change in ("TimeLimit=5", "StartTime=now"):
        changed = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", change)
        assert changed.returncode == 0, changed.stderr
    result = slurm_cluster.wait(job_id, timeout=240)
    assert result.ok and result.info.get("Restarts") == "1", result.describe()
    tasks = "".join((workdir / f"walltime-{job_id}-{rank}.out").read_text() for rank in (0, 1))
    left = [int(n) for n in re.findall(r"tfdist: walltime: (\d+) s left before this run's end "
                                       r"\(from squeue\), the margin is 40 s", tasks)]
    assert len(left) == 1 and left[0] <= 40, (left, tasks[-3000:])  # the second run: 5 minutes
    assert re.search(rf"tfdist: requeue 1 of 20: `\S*scontrol requeue {job_id}`", tasks), \
        tasks[-3000:]
    stopped, resumed = _results(workdir / "out", 0), _results(workdir / "out", 1)
    assert [r["code"] for r in stopped.values()] == [75, 75], (stopped, tasks[-3000:])
    assert [r["signal"] for r in stopped.values()] == [None, None], stopped  # the guard's stop
    assert len({(r["epoch"], r["step"]) for r in stopped.values()}) == 1, stopped
    alone = _results(_straight(workdir, 2, WALLTIME_ENV), 0)  # the same batch and order
    for rank in (0, 1):
        before, after = stopped[rank], resumed[rank]
        assert 0 < before["steps"] < WALLTIME_STEPS, before  # stopped mid-training
        assert before["steps"] + after["steps"] == alone[rank]["steps"] == WALLTIME_STEPS
        assert after["digest"] == alone[rank]["digest"], (rank, after, alone[rank])


@full_matrix_only("a lost node other than the batch script's is survived "
                  "(test_a_node_lost_mid_epoch_is_survived_and_every_step_is_trained_once), "
                  "and the tasks' probe and requeue are table-tested (test_survive.py)")
@pytest.mark.timeout(600)
def test_losing_the_batch_scripts_node_requeues_the_job_at_once(
        slurm_cluster: SlurmCluster) -> None:
    # n9 runs the batch script, tfdist survive and rank 0: cut off wholly in epoch 2, nothing
    # there can requeue the job, and Slurm 22.05 leaves a --no-kill job RUNNING to its time
    # limit. The tasks on n10 and n11 name rank 0 (n9), find that n9 runs no step, and requeue
    # the job. n9 back, the requeued run resumes at epoch 1's end and every step is trained
    # once over both runs.
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    config = cluster_config(
        slurm_cluster, job_name="orphan", nodes=3, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-11]", "--open-mode=append"],
        min_nodes=2, node_restarts=1, requeue=True, time="00:08:00", doctor=False,
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=NODE_LOSS_ENV)
    job_id, script = submit_rendered(slurm_cluster, config, workdir=workdir)
    assert "export TFDIST_REQUEUE_IF_BATCH_LOST=1" in script.read_text()
    wait_for_line(slurm_cluster, job_id, workdir / f"orphan-{job_id}-2.out",
                   "tfdist-test: rank 2 step 13", 180)
    cut_off_wholly("n9")
    cut = time.monotonic()
    try:
        requeued = _wait_requeued(slurm_cluster, job_id, cut)
        print(f"the batch script's node cut off: the job requeued {requeued:.1f} s later")
    finally:
        back(slurm_cluster, "n9")
    result = slurm_cluster.wait(job_id, timeout=360)
    tasks = "".join((workdir / f"orphan-{job_id}-{rank}.out").read_text() for rank in (1, 2))
    assert "tfdist: rank 0 (host n9) failed or stopped responding" in tasks, tasks[-3000:]
    assert f"n9, the node of the job's batch script and its step loop, does not answer: " \
           f"requeued job {job_id}" in tasks, tasks[-3000:]
    assert result.ok, result.describe()
    # The requeued run's step is tfdist survive's first again (TFDIST_RESTART_COUNT=0): its
    # results replace those the first run's ranks 1 and 2 wrote as they failed.
    resumed = _results(workdir / "out", 0)
    assert sorted(resumed) == [0, 1, 2] and all(r["resumed"] for r in resumed.values()), resumed
    assert all(r["code"] == 0 and r["steps"] == STEPS - STEPS // 3 for r in resumed.values()), \
        resumed  # from epoch 1's end (3 workers again): the 20 steps after it, once
    assert {r["digest"] for r in resumed.values()} == {resumed[0]["digest"]}, resumed


@full_matrix_only("below min_nodes tfdist survive exits 75 (test_survive.py), the rendered "
                  "script requeues on 75 and its doctor step runs again after a signal "
                  "(test_jobs.py), and a requeued job resumes bit-identical "
                  "(test_slurm_jobs.py)")
@pytest.mark.timeout(600)
def test_below_min_nodes_the_job_is_requeued_and_its_next_run_completes(
        slurm_cluster: SlurmCluster) -> None:
    # n9 and n10 (min_nodes 2, requeue, the doctor step on, as a user's job has it): n10 cut
    # off in epoch 2. One node is below min_nodes: tfdist survive exits 75 and the job script
    # requeues the job. n10 back, the requeued run (the doctor first, where the old run's
    # cleanup once killed a task) resumes at epoch 1's end and completes, bit-identical to an
    # uninterrupted 2-worker run, every step after the save trained once.
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    config = cluster_config(
        slurm_cluster, job_name="short", nodes=2, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-10]", "--open-mode=append"],
        min_nodes=2, node_restarts=1, requeue=True, time="00:06:00",
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=NODE_LOSS_ENV)
    job_id, _ = submit_rendered(slurm_cluster, config, workdir=workdir)
    wait_for_line(slurm_cluster, job_id, workdir / f"short-{job_id}-1.out",
                  "tfdist-test: rank 1 step 13", 180)
    cut_off("n10")
    cut = time.monotonic()
    try:
        requeued = _wait_requeued(slurm_cluster, job_id, cut)
        print(f"below min_nodes: the job requeued {requeued:.1f} s after the cut")
    finally:
        back(slurm_cluster, "n10")
    while "COMPLETING" in slurm_cluster.job_info(job_id).get("JobState", ""):
        assert time.monotonic() - cut < 300, "the requeued job never left COMPLETING"
        time.sleep(0.2)
    released = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    assert released.returncode == 0, released.stderr  # else Slurm holds it about two minutes
    result = slurm_cluster.wait(job_id, timeout=300)
    alone_folder = _start_straight(workdir, 2, NODE_LOSS_ENV)()
    assert result.ok and result.info.get("Restarts") == "1", result.describe()
    assert "n10 did not answer" in result.output and "requeueing job" in result.output, \
        result.describe()
    # The requeued run's step is tfdist survive's first again (TFDIST_RESTART_COUNT=0).
    resumed = _results(workdir / "out", 0)
    assert sorted(resumed) == [0, 1] and all(r["resumed"] for r in resumed.values()), resumed
    for rank, after in resumed.items():  # from epoch 1's end: the 20 steps after it, once
        assert after["code"] == 0 and after["steps"] == STEPS - STEPS // 3, (rank, after)
    _assert_bit_identical(alone_folder, workdir / "out", 0)


@full_matrix_only("a spare's place-taking is table-tested and run with a stand-in srun "
                  "(test_survive.py), and a lost node on the cluster is survived "
                  "(test_a_node_lost_mid_epoch_is_survived_and_every_step_is_trained_once)")
@pytest.mark.timeout(480)
def test_a_spare_takes_a_lost_nodes_place_and_the_run_ends_bit_identical(
        slurm_cluster: SlurmCluster) -> None:
    # n9 and n10 train, n11 waits (spare_nodes 1); n10 cut off in epoch 2. tfdist survive
    # finds n10 silent and n11 answering, and the step starts again on n9 and n11 from epoch
    # 1's end: 2 workers, as before, so with Dropout too the weights are an uninterrupted
    # 2-worker run's, bit for bit, and every step after the save is trained once.
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    env = {**NODE_LOSS_ENV, "PREEMPT_TEST_DROPOUT": "1", "PREEMPT_TEST_BATCH": "32"}
    config = cluster_config(
        slurm_cluster, job_name="spare", nodes=2, spare_nodes=1, gpus_per_node=0,
        gpu_type=None, tasks_per_node=1, sbatch_args=["--nodelist=n[9-11]"], node_restarts=1,
        time="00:06:00", doctor=False,
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=env)
    job_id, script = submit_rendered(slurm_cluster, config, workdir=workdir)
    assert "--spares 1" in script.read_text()
    wait_for_line(slurm_cluster, job_id, workdir / f"spare-{job_id}-1.out",
                   "tfdist-test: rank 1 step 20", 180)
    cut_off("n10")  # in epoch 2 (16 steps an epoch), 4 after epoch 1's end
    cut = time.monotonic()
    try:
        result = slurm_cluster.wait(job_id, timeout=300)
        straight = _start_straight(workdir, 2, env)
    finally:
        back(slurm_cluster, "n10")
    alone_folder = straight()
    assert result.ok, result.describe()
    assert "n10 did not answer (spare n11 in its place): training goes on on n9, n11 (as many " \
           "as before" in result.output, result.describe()
    resumed = _results(workdir / "out", 1)
    assert sorted(resumed) == [0, 1], resumed
    steps = 3 * (512 // 32)
    for rank, after in resumed.items():  # from epoch 1's end: the 32 steps after it, once
        assert after["code"] == 0 and after["steps"] == steps - steps // 3, (rank, after)
    _assert_bit_identical(alone_folder, workdir / "out", 1)
    print(f"a spare took a lost node's place; the job ended {time.monotonic() - cut:.0f} s "
          "after the cut")


@full_matrix_only("a task that failed while every node answered is restarted on the same nodes, "
                  "a crash loop is not, with a stand-in srun (test_survive.py)")
@pytest.mark.timeout(480)
def test_a_task_killed_on_a_healthy_node_restarts_and_the_run_ends_bit_identical(
        slurm_cluster: SlurmCluster) -> None:
    # n9 and n10 train (min_nodes 2); rank 1's process on n10 is SIGKILLed in epoch 2, as the
    # OOM killer would. Every node answers tfdist survive's probe, so the step starts again on
    # both from epoch 1's end: the same 2 workers, and with Dropout the weights are an
    # uninterrupted run's, bit for bit; no rank takes srun's SIGCONT for a stop of its own.
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    env = {**NODE_LOSS_ENV, "PREEMPT_TEST_DROPOUT": "1", "PREEMPT_TEST_BATCH": "32"}
    config = cluster_config(
        slurm_cluster, job_name="oom", nodes=2, min_nodes=2, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-10]", "--open-mode=append"],
        node_restarts=1, time="00:06:00", doctor=False,
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=env)
    job_id, _ = submit_rendered(slurm_cluster, config, workdir=workdir)
    wait_for_line(slurm_cluster, job_id, workdir / f"oom-{job_id}-1.out",
                   "tfdist-test: rank 1 step 20", 180)
    kill_in("n10")  # as the kernel's OOM killer would: the task gone, the node healthy
    result = slurm_cluster.wait(job_id, timeout=300)
    alone_folder = _start_straight(workdir, 2, env)()
    assert result.ok, result.describe()
    assert "every node answered: a task failed (task 1: Killed) on a healthy node; training " \
           "starts again on the same 2 node(s) (restart 1 of 1) from the last save" in \
           result.output, result.describe()
    tasks = "".join((workdir / f"oom-{job_id}-{rank}.out").read_text() for rank in (0, 1))
    assert "was stopped (SIGSTOP" not in tasks, tasks[-3000:]
    resumed = _results(workdir / "out", 1)
    steps = 3 * (512 // 32)
    assert sorted(resumed) == [0, 1], resumed
    for rank, after in resumed.items():  # from epoch 1's end: the 32 steps after it, once
        assert after["code"] == 0 and after["steps"] == steps - steps // 3, (rank, after)
    _assert_bit_identical(alone_folder, workdir / "out", 1)


@full_matrix_only("a lost node that answers again rejoins at the next save, with a stand-in "
                  "srun (test_survive.py)")
@pytest.mark.timeout(600)
def test_a_lost_node_that_comes_back_rejoins_the_job_at_its_next_save(
        slurm_cluster: SlurmCluster) -> None:
    # n11 cut off in epoch 2: training goes on on n9 and n10. Once it is back, tfdist survive's
    # next probe of the lost nodes (every 30 s) finds it; the step stops at a save (every rank
    # at one agreed step, exit 75) and goes on on all three, from that save: every step
    # trained once over the three runs, the weights an uninterrupted 3-worker run's within
    # rounding (3, 2, then 3 workers sum in other orders).
    workdir = slurm_cluster.new_workdir()
    (workdir / "out").mkdir()
    env = {**NODE_LOSS_ENV, "PREEMPT_TEST_STEP_SLEEP": "1.5",
           "TFDIST_PREEMPT_CHECK_SECONDS": "0.05"}
    config = cluster_config(
        slurm_cluster, job_name="grow", nodes=3, gpus_per_node=0, gpu_type=None,
        tasks_per_node=1, sbatch_args=["--nodelist=n[9-11]"], min_nodes=2, node_restarts=1,
        time="00:09:00", doctor=False,
        script=PREEMPT_WORKER, args=["out", "model", "mwms", "-1", "0"], env=env)
    job_id, _ = submit_rendered(slurm_cluster, config, workdir=workdir)
    batch = workdir / f"grow-{job_id}.out"
    rank2 = workdir / f"grow-{job_id}-2.out"
    deadline = time.monotonic() + 240
    while "tfdist-test: rank 2 step 13" not in (rank2.read_text() if rank2.exists() else ""):
        assert time.monotonic() < deadline, slurm_cluster.job_info(job_id)
        time.sleep(0.2)
    cut_off("n11")
    returned = None
    try:
        while "training goes on on n9, n10" not in (batch.read_text() if batch.exists() else ""):
            assert time.monotonic() < deadline + 120, slurm_cluster.job_info(job_id)
            time.sleep(0.2)
    finally:
        returned = time.monotonic()  # its network up again (and the node back in service)
        back(slurm_cluster, "n11")
    while "training goes on on n9, n10, n11 (3 of 3 nodes)" not in batch.read_text():
        assert time.monotonic() - returned < 120, batch.read_text()[-3000:]
        time.sleep(0.2)
    print(f"a lost node back: training on 3 nodes again {time.monotonic() - returned:.0f} s "
          "after it answered")
    result = slurm_cluster.wait(job_id, timeout=300)
    alone_folder = _start_straight(workdir, 3, env)()
    assert result.ok, result.describe()
    assert "n11 answers again: the step stops at its next save" in result.output, \
        result.describe()
    runs = [_results(workdir / "out", run) for run in (0, 1, 2)]
    assert sorted(runs[2]) == [0, 1, 2] and all(r["code"] == 0 for r in runs[2].values()), runs
    assert all(r["code"] == 75 for r in runs[1].values()), runs[1]  # stopped at a save
    # Every step after epoch 1's end once: those of the 2-node run, then the rest on 3.
    assert runs[1][0]["steps"] + runs[2][0]["steps"] == STEPS - STEPS // 3, runs
    with np.load(alone_folder / "weights-0-0.npz") as alone, \
            np.load(workdir / "out" / "weights-0-2.npz") as after:
        for key in alone.files:
            np.testing.assert_allclose(after[key], alone[key], rtol=1e-4, atol=1e-5)
