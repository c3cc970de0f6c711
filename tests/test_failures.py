"""A peer that dies or hangs is named in one tfdist line, next to TensorFlow's error.

The messages are TensorFlow's, copied from real runs: a 2-worker MWMS fit under ``tfdist
launch`` whose rank 1 was killed (coordination-service heartbeats), and a Slurm task whose
chief (the service's host) had exited. Then a real hang: rank 1 of a 2-worker fit is stopped
with SIGSTOP, and rank 0 must exit non-zero naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, WORKERS

from tfdist.env import ClusterEnvironment
from tfdist.failures import explain, failed_ranks

HEARTBEATS = (
    "Graph execution error:\n\nCollective ops is aborted by: Error reported from "
    "/job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs for an earlier "
    "error, or scheduler events (e.g. preemption, eviction) to debug further.\nThe error could "
    "be from a previous operation. Restart your program to reset.")
LEADER_GONE = (
    "BaseCollectiveExecutor::StartAbort UNAVAILABLE: Failed to send RPC to coordination "
    "service. Either the leader task was preempted/died/restarted unexpectedly or this task is "
    "experiencing network issues.\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/Heartbeat:\n"
    ":UNKNOWN:Error received from peer {grpc_status:14, grpc_message:\"failed to connect to all "
    "addresses; last error: UNKNOWN: ipv4:10.77.9.9:20928: Failed to connect to remote host: "
    "Connection refused\"}")
ADDRESSES = ("n9:20928", "n9:20929", "n10:20928", "n10:20929")

MESSAGES = {
    # name: (message, addresses, failed ranks)
    "heartbeats stopped": (HEARTBEATS, (), [1]),
    "two ranks unhealthy": (HEARTBEATS.replace("task:1\nThe", "task:1\n"
                                               "/job:worker/replica:0/task:3\nThe"), (), [1, 3]),
    "the coordination service's host is gone": (LEADER_GONE, ADDRESSES, [0]),
    "a peer refuses connections, named by address": (
        "UNAVAILABLE: failed to connect to all addresses; last error: ipv4 n10:20929: "
        "Connection refused", ADDRESSES, [3]),
    "a shape mismatch names no failed peer": (
        "Shape mismatch in the collective instance 100. Op at device ... expected shape [4]",
        ADDRESSES, []),
    "an out-of-memory error of this rank names none": ("OOM when allocating tensor", (), []),
}


@pytest.mark.parametrize("case", sorted(MESSAGES))
def test_failed_ranks(case):
    message, addresses, ranks = MESSAGES[case]
    assert failed_ranks(message, addresses) == ranks


def test_the_line_names_rank_host_step_and_where_to_look():
    environment = ClusterEnvironment("slurm", rank=0, world_size=4, worker_addresses=ADDRESSES)
    line = explain(HEARTBEATS, environment, {"epoch": 1, "step": 7})
    assert line == (
        "tfdist: rank 1 (host n9) failed or stopped responding (crashed, killed, out of memory, "
        "or hung); rank 0 stops here after step 7 of epoch 2. Look at rank 1's own output first:"
        " it holds the cause, and the error above only follows from it (under srun: the task 1 "
        "file of --output=...%t...).")
    # The failed rank itself, or an error that names nobody, gets no line.
    assert explain(HEARTBEATS, ClusterEnvironment("slurm", rank=1, world_size=4)) is None
    assert explain("OOM when allocating tensor", environment) is None


@pytest.mark.multiprocess
def test_a_hung_peer_is_named_by_the_others_within_a_bound(tmp_path):
    # Rank 1 is stopped (SIGSTOP: a hang, not a crash) in the middle of fit. Rank 0 must end
    # with TensorFlow's error and tfdist's line naming rank 1; measured from the stop.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TFDIST_", "OMPI_", "PMI", "HOROVOD_", "TF_CONFIG"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tfdist", "launch", "-n", "2",
                             str(WORKERS / "long_fit_worker.py")], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, stopped_at, pid = [], None, None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"\[1\] long-fit: pid (\d+) training", line)
            if found and pid is None:
                pid, stopped_at = int(found.group(1)), time.monotonic()
                os.kill(pid, signal.SIGSTOP)
            if "tfdist: rank 1 (host" in line:
                break
        took = time.monotonic() - (stopped_at or time.monotonic())
        proc.wait(timeout=120)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
    output = "".join(lines)
    assert pid is not None, output[-3000:]
    assert re.search(r"\[0\] tfdist: rank 1 \(host 127\.0\.0\.1\) failed or stopped responding"
                     r".*rank 0 stops here after step \d+ of epoch \d+", output), output[-3000:]
    print(f"rank 0 named the hung rank {took:.1f} s after the stop")
    assert took < 90, f"rank 0 noticed the hang after {took:.0f} s"
    assert proc.returncode != 0
