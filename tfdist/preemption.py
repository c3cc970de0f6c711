"""Preemption and walltime: every rank stops at one agreed step, the state is saved, the job ends
with the code that asks for a requeue.

What happens, in order:

1. A signal arrives (``SIGTERM`` from Slurm's preemption or time limit, ``SIGUSR1`` from
   ``--signal=USR1@SECONDS``, or the one named by ``TFDIST_PREEMPT_SIGNAL``) on one rank or on
   all. The handler only records it: nothing is saved inside a signal handler, and the current
   step finishes.
2. Every ``check_every`` steps each rank contributes whether it has seen a signal to one tiny
   collective (:meth:`tfdist.backends.base.Distributed.any_rank`). All ranks get the same answer
   at the same step, so they all stop there, even when only one of them was signalled.
3. At that step the state is saved (:class:`PreemptionCheckpoint` in ``fit``; your own save in a
   custom loop), and the process exits with :data:`EXIT_PREEMPTED`, which a job script turns into
   a requeue when the job cannot requeue itself.

Signal handlers are installed only while a watch is active (during ``fit`` with
``dist.callbacks(model_dir=...)``, or inside :func:`watch`), and the previous handlers come back
afterwards: outside those, ``SIGTERM`` ends the process as it always did.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from tfdist.errors import ConfigError
from tfdist.settings import resolve

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["EXIT_PREEMPTED", "Watch", "parse_signal", "signals", "watch"]

logger = logging.getLogger("tfdist")

# What a preempted rank exits with after saving: EX_TEMPFAIL from sysexits.h, "try again later".
# srun returns the highest exit code of its tasks, so the job script sees it too.
EXIT_PREEMPTED = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signal(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` as a signal.

    Raises:
        ConfigError: not a signal this platform knows, or one that cannot be caught.
    """
    name = text.strip().upper()
    try:
        found = signal.Signals(int(name)) if name.isdigit() else signal.Signals[
            name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ConfigError(f"TFDIST_PREEMPT_SIGNAL={text!r} is not a signal: use a name such as "
                          "USR2 or SIGUSR2, or a number") from None
    if found in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"TFDIST_PREEMPT_SIGNAL={text!r}: {found.name} cannot be caught; "
                          "use USR1, USR2 or TERM")
    return found


def signals() -> tuple[signal.Signals, ...]:
    """The signals that request a checkpoint and a stop: SIGTERM, SIGUSR1 and the user's."""
    chosen = [signal.Signals[name] for name in DEFAULT_SIGNALS]
    extra = resolve("preempt_signal")
    if extra:
        found = parse_signal(extra)
        if found not in chosen:
            chosen.append(found)
    return tuple(chosen)


class Watch:
    """Records the first preemption signal; tells every rank at the same step.

    Args:
        dist: the handle; its :meth:`~tfdist.backends.base.Distributed.any_rank` is the one
            collective a check runs.
        check_every: check every N steps (1: every step). All ranks must use the same N.
        catch: the signals to record (default :func:`signals`).

    Attributes:
        signal: the first signal this process received, or None.
        received_at: ``time.monotonic()`` when it arrived.
        stop_requested: set once a check found a signal on some rank: every rank then stops.
    """

    def __init__(self, dist: Distributed, check_every: int = 1,
                 catch: Sequence[signal.Signals] | None = None) -> None:
        if check_every < 1:
            raise ConfigError(f"check_every={check_every}: use a positive number of steps")
        self.dist, self.check_every = dist, check_every
        self.catch = tuple(catch) if catch is not None else signals()
        self.signal: signal.Signals | None = None
        self.received_at: float | None = None
        self.stop_requested = False
        self._steps = 0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Installs the handlers (main thread only; elsewhere they cannot be set)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.catch:
            self._previous[sig] = signal.signal(sig, self._record)

    def uninstall(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        del frame  # no I/O, no locks here: the step in progress must finish undisturbed
        if self.signal is None:
            self.signal, self.received_at = signal.Signals(signum), time.monotonic()

    def step(self) -> bool:
        """Counts one step; every ``check_every`` steps runs the agreement collective.

        Call it on every rank after every step (or test batch). Returns whether all ranks must
        stop now; once True it stays True without further collectives.
        """
        if self.stop_requested:
            return True
        self._steps += 1
        if self._steps % self.check_every:
            return False
        if self.dist.any_rank(self.signal is not None):
            self.stop_requested = True
            if self.dist.is_chief:
                logger.warning("tfdist: preemption requested (%s on %s): every rank stops "
                               "after step %d", self.signal.name if self.signal else "a signal",
                               "this rank" if self.signal else "another rank", self._steps)
        return self.stop_requested


@contextlib.contextmanager
def watch(dist: Distributed, check_every: int | None = None) -> Iterator[Watch]:
    """Watches for preemption signals in a custom loop; call ``.step()`` after every step::

        with tfdist.preemption.watch(dist) as stop:
            for batch in dataset:
                train_step(batch)
                if stop.step():
                    save_state(); sys.exit(tfdist.preemption.EXIT_PREEMPTED)

    Args:
        dist: the handle.
        check_every: check every N steps; env ``TFDIST_PREEMPT_CHECK_EVERY``, default 1.
    """
    found = Watch(dist, resolve("preempt_check_every", check_every))
    found.install()
    try:
        yield found
    finally:
        found.uninstall()
