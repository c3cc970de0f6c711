"""tf.data iterators freed on a thread of tfdist's own, so the training thread never waits.

Freeing an iterator of an autotuned dataset (TensorFlow's default) cancels it and joins its
autotuning thread, which sleeps between passes (10 ms after the first read, then 20, 40, 80 ms
and so on, up to 60 s). The cancellation wakes that thread before TensorFlow marks the iterator
cancelled (``CancellationManager::StartCancelWithStatus`` runs its callbacks first), so a thread
that wakes at once goes back to sleep until its next pass, and the free waits that long: up to
about as long as the iterator was read, at most 60 s. Keras frees the last epoch's iterator at
every epoch's start on the training thread; on 2 MWMS workers with epochs of about 3 s, 5 of 7
epochs started about 2 s late, and every rank waits for the slowest (docs/performance.md,
``benchmarks/iterator_free.py``, ``benchmarks/epoch_start.py``).

:func:`install` hands each plain iterator made eagerly (a ``tf.data`` ``OwnedIterator``: Keras's
epochs, a custom loop's ``for batch in dataset``, a plain iterator under MWMS) to one thread
that drops it: TensorFlow waits there without holding Python's lock, and the training goes on.
The iterator's dataset is kept alive until then (a generator's dataset is needed to free it).
Left to TensorFlow: the per-device iterators of a multi-device iterator (freeing those on
another thread crashed TensorFlow), and iterators made while tracing a ``tf.function``. At exit,
frees still pending are waited for, at most :data:`EXIT_WAIT_S`, as the training thread would
have. ``TFDIST_SKIP_PATCHES=iterator-free-thread`` leaves every free where TensorFlow does it
(patch ``iterator-free-thread``: :func:`install_free_thread` on TensorFlow's backends,
:func:`install_where_loaded` on Keras 3 on JAX).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from tfdist import patches

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["EXIT_WAIT_S", "freed", "install", "install_free_thread", "install_where_loaded",
           "pending"]

logger = logging.getLogger("tfdist")

EXIT_WAIT_S = 60.0  # the longest autotuning sleep: a free waits at most that
# A multi-device iterator reads each device's part through an iterator of one of these.
_PER_DEVICE = ("_PerDeviceGenerator", "_ReincarnatedPerDeviceGenerator")


class _Freer:
    """The thread that drops what is handed to it, and its counts."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Starts empty: also in a forked child, which has no freeing thread (and whose copy of
        the lock may be held by it)."""
        self._ready = threading.Condition()
        self._queue: deque[tuple[Any, ...]] = deque()
        self._busy = 0  # handed over and not yet dropped
        self._freed = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def hand_over(self, *held: Any) -> None:
        """Drops ``held`` on the freeing thread (here once the process is exiting)."""
        with self._ready:
            if self._closed:
                return  # dropped here, on return
            self._queue.append(held)
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tfdist-iterator-free",
                                                daemon=True)
                self._thread.start()
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                held = self._queue.popleft()
            del held  # TensorFlow frees the iterator here, Python's lock released while it waits
            with self._ready:
                self._busy -= 1
                self._freed += 1
                self._ready.notify_all()

    def settle(self, wait_s: float) -> bool:
        """Waits up to ``wait_s`` for what was handed over: whether all of it was freed."""
        deadline = time.monotonic() + wait_s
        with self._ready:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._ready.wait(timeout=left)
            return not self._busy

    def close(self, wait_s: float) -> bool:
        """Takes no more, then :meth:`settle`."""
        with self._ready:
            self._closed = True
        return self.settle(wait_s)

    def counts(self) -> tuple[int, int]:
        with self._ready:
            return self._busy, self._freed


_freer = _Freer()


def pending() -> int:
    """Iterators handed over and not yet freed."""
    return _freer.counts()[0]


def freed(wait_s: float = 0.0) -> int:
    """Iterators this process freed on tfdist's thread; with ``wait_s``, once what was handed
    over is freed (waiting ``wait_s`` at most)."""
    _freer.settle(wait_s)
    return _freer.counts()[1]


def _feeds_a_device(dataset: Any, depth: int = 4) -> bool:
    """Whether ``dataset`` is, or reads within ``depth`` steps, a multi-device iterator's
    per-device dataset (a prefetch may wrap it)."""
    for _ in range(depth):
        if type(dataset).__name__ in _PER_DEVICE:
            return True
        inputs = getattr(dataset, "_inputs", None)
        try:
            found = inputs() if callable(inputs) else []
        except Exception:  # a dataset that cannot say: left to TensorFlow
            return True
        if len(found) != 1:
            return False
        dataset = found[0]
    return False


def _exit() -> None:
    if not _freer.close(EXIT_WAIT_S):
        logger.warning("tfdist: an input iterator was still being freed after %g s at exit; "
                       "exiting without it", EXIT_WAIT_S)


def install_free_thread(where: Where, dist: Any) -> None:
    """Patch ``iterator-free-thread``'s installer on TensorFlow's backends
    (:func:`tfdist.patches.install`)."""
    install()


def install_where_loaded() -> bool:
    """:func:`install` if TensorFlow is loaded and the process's plan holds the patch
    (:func:`tfdist.patches.planned_here`; phase ``lazy``): Keras 3 on JAX calls it as an
    epoch's input is made, so a job that reads a tf.data dataset gets it and one that never
    imports TensorFlow does not start it."""
    return ("tensorflow" in sys.modules and patches.planned_here("iterator-free-thread")
            and install())


def install() -> bool:
    """Frees plain tf.data iterators on tfdist's thread from now on, once per process (every
    TensorFlow backend; Keras 3 on JAX: :func:`install_where_loaded`). False where this
    TensorFlow lacks what it hooks."""
    if _installed:
        return _installed[0]
    _installed.append(_install())
    return _installed[0]


_installed: list[bool] = []


def _install() -> bool:
    try:
        from tensorflow.python.data.ops import iterator_ops
        from tensorflow.python.eager import context

        iterator_ops.OwnedIterator._create_iterator  # noqa: B018  (the hooked attribute)
    except (ImportError, AttributeError) as error:
        logger.info("tfdist: tf.data iterators are freed where TensorFlow frees them on this "
                    "TensorFlow (%s)", error)
        return False

    def wrap(original: Any) -> Any:
        def _create_iterator(self: Any, dataset: Any) -> None:
            original(self, dataset)
            if not context.executing_eagerly() or _feeds_a_device(dataset):
                return
            resource = getattr(self, "_iterator_resource", None)
            if resource is None:
                return
            # When the iterator is dropped its resource (and dataset) go to the freeing thread.
            finalizer = weakref.finalize(self, _freer.hand_over, resource,
                                         getattr(self, "_dataset", None))
            finalizer.atexit = False

        return _create_iterator

    if patches.apply("iterator-free-thread", iterator_ops.OwnedIterator, "_create_iterator",
                     wrap):
        atexit.register(_exit)  # after TensorFlow's own exit handlers were registered: first
        os.register_at_fork(after_in_child=_freer._reset)
    return True
