"""Saves written in the background: a training step waits for a copy of the state, not for the
disk.

A background save has two halves. On the training thread, at the agreed step: a snapshot, the
state's values copied to host memory (for a model of a few GB, a fraction of a second). On
this process's writer thread, while training goes on: the rank's files written into the
save's own folder (``model_dir/.preempted.partial-N``, N counting the run's saves, the same
on every rank since saves happen at agreed steps), flushed to the disk (fsync), and then a
marker (``.done-RANK``) that says this rank's files are durable. The chief, once its own files
are written, waits for every rank's marker, adds ``state.json`` and commits with the renames
of :func:`tfdist.preemption.commit`: ``preempted`` becomes ``preempted.old`` and the partial
folder ``preempted``. No collective runs off the training thread, so nothing can deadlock
with the step's own; the folder every rank sees is the only channel.

So a kill at any moment leaves the last committed save complete, and the one before it: a
partial folder is never read (:func:`tfdist.preemption.read_states` reads only the committed
two), and the next save's chief removes those of saves that never completed
(:func:`stale_partials`). One save is in flight per process: the next snapshot waits for the
previous write (:meth:`Writer.submit`), so a disk slower than the interval slows training
rather than piling up copies in memory.

:func:`partial_name`, :func:`save_number`, :func:`stale_partials` and :func:`complete` are
pure and table-tested.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tfdist import walltime

__all__ = ["MARKER", "PARTIAL_PREFIX", "Writer", "complete", "fsync_dir", "fsync_folder",
           "mark_done",
           "partial_name", "remove_partials", "save_number", "stale_partials", "start_save",
           "wait_for_ranks"]

logger = logging.getLogger("tfdist")

# How long the chief's writer waits for the other ranks' markers before it gives the save up
# (not committed; the last complete save stays): a rank's write of the same state as the
# chief's takes about as long, so this is a rank lost during the write.
RANKS_TIMEOUT_S = 600.0
WRITER_NICE = 10  # the writer thread's priority below the training threads' (Linux)

PARTIAL_PREFIX = ".preempted.partial-"
MARKER = ".done-"
_PARTIAL = re.compile(re.escape(PARTIAL_PREFIX) + r"(\d+)$")


def partial_name(number: int) -> str:
    """The folder of save ``number`` in model_dir, before its commit (pure)."""
    return f"{PARTIAL_PREFIX}{number}"


def save_number(name: str) -> int | None:
    """The save a partial folder's name belongs to; None for any other name (pure)."""
    found = _PARTIAL.match(name)
    return int(found.group(1)) if found else None


def stale_partials(names: Iterable[str], current: float) -> list[str]:
    """The partial folders among ``names`` (model_dir's entries) of saves before ``current``:
    they never completed (a kill, a rank lost during the write), and only take room (pure)."""
    return sorted(name for name in names
                  if (number := save_number(name)) is not None and number < current)


def complete(names: Iterable[str], world_size: int) -> bool:
    """Whether a partial folder holding ``names`` has every rank's marker (pure)."""
    found = set(names)
    return all(f"{MARKER}{rank}" in found for rank in range(world_size))


def fsync_folder(folder: str) -> None:
    """Makes every file in ``folder`` and the folder's own entries durable."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Makes ``folder``'s entries durable (a rename in it, a file made)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory: their renames are durable
        pass
    finally:
        os.close(fd)


def mark_done(folder: str, rank: int) -> None:
    """This rank's files in ``folder`` are durable (call after :func:`fsync_folder`).

    The folder is opened first and the marker made inside that handle: once the marker is
    there, the chief may rename the folder (its commit) at any moment, and the folder's own
    flush must still reach it (by its path, it raced the rename: seen on JAX, 1 run in 8).
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        marker = os.open(f"{MARKER}{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                         dir_fd=fd)
        try:
            os.write(marker, f"{time.time():.3f}\n".encode())
            os.fsync(marker)
        finally:
            os.close(marker)
        with contextlib.suppress(OSError):  # a file system refusing fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def wait_for_ranks(folder: str, world_size: int, timeout_s: float,
                   given_up: Callable[[], bool] = lambda: False) -> bool:
    """Waits until every rank's marker is in ``folder``; False after ``timeout_s`` or once
    ``given_up()`` (a newer save, the process ending): the save is then not committed."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        try:
            if complete(os.listdir(folder), world_size):
                return True
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline or given_up():
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def remove_partials(model_dir: str, before: int | None = None) -> None:
    """Removes the partial folders in ``model_dir`` of saves before ``before`` (the chief's
    writer, at each save: they never completed), or every one (the chief, before this run's
    first save: no rank writes one before the first step's collective)."""
    try:
        names = os.listdir(model_dir)
    except FileNotFoundError:
        return
    for name in stale_partials(names, before if before is not None else float("inf")):
        shutil.rmtree(os.path.join(model_dir, name), ignore_errors=True)


def start_save(writer: Writer, *, model_dir: str, final: str, number: int, rank: int,
               world_size: int, is_chief: bool, write: Callable[[str], None],
               state: dict[str, Any], commit: Callable[[str, str], None],
               state_file: str = "state.json") -> float:
    """Starts save ``number`` on ``writer``: ``write(folder)`` writes this rank's files (from
    a snapshot taken before: the training thread goes on), then they are made durable and
    marked; the chief then waits for every rank's marker, adds ``state_file`` (``state``,
    the world size and the write's seconds) and ``commit(folder, final)``. Returns the seconds
    the step waited for the save before it (one in flight)."""
    folder = os.path.join(model_dir, partial_name(number))

    def job() -> None:
        started = time.monotonic()
        os.makedirs(folder, exist_ok=True)
        write(folder)
        fsync_folder(folder)
        mark_done(folder, rank)
        if not is_chief:
            walltime.record_save(time.monotonic() - started)  # the margin follows the saves
            return
        remove_partials(model_dir, before=number)
        if not wait_for_ranks(folder, world_size, RANKS_TIMEOUT_S):
            logger.warning("tfdist: a background save in %s was not committed: not every rank "
                           "wrote its part within %.0f s; the last complete state stays",
                           folder, RANKS_TIMEOUT_S)
            return
        with open(os.path.join(folder, state_file), "w", encoding="utf-8") as f:
            json.dump({**state, "world_size": world_size,
                       "save_seconds": round(time.monotonic() - started, 3),
                       "background": True}, f)
            f.flush()
            os.fsync(f.fileno())
        commit(folder, final)
        fsync_dir(model_dir)
        walltime.record_save(time.monotonic() - started)

    return writer.submit(job)


class Writer:
    """This process's writer thread: at most one save in flight.

    :meth:`submit` starts a write (a function of no arguments) once the previous has ended,
    and returns the seconds it waited for it; :meth:`wait` waits for the one in flight. An
    error of a write is raised by the next :meth:`submit` or :meth:`wait`, on the training
    thread, so a full disk stops training as a synchronous save would.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None  # when the write in flight started (monotonic)
        self.last_seconds: float | None = None  # how long the last finished write took

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], None]) -> float:
        waited = self.wait()
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(write,),
                                        name="tfdist-background-save", daemon=True)
        self._thread.start()
        return waited

    def wait(self, timeout_s: float | None = None) -> float:
        """Waits for the write in flight (at most ``timeout_s``); the seconds waited. Raises
        the error of a write that failed."""
        started = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.monotonic() - started

    def _run(self, write: Callable[[], None]) -> None:
        # Below the training threads: where the processor is what trains (a CPU job, the
        # input pipeline), the write takes what they leave (Linux: a thread's own nice).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            write()
        except BaseException as error:  # raised again on the training thread
            self._error = error
        finally:
            if self.started_at is not None:
                self.last_seconds = time.monotonic() - self.started_at
