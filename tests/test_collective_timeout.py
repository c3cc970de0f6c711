"""TFDIST_COLLECTIVE_TIMEOUT: a rank alive but stuck ends the others' wait, with a tfdist line.

The messages are TensorFlow's, copied from real 2-worker MWMS runs under ``tfdist launch`` with
the timeout set: a Keras 3 ``fit`` whose rank 1 slept in a callback (the gradient all-reduce
timed out), an eager all-reduce at an epoch's end while the chief worked alone, the first
all-reduce of a group (``dist.sum_over_ranks``) while rank 1 had not arrived, and the late
chief's own error once its peer had given up on it. Then real runs: rank 1 of a fit sleeps far
longer than the timeout, and rank 0 must exit with the line; without the timeout the same run
must still be waiting.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import ROOT, WORKERS, clean_env

from tfdist import timeouts
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError
from tfdist.settings import resolve

FIT_GRAPH = (
    "Graph execution error:\n\nDetected at node adam/CollectiveReduceV2 defined at (most recent "
    "call last):\n  File \"/tmp/train.py\", line 49, in <module>\n\n  File \"/venv/lib/python3.11/"
    "site-packages/keras/src/backend/tensorflow/trainer.py\", line 134, in one_step_on_data\n\n"
    "Collective has timed out during execution.\n\t [[{{node adam/CollectiveReduceV2}}]] "
    "[Op:__inference_multi_step_on_iterator_687]")
EAGER = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/"
    "replica:0/task:1/device:CPU:0}} Collective has timed out during execution. "
    "[Op:CollectiveReduceV2] name: ")
GROUP = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call "
    "last):\n  File \"/work/main/tfdist/backends/mwms.py\", line 89, in sum_values\n\n"
    "Collective has timed out waiting for other workers.\n\t [[{{node CollectiveReduceV2}}]] "
    "[Op:__inference_sum_values_33]")
LATE = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/"
    "replica:0/task:0/device:CPU:0}} Collective ops is aborted by: Collective ops is aborted by: "
    "Collective has timed out during execution.\nThe error could be from a previous operation. "
    "Restart your program to reset.\nAdditional GRPC error information from remote target "
    "/job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:\n:UNKNOWN:"
    "Error received from peer  {grpc_status:4, grpc_message:\"Collective ops is aborted by: "
    "Collective has timed out during execution.\\nThe error could be from a previous operation."
    " Restart your program to reset.\"}\nThe error could be from a previous operation. Restart "
    "your program to reset. [Op:CollectiveReduceV2] name: ")
HEARTBEATS = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks "
    "are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have "
    "crashed.")

WAITED = ("tfdist: a collective waited more than 5 s (TFDIST_COLLECTIVE_TIMEOUT) for the other "
          "ranks, and rank 0 stops here{at}. One of the others is alive but stopped training (a "
          "hang in its input pipeline or code, slow work of its own, or a different number of "
          "steps): it is the rank without this line, and its output shows where{srun}. If a rank "
          "legitimately works alone that long (the chief saving a checkpoint, a first trace or "
          "compile), raise TFDIST_COLLECTIVE_TIMEOUT.")
AWAY = ("tfdist: {who} gave up waiting for rank 0 in a collective after 5 s "
        "(TFDIST_COLLECTIVE_TIMEOUT): rank 0 was away from the collectives longer than that, and "
        "stops here after step 30 of epoch 1. What it did before this error is the cause: a hang "
        "in its input pipeline or code, slow work of its own, or a different number of steps. If "
        "that work is legitimate (the chief saving a checkpoint, a first trace or compile), raise "
        "TFDIST_COLLECTIVE_TIMEOUT.")
SRUN = " (under srun: the other tasks' files of --output=...%t...)"
LOCAL = ClusterEnvironment("tf_config", rank=0, world_size=2)
SLURM = ClusterEnvironment("slurm", rank=0, world_size=2)
AT = {"epoch": 0, "step": 30}

CASES = {
    # name: (message, environment, progress, line)
    "fit's gradient all-reduce": (FIT_GRAPH, LOCAL, AT,
                                  WAITED.format(at=" after step 30 of epoch 1", srun="")),
    "an eager all-reduce, under srun": (EAGER, SLURM, AT,
                                        WAITED.format(at=" after step 30 of epoch 1", srun=SRUN)),
    "a group's first collective, before fit": (GROUP, LOCAL, {}, WAITED.format(at="", srun="")),
    "the late rank gets its peer's abort": (LATE, LOCAL, AT, AWAY.format(who="rank 1")),
    "a late rank whose peer is not named": (LATE.split("\nAdditional")[0], LOCAL, AT,
                                            AWAY.format(who="another rank")),
    "a dead peer is tfdist.failures' case": (HEARTBEATS, LOCAL, AT, None),
    "tfdist's own bounded gather": ("not every rank reached it within 60 s", LOCAL, AT, None),
    "an out-of-memory error": ("OOM when allocating tensor with shape[4096,4096]", LOCAL, AT,
                               None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_line_for_each_message(case):
    message, environment, where, line = CASES[case]
    assert timeouts.explain(message, environment, 5.0, where) == line
    assert timeouts.timed_out(message) == (line is not None)


def test_the_hook_prints_after_the_previous_one_once(monkeypatch):
    printed: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append("traceback"))
    monkeypatch.setattr(timeouts, "_seconds", [])
    monkeypatch.setattr(timeouts.failures, "progress", {"epoch": 0, "step": 30})
    timeouts.install(LOCAL, 9.0)
    timeouts.install(LOCAL, 5.0)  # updates the timeout, wraps nothing twice
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        sys.excepthook(RuntimeError, RuntimeError(FIT_GRAPH), None)
        sys.excepthook(RuntimeError, RuntimeError("something else"), None)
    assert printed == ["traceback", "traceback"]
    assert stderr.getvalue() == WAITED.format(at=" after step 30 of epoch 1", srun="") + "\n"


# The last lines of a worker that TensorFlow crashed (SIGSEGV) while aborting its timed-out
# all-reduce (TensorFlow 2.21, Keras 3 fit, under tfdist launch; timestamps shortened).
CRASHED_OUTPUT = (
    "stall: rank 0 pid 17822\n"
    "E0000 00:00:1795490167.468007   18741 base_collective_executor.cc:252] "
    "BaseCollectiveExecutor::StartAbort DEADLINE_EXCEEDED: Collective has timed out during "
    "execution.\n"
    "E0000 00:00:1795490167.468087   18741 ring_alg.cc:291] Aborting RingReduce with "
    "DEADLINE_EXCEEDED: Collective ops is aborted by: Collective has timed out during "
    "execution.\n"
    "[mutex.cc : 452] RAW: Lock blocking 0x56502b0053e0   @ 0x7f67408e334c 0x7f67408e296f\n")


def test_a_worker_crashed_after_its_timeout_is_explained_by_the_launcher():
    said = timeouts.crashed(CRASHED_OUTPUT, 0, 5.0)
    assert said is not None and said.startswith(
        "a collective of rank 0 waited more than 5 s (TFDIST_COLLECTIVE_TIMEOUT) for the other "
        "ranks, and TensorFlow crashed while aborting it"), said
    assert "raise TFDIST_COLLECTIVE_TIMEOUT" in said
    # The late rank: the peer's abort came back to it, and TensorFlow crashed there.
    late = ("E0000 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort "
            "DEADLINE_EXCEEDED: Collective ops is aborted by: Collective has timed out during "
            "execution.\nAdditional GRPC error information from remote target "
            "/job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:\n")
    assert timeouts.crashed(late, 0, 5.0).startswith(
        "rank 1 gave up waiting for rank 0 in a collective after 5 s")
    # Any other death by a signal: nothing to add to the launcher's own line.
    assert timeouts.crashed("stall: rank 0 pid 1\nSegmentation fault\n", 0, 5.0) is None
    assert timeouts.crashed(CRASHED_OUTPUT, 0, None).startswith(
        "a collective of rank 0 waited more than its timeout")


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),  # off: wait forever, as TensorFlow does
    ({"TFDIST_COLLECTIVE_TIMEOUT": "300"}, 300.0),
    ({"TFDIST_COLLECTIVE_TIMEOUT": "2.5"}, 2.5),
])
def test_the_setting(environ, expected):
    assert resolve("collective_timeout", None, environ) == expected
    assert resolve("collective_timeout", 7, environ) == 7.0  # an argument wins


@pytest.mark.parametrize("text", ["0", "-5", "soon"])
def test_the_setting_rejects(text):
    with pytest.raises(ConfigError, match="TFDIST_COLLECTIVE_TIMEOUT"):
        resolve("collective_timeout", None, {"TFDIST_COLLECTIVE_TIMEOUT": text})


# --- real runs -------------------------------------------------------------------------------

TIMEOUT_S = 5
_LINE = re.compile(r"\[0\] tfdist: a collective waited more than 5 s \(TFDIST_COLLECTIVE_TIMEOUT\)"
                   r" for the other ranks, and rank 0 stops here after step \d+ of epoch 1\. ")
# When TensorFlow crashes while aborting the collective (see CRASHED_OUTPUT), the launcher says it.
_CRASH_LINE = re.compile(r"^tfdist launch: worker 0: a collective of rank 0 waited more than 5 s "
                         r"\(TFDIST_COLLECTIVE_TIMEOUT\) for the other ranks, and TensorFlow "
                         r"crashed while aborting it", re.M)


class _Run:
    """``tfdist launch -n 2 stall_worker.py`` in the background, its output read by a thread."""

    def __init__(self, timeout: int | None) -> None:
        env = clean_env()
        env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        if timeout is not None:
            env["TFDIST_COLLECTIVE_TIMEOUT"] = str(timeout)
        self.lines: list[str] = []
        self.pids: list[int] = []
        self.stalled = threading.Event()
        self.stalled_at = self.line_at = 0.0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfdist", "launch", "-n", "2", "--grace-period", "1",
             str(WORKERS / "stall_worker.py"), "--sleep", "300"],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if found := re.search(r"stall: rank \d pid (\d+)", line):
                self.pids.append(int(found.group(1)))
            if "stall: rank 1 stops training" in line:
                self.stalled_at = time.monotonic()
                self.stalled.set()
            if (_LINE.search(line) or _CRASH_LINE.search(line)) and not self.line_at:
                self.line_at = time.monotonic()

    @property
    def output(self) -> str:
        return "".join(self.lines)[-4000:]

    def stop(self) -> None:
        """SIGTERM to the launcher stops its workers; SIGKILL whatever is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()
        self._reader.join(5)


@pytest.mark.multiprocess
def test_a_rank_that_stops_entering_collectives_ends_the_others_wait_only_with_the_timeout():
    # Both runs at once (two cores): with the timeout, rank 0 must exit non-zero with tfdist's
    # line some 5 s after rank 1 stopped; without it, the same run must still be waiting 20 s
    # later (the heartbeat does not notice a rank that is alive).
    control, timed = _Run(None), _Run(TIMEOUT_S)
    try:
        assert timed.stalled.wait(120), timed.output
        timed.proc.wait(timeout=60)
        assert control.stalled.wait(60), control.output
        time.sleep(max(0.0, control.stalled_at + 20 - time.monotonic()))
        assert control.proc.poll() is None, f"the control run ended:\n{control.output}"
    finally:
        timed.stop()
        control.stop()
    assert timed.line_at, f"no tfdist line from rank 0:\n{timed.output}"
    took = timed.line_at - timed.stalled_at
    print(f"rank 0 gave up {took:.1f} s after rank 1 stopped")
    assert TIMEOUT_S - 1 < took < 60, timed.output
    # Rank 0's own line and exit, or (TensorFlow crashed aborting the collective) the launcher's
    if _CRASH_LINE.search("".join(timed.lines)):
        print("TensorFlow crashed while aborting the timed-out collective; the launcher said so")
        assert "tfdist launch: worker 0 was killed by signal" in timed.output, timed.output
    else:
        assert "tfdist launch: worker 0 exited with code 1" in timed.output, timed.output
    assert timed.proc.returncode != 0
    # The control gave up nowhere (tfdist's start-up and batch lines it does print)
    assert not [line for line in control.lines if _LINE.search(line) or _CRASH_LINE.search(line)
                or "waited more than" in line], control.output
