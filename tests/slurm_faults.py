"""Node faults on the Slurm test cluster, shared by its failure tests and by
``tests/slurm/time_to_train.py``: a node's network cut, its processes killed, and the node
back in service afterwards. Each node is a network namespace (``tfdist-nK``) whose link to the
cluster's bridge is ``tfd-nK`` (tests/slurm/cluster.sh)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from slurmtest import CLUSTER_SH, SlurmCluster

__all__ = ["back", "cut_off", "cut_off_wholly", "kill_in", "kill_node", "wait_for_line"]


def kill_in(node: str, *, everything: bool = False, slurmd: bool = False) -> None:
    """SIGKILLs the Python processes in ``node``'s namespace (``everything``: all but its
    slurmd, which stays to come back after the test, as after a reboot; ``slurmd``: that too)."""
    pids = subprocess.run(["ip", "netns", "pids", f"tfdist-{node}"], capture_output=True,
                          text=True, check=True).stdout.split()
    for pid in pids:
        comm = Path(f"/proc/{pid}/comm")
        name = comm.read_text().strip() if comm.exists() else "slurmd"
        doomed = slurmd or name != "slurmd" if everything else name.startswith("python")
        if doomed:
            subprocess.run(["kill", "-9", pid], check=False)


def cut_off(node: str) -> None:
    """What a node's death looks like to the others: its network cut, its tasks gone (its
    slurmd stays, to come back after the test)."""
    subprocess.run(["ip", "link", "set", f"tfd-{node}", "down"], check=True)
    kill_in(node)


def cut_off_wholly(node: str) -> None:
    """A node's death as the others see it, its job processes all gone: the network cut and
    every process in its namespace killed but its slurmd."""
    subprocess.run(["ip", "link", "set", f"tfd-{node}", "down"], check=True)
    kill_in(node, everything=True)


def kill_node(node: str) -> None:
    """A node whose every process died, Slurm's daemon too, its network up: its kernel
    refuses connections at once (a cut node answers none). :func:`back` revives it."""
    kill_in(node, everything=True, slurmd=True)


def back(cluster: SlurmCluster, node: str, timeout: float = 120) -> None:
    """The node's network up again, its slurmd running and the node back in service
    (ReturnToService=2), running no job."""
    subprocess.run(["ip", "link", "set", f"tfd-{node}", "up"], check=True)
    subprocess.run(["bash", str(CLUSTER_SH), "revive", node], check=True, capture_output=True)
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        state = cluster.run("sinfo", "-h", "-N", "-n", node, "-p", cluster.partition, "-o",
                            "%t").stdout.strip()
        # "mix" with no job there: a step of the job it lost that Slurm still counts there
        # (for about two minutes on the test cluster); the node takes jobs again
        if state == "idle" or (state == "mix" and not cluster.run(
                "squeue", "-h", "-w", node, "-o", "%i").stdout.strip()):
            return
        if state.startswith("down") and not state.endswith("*"):
            cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
        time.sleep(1)
    jobs = cluster.run("squeue", "-h", "-w", node, "-o", "%i %T %r").stdout.strip()
    shown = cluster.run("scontrol", "show", "node", node).stdout
    raise AssertionError(f"{node} did not come back: {state}; its jobs: {jobs or 'none'}\n{shown}")


def wait_for_line(cluster: SlurmCluster, job_id: str, path: Path, line: str,
                  seconds: float) -> None:
    """Waits until ``path`` (a task's output) holds ``line``."""
    deadline = time.monotonic() + seconds
    while line not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, cluster.job_info(job_id)
        time.sleep(0.2)
