"""A peer that dies or hangs is named in one tfdist line, next to the backend's error.

The messages are copied from real runs. TensorFlow's: a 2-worker MWMS fit under ``tfdist
launch`` whose rank 1 was killed (coordination-service heartbeats), and a Slurm task whose
chief (the service's host) had exited. Horovod's (0.28.1, Gloo controller) and torch's (2.13,
gloo): 2 ranks on loopback whose rank 1 was killed (SIGKILL) or stopped (SIGSTOP) in the middle
of training; for torch also rank 1 raising (the other rank sees its connections close). NCCL's
are written as torch's and NCCL's sources format them (no two GPUs here), with made-up hosts.

Then real runs: rank 1 of 2 is stopped in the middle of an MWMS fit, killed in the middle of a
Horovod fit, killed and stopped in the middle of a torch DDP loop; rank 0 must exit non-zero
with the line naming rank 1 and its host, within a bound measured from the signal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, WORKERS, clean_env, port_block
from test_horovod import HVD_PY, needs_horovod

from tfdist.env import ClusterEnvironment
from tfdist.failures import explain, failed_host, failed_ranks, silent_message

# The TensorFlow 2.15 lane has no torch.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed (requirements/torch.txt)")

HEARTBEATS = (
    "Graph execution error:\n\nCollective ops is aborted by: Error reported from "
    "/job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs for an earlier "
    "error, or scheduler events (e.g. preemption, eviction) to debug further.\nThe error could "
    "be from a previous operation. Restart your program to reset.")
# TensorFlow 2.15.1, rank 1 stopped (SIGSTOP) during fit.
HEARTBEAT_TIMEOUT_215 = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call "
    "last):\n...\nCollective ops is aborted by: Error reported from /job:worker/task:1: Task "
    "/job:worker/replica:0/task:1 heartbeat timeout. This indicates that the remote task has "
    "failed, got preempted, or crashed unexpectedly. Check the task logs for an earlier error to "
    "debug further.\nThe error could be from a previous operation. Restart your program to "
    "reset.")
LEADER_GONE = (
    "BaseCollectiveExecutor::StartAbort UNAVAILABLE: Failed to send RPC to coordination "
    "service. Either the leader task was preempted/died/restarted unexpectedly or this task is "
    "experiencing network issues.\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/Heartbeat:\n"
    ":UNKNOWN:Error received from peer {grpc_status:14, grpc_message:\"failed to connect to all "
    "addresses; last error: UNKNOWN: ipv4:10.77.9.9:20928: Failed to connect to remote host: "
    "Connection refused\"}")
# The leader's host silent (its network cut): the heartbeat's deadline passes.
LEADER_SILENT = (
    "BaseCollectiveExecutor::StartAbort DEADLINE_EXCEEDED: Failed to send RPC to coordination "
    "service. Either the leader task was preempted/died/restarted unexpectedly or this task is "
    "experiencing network issues.\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/Heartbeat:\n"
    ":UNKNOWN:Error received from peer  {grpc_message:\"Deadline Exceeded\", grpc_status:4}")
ADDRESSES = ("n9:20928", "n9:20929", "n10:20928", "n10:20929")

# torch 2.13, gloo: rank 1 killed (rank 0 was reading from it), rank 1 raising (its group torn
# down), rank 1 stopped (until TFDIST_TORCH_TIMEOUT, 600 s by default).
TORCH_KILLED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:12498: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application. Check the logs of the remote worker before reporting "
    "an error. GLHF! \U0001f3d6\ufe0f")
TORCH_CRASHED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:7822. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
TORCH_TIMED_OUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 600000ms for recv operation to complete")
# Horovod 0.28.1 under TensorFlow 2.18, Keras 3 fit: the same error when rank 1 was killed and
# when it was stopped (after HOROVOD_GLOO_TIMEOUT_SECONDS), 12 lines of "File ..." left out.
HOROVOD_SHUT_DOWN = (
    "Graph execution error:\n\nDetected at node HorovodGroupedAllreduce_gradient_tape_sequential"
    "_1_dense_1_MatMul_MatMul_0_gradient_tape_sequential_1_dense_1_2_BiasAdd_BiasAddGrad_0 "
    "defined at (most recent call last):\n  File \"/work/main/tests/workers/long_fit_worker.py\","
    " line 41, in <module>\n\n  File \"/work/main/tests/workers/long_fit_worker.py\", line 36, in"
    " main\n\nHorovod has been shut down. This was caused by an exception on one of the ranks or "
    "an attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message.\n\t [[{{node HorovodGroupedAllreduce_gradient_tape_"
    "sequential_1_dense_1_MatMul_MatMul_0_gradient_tape_sequential_1_dense_1_2_BiasAdd_BiasAdd"
    "Grad_0}}]] [Op:__inference_multi_step_on_iterator_538]")
# What Horovod logs from C++ just before (not part of the error Python sees).
HOROVOD_LOG_KILLED = (
    "[2026-11-23 11:30:06.844123: E /tmp/pip-wheel-mhj_a55w/horovod_68d8c136e16e4bd5b0e1805e1f2c"
    "0613/horovod/common/operations.cc:697] [0]: Horovod background loop uncaught exception: [/tm"
    "p/pip-wheel-mhj_a55w/horovod_68d8c136e16e4bd5b0e1805e1f2c0613/third_party/compatible17_gloo/"
    "gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:29082: Connection reset by peer")
HOROVOD_LOG_STOPPED = (
    "[2026-11-23 11:29:26.296628: E /tmp/pip-wheel-mhj_a55w/horovod_68d8c136e16e4bd5b0e1805e1f2c"
    "0613/horovod/common/operations.cc:697] [0]: Horovod background loop uncaught exception: [/tm"
    "p/pip-wheel-mhj_a55w/horovod_68d8c136e16e4bd5b0e1805e1f2c0613/third_party/compatible17_gloo/"
    "gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for recv operation to "
    "complete")
# NCCL under torch, as the sources format them: the watchdog's timeout (it names this rank, not
# the failed one), with TORCH_NCCL_DESYNC_DEBUG=1's report, and a peer's socket closing.
NCCL_WATCHDOG = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=89, OpType=ALLREDUCE, "
    "NumelIn=67108864, NumelOut=67108864, Timeout(ms)=600000) ran for 600081 milliseconds before "
    "timing out.")
NCCL_DESYNC = (NCCL_WATCHDOG + "\n\t - To our best knowledge, the lagging/dead/mismatched ranks "
               "that caused the desync are:\n\t     [1] finished collective #89, but didn't join "
               "collective #90 (count from 1)")
NCCL_NEVER_JOINED = (NCCL_WATCHDOG + "\n\t - To our best knowledge, ranks [2, 3] are the lagging "
                     "ranks that caused this timeout. They never joined any collectives")
NCCL_REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2006, remote "
    "process exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call "
    "failed possibly due to a network error or a remote process exiting prematurely.\nLast "
    "error:\nsocketProgress: Connection closed by remote peer n10<57521>")

LOCAL = ("127.0.0.1:20001", "127.0.0.1:20002")  # tfdist launch's TF_CONFIG addresses
SRUN = ("localhost:29500", "localhost:29501")  # an srun step on node "localhost"
LOOPBACK = {"127.0.0.1": "localhost"}
NODES = {"10.77.9.9": "n9", "10.77.9.10": "n10"}  # what n9 and n10 resolve to

MESSAGES = {
    # name: (message, addresses, aliases, failed ranks, failed host)
    "heartbeats stopped": (HEARTBEATS, (), {}, [1], None),
    "two ranks unhealthy": (HEARTBEATS.replace("task:1\nThe", "task:1\n"
                                               "/job:worker/replica:0/task:3\nThe"), (), {},
                            [1, 3], None),
    "heartbeat timeout, TensorFlow 2.15": (HEARTBEAT_TIMEOUT_215, (), {}, [1], None),
    # Relayed by the coordination service's leader (task 0) to the other ranks: task 0 is named
    # after the list, as where the error came from, not as failed.
    "unhealthy, relayed by the leader": (HEARTBEATS.replace("task:1\nThe", "task:2\nThe") + (
        "\nAdditional GRPC error information from remote target /job:worker/replica:0/task:0 "
        "while calling /tensorflow.CoordinationService/PollForError"), (), {}, [2], None),
    "the coordination service's host is gone": (LEADER_GONE, ADDRESSES, {}, [0], None),
    "the coordination service's host is silent": (LEADER_SILENT, ADDRESSES, {}, [0], None),
    "a deadline of another call names none": (
        "DEADLINE_EXCEEDED: Deadline Exceeded while calling /tensorflow.WorkerService/RecvTensor",
        ADDRESSES, {}, [], None),
    "a peer refuses connections, named by address": (
        "UNAVAILABLE: failed to connect to all addresses; last error: ipv4 n10:20929: "
        "Connection refused", ADDRESSES, {}, [3], None),
    "a peer named by its IP and port": (
        "UNAVAILABLE: failed to connect to all addresses; last error: ipv4:10.77.9.10:20929: "
        "Connection refused", ADDRESSES, NODES, [3], None),
    "an address is a whole word": (
        "ipv4 n10:209290: Connection refused", ADDRESSES, {}, [], None),
    "a shape mismatch names no failed peer": (
        "Shape mismatch in the collective instance 100. Op at device ... expected shape [4]",
        ADDRESSES, {}, [], None),
    "an out-of-memory error of this rank names none": ("OOM when allocating tensor", (), {}, [],
                                                       None),
    # gloo names the peer's own socket: its host holds the candidates, this rank among them.
    "torch: a killed peer, by IP, under tfdist launch": (TORCH_KILLED, LOCAL, {}, [0, 1],
                                                         "127.0.0.1"),
    "torch: a killed peer, by IP, in an srun step": (TORCH_KILLED, SRUN, LOOPBACK, [0, 1],
                                                     "localhost"),
    "torch: a crashed peer, on another node": (
        TORCH_CRASHED.replace("127.0.0.1", "10.77.9.10"), ADDRESSES, NODES, [2, 3], "n10"),
    "torch: a peer on a host no rank has": (TORCH_CRASHED, ADDRESSES, {}, [], "127.0.0.1"),
    "torch: a stopped peer's timeout names none": (TORCH_TIMED_OUT, LOCAL, {}, [], None),
    "horovod: shut down names none": (HOROVOD_SHUT_DOWN, SRUN, {}, [], None),
    "horovod's log of a killed peer": (HOROVOD_LOG_KILLED, ("localhost",) * 2, LOOPBACK, [0, 1],
                                       "localhost"),
    "horovod's log of a stopped peer names none": (HOROVOD_LOG_STOPPED, SRUN, {}, [], None),
    "tfdist's heartbeat": (silent_message(1, 60), SRUN, {}, [1], None),
    "nccl: the watchdog names this rank, not the failed one": (NCCL_WATCHDOG, ADDRESSES, {}, [],
                                                               None),
    "nccl: the desync report": (NCCL_DESYNC, ADDRESSES, {}, [1], None),
    "nccl: ranks that never joined": (NCCL_NEVER_JOINED, ADDRESSES, {}, [2, 3], None),
    "nccl: a peer's socket closed": (NCCL_REMOTE, ADDRESSES, {}, [2, 3], "n10"),
}


@pytest.mark.parametrize("case", sorted(MESSAGES))
def test_failed_ranks(case):
    message, addresses, aliases, ranks, host = MESSAGES[case]
    assert failed_ranks(message, addresses, aliases) == ranks
    assert failed_host(message, addresses, aliases) == host


def test_the_failed_peers_hosts_leave_this_ranks_own_out():
    from tfdist.failures import failed_hosts

    on_n10 = ClusterEnvironment("slurm", rank=2, world_size=4, worker_addresses=ADDRESSES)
    assert failed_hosts(LEADER_SILENT, on_n10) == ["n9"]
    assert failed_hosts(HEARTBEATS, on_n10) == ["n9"]  # rank 1, on n9
    on_n9 = ClusterEnvironment("slurm", rank=1, world_size=4, worker_addresses=ADDRESSES)
    assert failed_hosts(HEARTBEATS, on_n9) == []  # rank 1 is this one
    assert failed_hosts("OOM when allocating tensor", on_n10) == []


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


def test_a_peer_named_by_host_is_the_one_rank_there_or_the_host():
    local = ClusterEnvironment("local", rank=0, world_size=2, worker_addresses=LOCAL)
    assert explain(TORCH_KILLED, local, {"step": 20}) == (
        "tfdist: rank 1 (host 127.0.0.1) failed or stopped responding (crashed, killed, out of "
        "memory, or hung); rank 0 stops here after step 20. Look at rank 1's own output first: "
        "it holds the cause, and the error above only follows from it.")
    crashed = TORCH_CRASHED.replace("127.0.0.1", "10.77.9.10")
    on_n9 = ClusterEnvironment("slurm", rank=0, world_size=4, worker_addresses=ADDRESSES)
    assert explain(crashed, on_n9, {"step": 3}, NODES) == (
        "tfdist: a rank on host n10 (rank 2 or 3) failed or stopped responding (crashed, killed, "
        "out of memory, or hung); rank 0 stops here after step 3. Look at the output of the ranks"
        " on host n10 first: it holds the cause, and the error above only follows from it (under "
        "srun: the files of --output=...%t... of those tasks).")
    # On n10 itself the other rank there is the one.
    on_n10 = ClusterEnvironment("slurm", rank=3, world_size=4, worker_addresses=ADDRESSES)
    assert explain(crashed, on_n10, None, NODES).startswith(
        "tfdist: rank 2 (host n10) failed or stopped responding")
    assert explain(TORCH_CRASHED, on_n9).startswith(
        "tfdist: a rank on host 127.0.0.1 failed or stopped responding")
    three_on_n10 = ClusterEnvironment("local", rank=0, world_size=4,
                                      worker_addresses=("n9:1", "n10:1", "n10:2", "n10:3"))
    assert explain(crashed, three_on_n10, None, NODES).startswith(
        "tfdist: a rank on host n10 (one of ranks 1, 2, 3) failed or stopped responding")


def test_an_error_that_names_no_peer_is_the_other_rank_of_two():
    # Horovod's, gloo's timeout, NCCL's watchdog: with 2 ranks the other one is the one.
    horovod = ClusterEnvironment("local", rank=0, world_size=2, num_nodes=1,
                                 launched_for="horovod")
    for message in (HOROVOD_SHUT_DOWN, TORCH_TIMED_OUT, NCCL_WATCHDOG):
        assert explain(message, horovod, {"epoch": 0, "step": 21}) == (
            "tfdist: rank 1 (host localhost) failed or stopped responding (crashed, killed, out "
            "of memory, or hung); rank 0 stops here after step 21 of epoch 1. Look at rank 1's "
            "own output first: it holds the cause, and the error above only follows from it.")
    on_n9 = ClusterEnvironment("slurm", rank=1, world_size=4, worker_addresses=ADDRESSES)
    assert explain(HOROVOD_SHUT_DOWN, on_n9) == (
        "tfdist: another rank failed or stopped responding (crashed, killed, out of memory, or "
        "hung); rank 1 stops here. The error above names none: look first at the rank whose "
        "output ends with an error of its own, or stops early; it holds the cause.")


# --- Real processes --------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    env = clean_env()
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **extra)
    return env


def _launch_and_signal(command: list[str], sig: signal.Signals, env: dict[str, str]
                       ) -> tuple[str, float, int | None]:
    """Runs a `tfdist launch -n 2` command; once rank 1 announces ``long-...: pid PID
    training``, sends it ``sig``. Returns the output, seconds from the signal until rank 0's
    tfdist line, and the launcher's exit code."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines, signalled, pid, took = [], None, None, float("nan")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"\[1\] long-\w+: pid (\d+) training", line)
            if found and pid is None:
                pid, signalled = int(found.group(1)), time.monotonic()
                os.kill(pid, sig)
            if "tfdist: rank 1 (host" in line:
                took = time.monotonic() - (signalled or time.monotonic())
                break
        lines.append(proc.stdout.read())  # the launcher's own lines, as it stops the workers
        proc.wait(timeout=120)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert pid is not None, "".join(lines)[-3000:]
    return "".join(lines), took, proc.returncode


def _step_and_signal(python: str, script: str, sig: signal.Signals, env: dict[str, str]
                     ) -> tuple[str, float, int | None]:
    """Starts ``script`` as the 2 tasks of a simulated srun step (no launcher that would stop
    the survivor); once rank 1 announces, sends it ``sig``. Returns rank 0's output, seconds
    from the signal until rank 0 exited, and rank 0's exit code."""
    port = port_block()
    procs = [subprocess.Popen([python, script], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**env, **_srun_step(rank, port)})
             for rank in (0, 1)]
    outputs: list[list[str]] = [[], []]
    announced = threading.Event()

    def pump(rank: int) -> None:
        assert procs[rank].stdout is not None
        for line in procs[rank].stdout:
            outputs[rank].append(line)
            if rank == 1 and re.search(r"long-\w+: pid \d+ training", line):
                announced.set()

    threads = [threading.Thread(target=pump, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    try:
        assert announced.wait(180), "".join(outputs[0] + outputs[1])[-3000:]
        os.kill(procs[1].pid, sig)
        signalled = time.monotonic()
        code = procs[0].wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    threads[0].join(10)
    return "".join(outputs[0]), took, code


def _srun_step(rank: int, port: int) -> dict[str, str]:
    """What srun exports to task `rank` of `srun -N1 -n2` (job 4242, step 0) on node localhost."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_GTIDS": "0,1", "SLURM_JOB_NUM_NODES": "1",
            "TFDIST_PORT_BASE": str(port)}


@pytest.mark.multiprocess
def test_a_hung_peer_is_named_by_the_others_within_a_bound():
    # Rank 1 is stopped (SIGSTOP: a hang, not a crash) in the middle of fit. Rank 0 must end
    # with TensorFlow's error and tfdist's line naming rank 1; measured from the stop. The
    # heartbeat timeout given reaches TensorFlow's coordination service (read back from its
    # config for the start line).
    output, took, code = _launch_and_signal(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--grace-period", "2",
         str(WORKERS / "long_fit_worker.py")], signal.SIGSTOP, _env(TFDIST_HEARTBEAT_TIMEOUT="6"))
    assert "a rank silent for 6 s is named" in output, output[-3000:]
    assert re.search(r"\[0\] tfdist: rank 1 \(host 127\.0\.0\.1\) failed or stopped responding"
                     r".*rank 0 stops here after step \d+ of epoch \d+", output), output[-3000:]
    print(f"rank 0 named the hung rank {took:.1f} s after the stop")
    assert took < 90, f"rank 0 noticed the hang after {took:.0f} s"
    assert code != 0


@needs_horovod
@pytest.mark.multiprocess
def test_a_killed_horovod_peer_is_named_by_the_others_at_once():
    # Rank 1 of a Horovod fit (Gloo, tfdist's rendezvous as under srun) is killed: rank 0 gets
    # "Horovod has been shut down" or, when the kill lands inside an all-reduce, Gloo's
    # "Connection closed by peer [127.0.0.1]:PORT" (a clean-clone run), neither naming a rank,
    # and tfdist's line after it.
    output, took, code = _step_and_signal(
        str(HVD_PY), str(WORKERS / "long_fit_worker.py"), signal.SIGKILL,
        _env(TFDIST_BACKEND="horovod", TF_USE_LEGACY_KERAS="0"))
    print(f"rank 0 exited {took:.1f} s after rank 1 was killed")
    assert "Horovod has been shut down" in output or "Connection closed by peer" in output, \
        output[-3000:]
    assert re.search(r"^tfdist: rank 1 \(host localhost\) failed or stopped responding .*rank 0 "
                     r"stops here after step \d+ of epoch 1\.", output, re.M), output[-3000:]
    assert code != 0
    assert took < 90, f"rank 0 exited {took:.0f} s after rank 1 was killed"


@needs_horovod
@pytest.mark.multiprocess
def test_a_stopped_horovod_peer_is_named_by_the_heartbeat():
    # Without the heartbeat Gloo waits HOROVOD_GLOO_TIMEOUT_SECONDS (120 s) and then names no
    # rank. Rank 1 of a Horovod fit in an srun step (tfdist's rendezvous server in rank 0) is
    # stopped: rank 0's heartbeat, kept on that server, names it after TFDIST_HEARTBEAT_TIMEOUT
    # (8 s here; 30 s by default).
    output, took, code = _step_and_signal(
        str(HVD_PY), str(WORKERS / "long_fit_worker.py"), signal.SIGSTOP,
        _env(TFDIST_BACKEND="horovod", TF_USE_LEGACY_KERAS="0", TFDIST_HEARTBEAT_TIMEOUT="8"))
    print(f"rank 0 named the stopped rank {took:.1f} s after the stop")
    assert "tfdist: rank 1 sent no heartbeat for" in output, output[-3000:]
    assert re.search(r"^tfdist: rank 1 \(host localhost\) failed or stopped responding", output,
                     re.M), output[-3000:]
    assert code != 0
    assert took < 30, f"rank 0 noticed the stop after {took:.0f} s"


@needs_torch
@pytest.mark.multiprocess
def test_a_killed_torch_peer_is_named_by_the_others_at_once():
    # gloo names the peer's socket, 127.0.0.1:<its port>: the other rank on that host.
    output, took, code = _step_and_signal(
        sys.executable, str(WORKERS / "long_torch_worker.py"), signal.SIGKILL,
        _env(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    print(f"rank 0 exited {took:.1f} s after rank 1 was killed")
    assert re.search(r"Connection (reset|closed) by peer", output), output[-3000:]
    assert re.search(r"^tfdist: rank 1 \(host localhost\) failed or stopped responding .*rank 0 "
                     r"stops here after step \d+\.", output, re.M), output[-3000:]
    assert code != 0
    assert took < 90, f"rank 0 exited {took:.0f} s after rank 1 was killed"


@needs_torch
@pytest.mark.multiprocess
def test_a_stopped_torch_peer_is_named_by_the_heartbeat():
    # Without the heartbeat gloo waits the whole collective timeout (600 s by default). With a
    # 20 s timeout the heartbeat declares rank 1 stopped after 10 s of silence (30 s by default).
    output, took, code = _launch_and_signal(
        [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--grace-period", "2",
         str(WORKERS / "long_torch_worker.py")], signal.SIGSTOP,
        _env(CUDA_VISIBLE_DEVICES="", TFDIST_TORCH_TIMEOUT="20"))
    print(f"rank 0 named the stopped rank {took:.1f} s after the stop")
    assert "[0] tfdist: rank 1 sent no heartbeat for 1" in output, output[-3000:]
    assert "rank 0 was waiting here" in output and "backward" in output, output[-3000:]
    assert re.search(r"\[0\] tfdist: rank 1 \(host 127\.0\.0\.1\) failed or stopped responding"
                     r".*rank 0 stops here after step \d+\.", output), output[-3000:]
    assert "tfdist launch: worker 0 exited with code 1" in output, output[-3000:]
    assert code != 0
    assert took < 30, f"rank 0 noticed the stop after {took:.0f} s"


def test_a_rank_that_was_stopped_and_continued_blames_itself_not_its_peers():
    # What a stopped srun task prints when the step continues it (SIGCONT) before killing it.
    from tfdist.failures import continued_line

    assert continued_line(1, 2.4) == (
        "tfdist: rank 1 was stopped (SIGSTOP, a debugger, or a frozen node) and continued 2 s "
        "ago; the other ranks gave up on it meanwhile, so the error above follows from this "
        "rank's own stop, not from theirs.")
    assert continued_line(1, 600) is None


FROZEN = {
    # name: (SIGCONT handled at, the ticker ran again after a gap at, its last turn; the rank
    #        was stopped?) (now: 100.5)
    "stopped, then continued": (100.0, 99.5, 100.4, True),
    "the ticker woke just after the handler ran": (100.0, 100.2, 100.4, True),
    "the ticker has had no turn since the stop": (100.0, None, 80.0, True),
    "continued, never stopped (srun ending the step after a peer's SIGKILL)": (
        100.0, None, 100.3, False),
    "stopped long ago, continued now": (100.0, 100.0 - 61, 100.3, False),
    "never continued": (None, 99.5, 80.0, False),
    "a freeze long after the continue": (100.0, 110.0, 110.2, False),
    "no ticker": (100.0, None, None, False),
}


@pytest.mark.parametrize("case", sorted(FROZEN))
def test_only_a_rank_that_did_not_run_is_taken_for_stopped(case):
    from tfdist.failures import was_frozen

    continued, frozen, last_tick, stopped = FROZEN[case]
    assert was_frozen(continued, frozen, last_tick, 100.5) is stopped


_TICKING = ("import time, threading\n"
            "from tfdist import failures\n"
            "failures.FROZEN_GAP_S = 1.0\n"
            "threading.Thread(target=failures._tick, daemon=True).start()\n"
            "print('ticking', flush=True)\n"
            "time.sleep(4)\n"
            "print('frozen' if failures._frozen_at else 'ran', flush=True)\n")


def test_the_ticker_notes_a_stop_of_its_process_and_nothing_else():
    # Two processes run tfdist's ticker; one is stopped for 2 s (SIGSTOP, SIGCONT), the other,
    # the control, only gets a SIGCONT, as srun's end of a step sends every task.
    children = [subprocess.Popen([sys.executable, "-c", _TICKING], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, env=clean_env()) for _ in range(2)]
    stopped, control = children
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ticking"
    os.kill(stopped.pid, signal.SIGSTOP)
    time.sleep(2)
    os.kill(stopped.pid, signal.SIGCONT)
    os.kill(control.pid, signal.SIGCONT)
    assert [child.communicate(timeout=30)[0].strip() for child in children] == ["frozen", "ran"]


@pytest.mark.multiprocess
def test_a_killed_worker_under_tfdist_launch_ends_the_run_and_is_no_preemption(tmp_path):
    # Rank 1 of a 2-worker fit with the preemption callbacks sends itself SIGKILL at step 20.
    # The launcher names it and stops rank 0 (SIGTERM, which rank 0 records as a preemption
    # request): the run must still end as a failure, without a preempted state or exit 75.
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    model_dir = tmp_path / "model"
    done = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2",
                           "--grace-period", "15", str(WORKERS / "fault_fit_worker.py"), "kill",
                           "1", str(model_dir)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    out = done.stdout + done.stderr
    ended = time.time()
    fault = re.search(r"fault-fit: rank 1 kill at (\S+)", out)
    assert fault, out[-3000:]
    took = ended - float(fault.group(1))
    print(f"the launcher ended {took:.1f} s after the kill")
    assert "tfdist launch: worker 1 was killed by signal 9" in out, out[-3000:]
    assert done.returncode not in (0, 75), out[-3000:]
    assert not (model_dir / "preempted").exists()
    assert took < 60, took
