"""Faults on the Slurm test cluster: the doctor's checks under srun, and a task that dies or hangs.

- ``tfdist doctor`` as an srun step on n9 and n10: an interface no node has is named for each
  rank with its node, before anything slow starts; node names that do not resolve
  (``TFDIST_HOST_TEMPLATE``) stop both sides within the deadline, each naming the other.
- A 2-node MWMS fit (one task per node, ``srun --kill-on-bad-exit=1`` as the rendered scripts
  run it) whose task 1 sends itself SIGKILL (a crash) or SIGSTOP (a hang) at step 20. The step
  must end within a bound, measured from the fault: a killed task is named by srun
  (``srun: error: n10: task 1: Killed``) and srun ends the others at once; a hung task is found
  by TensorFlow's heartbeats, and rank 0 prints tfdist's line naming rank 1, its node and the
  step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from slurmtest import SlurmCluster

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "fault_fit_worker.py"
TWO_NODES = ("-N2", "--ntasks-per-node=1", "--nodelist=n[9-10]")
BOUND_S = 60  # measured: 2 s for a kill, 12 s for a hang (TensorFlow's heartbeat timeout)


@pytest.mark.timeout(120)
def test_doctor_under_srun_names_each_rank_with_a_missing_interface(
        slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun(*TWO_NODES, "--kill-on-bad-exit=1", slurm_cluster.python, "-m",
                             "tfdist", "doctor", "--timeout", "20",
                             env=slurm_cluster.job_env(NCCL_SOCKET_IFNAME="ib0"))
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
                          env=cluster.job_env(TFDIST_NUM_THREADS="1"))
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
