"""A peer's host that stops answering, named in seconds: MWMS workers on several nodes.

A node that dies or whose network is cut gives no error: TensorFlow's coordination service
names its ranks once they miss heartbeats for ``TFDIST_HEARTBEAT_TIMEOUT`` (30 s), a bound
that must also cover a live rank busy in a long step. A dead host is told apart from a busy
process sooner by its kernel: a live node accepts a TCP connection to the rank's gRPC port
whatever the process is doing (the kernel completes it), a process that ended refuses it at
once, and a node that is gone does not answer at all. So a thread per rank connects to the
next rank's port (a ring: each rank is watched by one other) every :data:`INTERVAL_S`; when
no connection was made for ``TFDIST_PEER_WATCH`` seconds (connections that time out, not
refused ones: a peer that finished first closes its port), the rank prints the
:mod:`tfdist.failures` line naming that rank and its host, and ends its process (exit code 1:
its main thread may be blocked inside a collective). Under ``tfdist survive`` the step then
ends at once and the lost node is probed; the other ranks' collectives fail as this one exits.

Only peers on other hosts are watched (on one node nothing is cut apart from the rest).
:func:`watched` and :func:`overdue` are pure and table-tested.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from tfdist import failures
from tfdist.env import ClusterEnvironment

__all__ = ["INTERVAL_S", "overdue", "silent_host_message", "start", "watched"]

INTERVAL_S = 1.0  # one connection attempt a second, each waiting at most this long
_CONNECT_TIMEOUT_S = 2.0


def watched(environment: ClusterEnvironment) -> tuple[int, str, int] | None:
    """The rank this one watches (the next in a ring), its host and port, when it runs on
    another host; else None (pure)."""
    addresses, size, rank = environment.worker_addresses, environment.world_size, \
        environment.rank
    if size < 2 or len(addresses) != size:
        return None
    peer = (rank + 1) % size
    host, _, port = addresses[peer].rpartition(":")
    mine = addresses[rank].rpartition(":")[0]
    if not host or not port.isdigit() or host == mine:
        return None
    return peer, host, int(port)


def overdue(last_answer: float, now: float, limit: float) -> bool:
    """Whether a peer whose host last answered at ``last_answer`` has been silent too long
    (pure)."""
    return now - last_answer >= limit


def silent_host_message(rank: int, address: str, seconds: float) -> str:
    """What this rank reports for a peer whose host stopped answering (:mod:`tfdist.failures`
    reads the rank from it)."""
    return (f"rank {rank} sent no heartbeat: its host stopped answering (no TCP connection to "
            f"{address} for {seconds:.0f} s)")


def start(environment: ClusterEnvironment, limit: float | None) -> threading.Thread | None:
    """Starts the watch of the next rank's host (a daemon thread), where there is one to
    watch and ``limit`` (seconds, ``TFDIST_PEER_WATCH``) is set."""
    peer = watched(environment)
    if peer is None or not limit:
        return None
    thread = threading.Thread(target=_watch, args=(environment, *peer, limit),
                              name="tfdist-peer-watch", daemon=True)
    thread.start()
    return thread


def _watch(environment: ClusterEnvironment, peer: int, host: str, port: int,
           limit: float) -> None:
    last = time.monotonic()
    while True:
        started = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S):
                last = time.monotonic()
        except ConnectionRefusedError:
            last = time.monotonic()  # the host answered: the process is gone (or not up yet)
        except OSError:
            pass  # no answer in time, no route: the host is silent
        if overdue(last, time.monotonic(), limit):
            _declare(environment, peer, f"{host}:{port}", time.monotonic() - last)
            return
        time.sleep(max(0.0, INTERVAL_S - (time.monotonic() - started)))


def _declare(environment: ClusterEnvironment, peer: int, address: str, seconds: float) -> None:
    """Names the silent peer and ends this process (exit code 1)."""
    message = silent_host_message(peer, address, seconds)
    sys.stdout.flush()
    line = failures.report(message, environment) or ""
    print(f"tfdist: {message}\n{line}", file=sys.stderr, flush=True)
    failures.requeue_if_orphaned(message)
    failures.linger(environment)
    os._exit(1)
