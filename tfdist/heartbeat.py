"""A heartbeat between the ranks, over a key-value store they share: a stopped peer is named
within :data:`LIMIT_CAP_S` (``TFDIST_HEARTBEAT_TIMEOUT``), not after the collective timeout.

gloo, NCCL and Horovod's Gloo wait for a peer that stopped (SIGSTOP, a frozen node, a cut
network) until their collective timeout (``TFDIST_TORCH_TIMEOUT``, 600 s by default;
``HOROVOD_GLOO_TIMEOUT_SECONDS``, 120 s), and then say only "Timed out waiting 600000ms for recv
operation to complete". A shorter collective timeout would also fail healthy jobs whose ranks
wait at a collective on purpose (the chief saving a checkpoint or evaluating alone). A thread per
rank tells the two apart: it beats every few seconds whatever the main thread does, so a rank
that is alive but busy keeps beating; only a rank whose whole process stopped, or that the
network cut off, goes silent.

The stores: the torch process group's own TCPStore (:mod:`tfdist.torch.heartbeat`), and the HTTP
key-value server of Horovod's Gloo rendezvous (:mod:`tfdist.horovod.heartbeat`).

How: every ``interval`` each rank adds 1 to ``tfdist/heartbeat/<rank>`` in the store and reads
the next rank's counter (a ring: three small requests per beat, whatever the world size). When
that counter has not moved for ``limit`` seconds the rank writes the verdict (``tfdist/silent``)
for the others, prints the silent rank, where its own main thread waits and the
:mod:`tfdist.failures` line, and ends its process with exit code 1: the main thread is blocked
inside the collective, where no Python exception can reach it. With more than two ranks it first
waits two beats, so that every rank reads the verdict and names the same rank.

The store may be served by rank 0's process (torch's ``tcp://`` rendezvous, Horovod under srun):
when it stops answering for ``limit`` seconds, rank 0 is the silent one (a second thread watches
the first, whose store calls then block). Where a launcher serves it (torchrun's agent,
horovodrun, ``tfdist launch``) a store that stops answering ends the watch with a warning, since
training does not need it. A rank that leaves (:func:`stop`) marks its counter, and its watcher
stops watching it. A store whose process exited ends the watch silently (the collective's own
error reports a crash, and rank 0 may simply have finished first): for torch's TCPStore an idle
plain connection to the store's port reads as closed then, checked before every beat, since
torch logs a failed store request with its C++ stack; a request to a store that is gone fails.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any

from tfdist import failures
from tfdist.env import ClusterEnvironment

__all__ = ["Heartbeat", "limit_for", "start", "stop"]

logger = logging.getLogger("tfdist")

LIMIT_CAP_S = 30.0  # a live process beats every 3 s; ten beats missed are no pause
# (TFDIST_HEARTBEAT_TIMEOUT's default)
_LEFT = 1 << 40  # added to a rank's counter when it leaves the group
_VERDICT = "tfdist/silent"
_current: Heartbeat | None = None


def limit_for(timeout_s: float, cap: float = LIMIT_CAP_S) -> float:
    """Seconds of silence after which a peer is declared stopped: half the collective timeout
    (so that the heartbeat, which names the rank, speaks before the timeout, which does not),
    at most ``cap`` (``TFDIST_HEARTBEAT_TIMEOUT``, default :data:`LIMIT_CAP_S`)."""
    return min(timeout_s / 2, cap)


class Heartbeat:
    """The two threads of one rank (see the module docstring); :meth:`start` them once.

    Args:
        store: a client of the ranks' store, for this object alone (torch's TCPStore,
            :class:`tfdist.horovod.heartbeat.HttpStore`): ``add``, ``get``, ``check``,
            ``compare_set``.
        environment: this process's launch, for the line naming the silent rank.
        rank: this rank; size: the group's.
        limit_s: seconds of silence that make a peer stopped.
        store_rank: the rank whose process serves the store, or None (a launcher's).
    """

    def __init__(self, store: Any, environment: ClusterEnvironment, rank: int, size: int,
                 limit_s: float, store_rank: int | None) -> None:
        self.store, self.environment = store, environment
        self.rank, self.size, self.limit = rank, size, limit_s
        self.interval = min(max(limit_s / 10, 0.1), 5.0)
        self.store_rank = store_rank
        self.answered = time.monotonic()  # when the store last answered a whole beat
        self._probe = _connect(store)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="tfdist-heartbeat",
                                          daemon=True),
                         threading.Thread(target=self._watch_store, name="tfdist-heartbeat-store",
                                          daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, leave: bool = True) -> None:
        """Stops beating; with ``leave``, tells the watchers this rank left (not stopped): at most
        a second, since a store whose process stopped never answers."""
        closed = self._stop.is_set() or self._store_closed()  # nobody to tell
        self._stop.set()
        if leave and not closed:
            leave_thread = threading.Thread(target=_quietly, name="tfdist-heartbeat-leave",
                                            args=(self.store.add, _key(self.rank), _LEFT),
                                            daemon=True)
            leave_thread.start()
            leave_thread.join(1.0)
        if self._probe is not None:
            self._probe.close()

    def _beat(self) -> None:
        watched: int | None = (self.rank + 1) % self.size
        seen, since = -1, time.monotonic()
        while not self._stop.is_set():
            if self._store_closed():  # quietly: torch logs a failed request with its C++ stack
                self._stop.set()
                return
            try:
                self.store.add(_key(self.rank), 1)
                value = self.store.add(_key(watched), 0) if watched is not None else 0
                verdict = self.store.get(_VERDICT) if self.store.check([_VERDICT]) else None
            except Exception:  # closed: its process exited, and a crash reports itself
                self._stop.set()  # nor is the store's silence news from now on
                return
            now = self.answered = time.monotonic()
            if self._stop.is_set():
                return
            if verdict is not None:
                self._declare(int(verdict), self.limit, learnt=True)
            if value >= _LEFT:
                watched = None  # it left the group at the end of its script
            elif value != seen:
                seen, since = value, now
            elif watched is not None and now - since >= self.limit:
                # The first rank to write the verdict names the rank; the others follow it.
                agreed = _quietly(self.store.compare_set, _VERDICT, "", str(watched))
                agreed_rank = watched if agreed is None else int(agreed)
                self._declare(agreed_rank, now - since, learnt=agreed_rank != watched)
            self._stop.wait(self.interval)

    def _store_closed(self) -> bool:
        """Whether the store's process exited (its end of the probe closed), without a request."""
        if self._probe is None:
            return False
        try:
            readable = select.select([self._probe], [], [], 0)[0]
            return bool(readable) and self._probe.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # ValueError: stop() closed the probe meanwhile
            return True

    def _watch_store(self) -> None:
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self.answered
            if silent < self.limit + self.interval:
                continue
            if self.store_rank is not None and self.store_rank != self.rank:
                self._declare(self.store_rank, silent, learnt=False)
            logger.warning("tfdist: the ranks' store has not answered for %.0f s: the "
                           "heartbeat between the ranks stops", silent)
            return

    def _declare(self, silent_rank: int, seconds: float, learnt: bool) -> None:
        """Names ``silent_rank`` and ends this process (exit code 1)."""
        if self._stop.is_set():
            return
        message = failures.silent_message(silent_rank, round(seconds))
        stack = "".join(traceback.format_stack(
            sys._current_frames().get(threading.main_thread().ident or 0)))
        sys.stdout.flush()
        if silent_rank == self.rank:  # it was frozen, and the others gave up on it meanwhile
            print(f"tfdist: the other ranks stopped: to them, {message}. Rank {self.rank} was "
                  f"here (most recent call last):\n{stack}", file=sys.stderr, end="", flush=True)
            failures.linger(self.environment)
            os._exit(1)
        line = failures.report(message, self.environment) or ""
        print(f"tfdist: {message}; rank {self.rank} was waiting here (most recent call last):\n"
              f"{stack}{line}", file=sys.stderr, flush=True)
        failures.requeue_if_orphaned(message)
        if self.size > 2 and not learnt:
            time.sleep(2 * self.interval)  # the others read the verdict and name the same rank
        failures.linger(self.environment)
        os._exit(1)


def _key(rank: int | None) -> str:
    return f"tfdist/heartbeat/{rank}"


def _connect(store: Any) -> socket.socket | None:
    """A plain connection to the store's port, never used to send: it reads as closed once the
    store's process exits (the store's server keeps idle connections open)."""
    try:
        return socket.create_connection((store.host, store.port), timeout=10)
    except (AttributeError, OSError):
        return None


def _quietly(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:  # torch's DistError: the store is gone
        return None


def start(store: Any, environment: ClusterEnvironment, rank: int, size: int, limit_s: float,
          store_rank: int | None) -> Heartbeat | None:
    """Starts this rank's heartbeat over ``store`` (see :class:`Heartbeat`), as this process's
    one; None for one process."""
    global _current
    if size < 2:
        return None
    if _current is None:
        atexit.register(stop)  # a script that ends leaves: its peers stop watching it
    _current = Heartbeat(store, environment, rank, size, limit_s, store_rank)
    _current.start()
    return _current


def stop(leave: bool = True) -> None:
    """Stops this process's heartbeat, if any (before the process group goes).

    Args:
        leave: tell the other ranks' watchers that this rank leaves; not needed after a barrier
            of all ranks, which all stop their heartbeats next.
    """
    global _current
    if _current is not None:
        _current.stop(leave)
        _current = None
