"""When a peer dies or hangs: which rank it was, said in one line next to TensorFlow's error.

A rank that crashes, is killed or stops responding shows up on every other rank as TensorFlow's
own error, far from the cause: "Collective ops is aborted by: ... The following tasks are
unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1", or a gRPC "Connection
refused" to the coordination service. :func:`failed_ranks` reads the ranks out of that text
(pure, tested on messages taken from real runs); :func:`explain` turns them into the line
tfdist prints after the traceback, with the host, the step this rank stopped at, and where to
look first: the failed rank's own output, which holds the cause.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tfdist.env import ClusterEnvironment

__all__ = ["explain", "failed_ranks", "install", "progress"]

_TASK = re.compile(r"/job:worker/(?:replica:\d+/)?task:(\d+)")
_REMOTE = re.compile(r"remote target (/job:worker/(?:replica:\d+/)?task:\d+)")
_UNREACHABLE = ("Connection refused", "failed to connect", "Socket closed", "Connection reset")

# Where training was, kept up to date by tfdist's fit callbacks: {"epoch": E, "step": S}.
progress: dict[str, int] = {}


def failed_ranks(message: str, addresses: Sequence[str] = ()) -> list[int]:
    """The ranks an error message names as failed, or [] when it names none.

    Args:
        message: the text of TensorFlow's error.
        addresses: every rank's worker address (``host:port``), to recognise a peer named by
            address in a connection error.
    """
    if "unhealthy" in message:  # the coordination service: missed heartbeats
        return sorted({int(task) for task in _TASK.findall(message.split("unhealthy", 1)[1])})
    if any(words in message for words in _UNREACHABLE):
        remote = _REMOTE.search(message)  # the service's host, from a heartbeat that failed
        if remote:
            return [int(_TASK.findall(remote.group(1))[0])]
        return [rank for rank, address in enumerate(addresses) if address in message]
    return []


def explain(message: str, environment: ClusterEnvironment,
            where: dict[str, int] | None = None) -> str | None:
    """The line tfdist prints for an error that names failed peers, or None.

    Args:
        message: the text of the error.
        environment: this process's launch (rank, hosts, addresses).
        where: ``{"epoch": E, "step": S}`` (0-based epoch, steps done in it), when known.
    """
    ranks = [r for r in failed_ranks(message, environment.worker_addresses)
             if r != environment.rank and r < environment.world_size]
    if not ranks:
        return None
    names = ", ".join(f"rank {r} ({_host(environment, r)})" for r in ranks)
    at = (f" after step {where['step']} of epoch {where['epoch'] + 1}"
          if where and "step" in where and "epoch" in where else "")
    first = ranks[0]
    return (f"tfdist: {names} failed or stopped responding (crashed, killed, out of memory, or "
            f"hung); rank {environment.rank} stops here{at}. Look at rank {first}'s own output "
            f"first: it holds the cause, and the error above only follows from it"
            + (f" (under srun: the task {first} file of --output=...%t...)"
               if environment.launcher == "slurm" else "") + ".")


def _host(environment: ClusterEnvironment, rank: int) -> str:
    if rank < len(environment.worker_addresses):
        return f"host {environment.worker_addresses[rank].rsplit(':', 1)[0]}"
    return "host unknown"


def install(environment: ClusterEnvironment) -> None:
    """Adds the line to uncaught errors of this process (``sys.excepthook``), once."""
    previous = sys.excepthook
    if getattr(previous, "_tfdist", False):
        return

    def hook(kind: type[BaseException], value: BaseException,
             traceback: TracebackType | None) -> None:
        previous(kind, value, traceback)
        line = explain(str(value), environment, progress)
        if line:
            print(line, file=sys.stderr, flush=True)

    hook._tfdist = True  # type: ignore[attr-defined]
    sys.excepthook = hook
