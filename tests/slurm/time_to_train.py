"""Seconds from a node's loss to the next training step, on the Slurm test cluster.

    .venv/bin/python tests/slurm/time_to_train.py [--runs 5] [--kinds cut,kill]

Each run submits the job a user gets from ``tfdist job --nodes 3 --min-nodes 2`` (n9-n11, one
MWMS task a node, the preemption test worker: 10 steps an epoch), waits for epoch 2, then
takes n11 away and times what follows, polling the job's output files every 0.05 s:

- ``cut``: n11's network cut and its tasks killed (a node that died: its host answers nothing);
- ``kill``: every process on n11 killed, Slurm's slurmd too, its network up (its kernel refuses
  connections at once).

Printed per run and as the median and range of each kind, in seconds from the fault: *named*,
until srun says a task failed (the survivors found the silent peer and exited); *decided*,
until ``tfdist survive`` has probed the nodes and starts the next step; *started*, until rank
0's new process started; *init*, until its ``tfdist.init`` returned (TensorFlow imported, the
strategy made); *fit*, until it called ``fit``; *training*, until its first step after the
resume ended: the time to training again. The job is then cancelled and n11 brought back.
It needs the cluster (``tests/slurm/cluster.sh start``, root) and no test session using it;
about 80 s a run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

from slurm_faults import back, cut_off, kill_node, wait_for_line  # noqa: E402
from slurm_jobs import cluster_config, submit_rendered  # noqa: E402
from slurmtest import SlurmCluster, _acquire, _base_dir, _release  # noqa: E402

WORKER = TESTS / "workers" / "preempt_worker.py"
ENV = {"PREEMPT_TEST_STEP_SLEEP": "0.15",  # tfdist's own settings as a user gets them
       "PREEMPT_TEST_BATCH": "48", "PREEMPT_TEST_TIMES": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
FAULTS = {"cut": cut_off, "kill": kill_node}
POLLED = ("named", "decided")
TIMED = ("started", "init", "fit", "training")  # the worker's own clock: its "times" line
MARKS = POLLED + TIMED
_TIMES = re.compile(r"^tfdist-test: rank 0 times started=(\S+) init=(\S+) fit=(\S+) "
                    r"first_step=(\S+)$", re.M)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _times_after(text: str, since: float) -> dict[str, float] | None:
    """Rank 0's times of its run that started after ``since`` (the epoch's seconds)."""
    for found in _TIMES.finditer(text):
        values = [float(v) for v in found.groups()]
        if values[0] > since:
            return {mark: value - since for mark, value in zip(TIMED, values, strict=True)}
    return None


def one_run(cluster: SlurmCluster, kind: str) -> dict[str, float]:
    """Submits the job, takes n11 away by ``kind`` in epoch 2 and returns the seconds from
    then to each of :data:`MARKS`."""
    workdir = cluster.new_workdir()
    (workdir / "out").mkdir()
    config = cluster_config(
        cluster, job_name="ttt", nodes=3, gpus_per_node=0, gpu_type=None, tasks_per_node=1,
        sbatch_args=["--nodelist=n[9-11]", "--open-mode=append"], min_nodes=2,
        node_restarts=1, time="00:06:00", doctor=False, script=WORKER,
        args=["out", "model", "mwms", "-1", "0"], env=ENV)
    job_id, _ = submit_rendered(cluster, config, workdir=workdir)
    batch, rank0 = workdir / f"ttt-{job_id}.out", workdir / f"ttt-{job_id}-0.out"
    try:
        wait_for_line(cluster, job_id, workdir / f"ttt-{job_id}-2.out",
                      "tfdist-test: rank 2 step 13", 180)
        before = len(_text(batch))
        fault, wall = time.monotonic(), time.time()
        FAULTS[kind]("n11")
        seen: dict[str, float] = {}
        tests = {"named": lambda: "srun: error:" in _text(batch)[before:],
                 "decided": lambda: "training goes on on n9, n10" in _text(batch)}
        while (timed := _times_after(_text(rank0), wall)) is None:
            assert time.monotonic() - fault < 180, (seen, _text(batch)[-3000:])
            for mark in POLLED:
                if mark not in seen and tests[mark]():
                    seen[mark] = time.monotonic() - fault
            time.sleep(0.05)
        for mark in POLLED:  # a line the last poll missed: as late as it could be
            if mark not in seen and tests[mark]():
                seen[mark] = time.monotonic() - fault
        assert len(seen) == len(POLLED), (seen, _text(batch)[-3000:])
        return {**seen, **timed}
    finally:
        cluster.cancel(job_id)
        back(cluster, "n11")


def summary(kind: str, runs: list[dict[str, float]]) -> str:
    """One line per mark: its median and range over ``runs``."""
    lines = []
    for mark in MARKS:
        values = [run[mark] for run in runs]
        lines.append(f"{kind:5} {mark:9} median {statistics.median(values):5.1f} s, range "
                     f"{min(values):5.1f}-{max(values):5.1f} s over {len(values)} runs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kinds", default="cut,kill")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    base = _base_dir()
    _acquire(base)
    try:
        cluster = SlurmCluster.from_script()
        results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for number in range(args.runs):  # the kinds alternate: the machine's load drifts
            for kind in kinds:
                seen = one_run(cluster, kind)
                results[kind].append(seen)
                print(f"run {number + 1} {kind:5} " + ", ".join(
                    f"{mark} {seen[mark]:5.1f} s" for mark in MARKS), flush=True)
        print("\n".join(summary(kind, runs) for kind, runs in results.items()))
    finally:
        _release(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
