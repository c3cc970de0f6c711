"""A collective that waited too long for the other ranks: one tfdist line after TensorFlow's error.

The coordination service's heartbeat catches a peer that dies or is stopped
(:mod:`tfdist.failures`). A peer that is alive and heartbeating but never enters the next
collective (stuck in its input pipeline or in Python code, or running fewer steps) leaves every
other rank waiting forever. With ``TFDIST_COLLECTIVE_TIMEOUT=T``, tfdist gives
MultiWorkerMirroredStrategy ``CommunicationOptions(timeout_seconds=T)``: every collective the
strategy launches (the gradient all-reduce inside ``fit`` too, in graph and eager mode) fails
with ``DeadlineExceededError`` once it has waited ``T`` s. The variables' initial broadcast has
no timeout (TensorFlow passes none), so ranks that reach the model at different times still
meet there.

:func:`explain` recognises TensorFlow's messages (pure, tested on text from real runs) and says
what they mean: on the ranks that waited, that another one stopped entering the collectives; on
a rank that arrives after a peer gave up on it, that it was the one away. :func:`install` prints
that line after the traceback of an uncaught error.

Only the ranks' meeting is bounded, so ``T`` must exceed the longest time one rank may
legitimately work while the others wait at the next collective: the chief saving a checkpoint
alone, a trace or compile that takes longer on one rank. The timeout costs a timer per collective
(about 0.3 ms on a CPU loopback all-reduce of 1.5 ms); it is off unless set.
"""

from __future__ import annotations

import re
import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tfdist import failures, patches

if TYPE_CHECKING:
    from tfdist.env import ClusterEnvironment
    from tfdist.patches import Where

__all__ = ["TIMED_OUT", "crashed", "explain", "install", "install_timeout_line", "timed_out"]

# TensorFlow's messages (base_collective_executor.cc): while the collective ran, and while its
# group or instance was being resolved (the first collective of a group).
TIMED_OUT = ("Collective has timed out during execution",
             "Collective has timed out waiting for other workers")

_REMOTE_TASK = re.compile(r"remote target /job:worker/(?:replica:\d+/)?task:(\d+)")

_seconds: list[float] = []  # the installed timeout; the hook is installed once per process


def timed_out(message: str) -> bool:
    """Whether an error message is a collective's timeout."""
    return any(text in message for text in TIMED_OUT)


def explain(message: str, environment: ClusterEnvironment, seconds: float,
            where: dict[str, int] | None = None) -> str | None:
    """The line tfdist prints for a collective's timeout, or None for any other error.

    Two cases. This rank's own collective timed out: one of the others stopped entering the
    collectives. Or a peer's timed out while waiting for this rank, and this rank, arriving late,
    gets the peer's abort back ("Collective ops is aborted by: ... Collective has timed out",
    naming the peer as the "remote target"): this rank was the one away.

    Args:
        message: the text of the error.
        environment: this process's launch (its rank, how it was launched).
        seconds: the timeout (``TFDIST_COLLECTIVE_TIMEOUT``).
        where: ``{"epoch": E, "step": S}`` (0-based epoch, steps done in it), when known.
    """
    found = [message.find(text) for text in TIMED_OUT if text in message]
    if not found:
        return None
    at = (f" after step {where['step']} of epoch {where['epoch'] + 1}"
          if where and "step" in where and "epoch" in where else "")
    rank = environment.rank
    legitimate = ("(the chief saving a checkpoint, a first trace or compile), raise "
                  "TFDIST_COLLECTIVE_TIMEOUT.")
    if "aborted by" in message[:min(found)]:
        peer = _REMOTE_TASK.search(message)
        who = f"rank {peer.group(1)}" if peer else "another rank"
        return (f"tfdist: {who} gave up waiting for rank {rank} in a collective after "
                f"{seconds:g} s (TFDIST_COLLECTIVE_TIMEOUT): rank {rank} was away from the "
                f"collectives longer than that, and stops here{at}. What it did before this "
                "error is the cause: a hang in its input pipeline or code, slow work of its own, "
                "or a different number of steps. If that work is legitimate " + legitimate)
    output = (" (under srun: the other tasks' files of --output=...%t...)"
              if environment.facts.output_per_task else "")
    return (f"tfdist: a collective waited more than {seconds:g} s (TFDIST_COLLECTIVE_TIMEOUT) "
            f"for the other ranks, and rank {rank} stops here{at}. One of the others is alive "
            "but stopped training (a hang in its input pipeline or code, slow work of its own, "
            "or a different number of steps): it is the rank without this line, and its output "
            f"shows where{output}. If a rank legitimately works alone that long " + legitimate)


def crashed(output: str, rank: int, seconds: float | None) -> str | None:
    """What ``tfdist launch`` says for worker ``rank``, killed by a signal, when its ``output``
    shows that a collective of its timed out first; None otherwise (pure).

    TensorFlow sometimes crashes (SIGSEGV) while it aborts the timed-out collective, before the
    error reaches Python, so the worker's own line (:func:`explain`) is never printed: seen with
    TensorFlow 2.21 in about one run of four on a loaded 2-core machine.
    """
    line = next((text for text in output.splitlines() if timed_out(text)), None)
    if line is None:
        return None
    limit = f"{seconds:g} s" if seconds else "its timeout"
    crash = ("TensorFlow crashed while aborting it, before the worker could print tfdist's "
             "line")
    first = min(line.find(text) for text in TIMED_OUT if text in line)
    if "aborted by" in line[:first]:  # a peer's timeout, sent back to this late rank
        peer = _REMOTE_TASK.search(output)
        who = f"rank {peer.group(1)}" if peer else "another rank"
        return (f"{who} gave up waiting for rank {rank} in a collective after {limit} "
                f"(TFDIST_COLLECTIVE_TIMEOUT), and {crash}: rank {rank} was away from the "
                "collectives longer than that, and what it did before is the cause.")
    return (f"a collective of rank {rank} waited more than {limit} (TFDIST_COLLECTIVE_TIMEOUT) "
            f"for the other ranks, and {crash}. One of the others is alive but stopped "
            "training (a hang in its input pipeline or code, slow work of its own, or a "
            "different number of steps): its output shows where. If a rank legitimately works "
            "alone that long, raise TFDIST_COLLECTIVE_TIMEOUT.")


def install_timeout_line(where: Where, dist: Any) -> None:
    """Patch ``timeout-line``'s installer (:func:`tfdist.patches.install`)."""
    if where.collective_timeout is not None:
        install(dist.environment, where.collective_timeout)


def install(environment: ClusterEnvironment, seconds: float) -> None:
    """Adds the line to uncaught errors of this process (``sys.excepthook``), once.

    Wraps the hook in place (e.g. :func:`tfdist.failures.install`'s), so both lines can print.
    A second call only updates ``seconds``.
    """
    installed = bool(_seconds)
    _seconds[:] = [seconds]
    if installed:
        return
    def wrap(previous: Any) -> Any:
        def hook(kind: type[BaseException], value: BaseException,
                 traceback: TracebackType | None) -> None:
            previous(kind, value, traceback)
            line = explain(str(value), environment, _seconds[0], failures.progress)
            if line:
                print(line, file=sys.stderr, flush=True)

        return hook

    patches.apply("timeout-line", sys, "excepthook", wrap)
