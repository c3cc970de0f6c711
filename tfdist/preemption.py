"""Preemption and walltime: every rank stops at one agreed step, the state is saved, the job ends
with the code that asks for a requeue.

What happens, in order:

1. A signal arrives (``SIGTERM`` from Slurm's preemption or time limit, ``SIGUSR1`` from
   ``--signal=USR1@SECONDS``, or the one named by ``TFDIST_PREEMPT_SIGNAL``) on one rank or on
   all. The handler only records it: nothing is saved inside a signal handler, and the current
   step finishes.
2. At agreed steps, about once a second of training, each rank contributes whether it has seen
   a signal (and the chief its time left before the run's end, :mod:`tfdist.walltime`, which
   stops every rank the same way with no signal) to one tiny collective
   (:meth:`tfdist.backends.base.Distributed.sum_over_ranks`).
   All ranks get the same answer at the same step, so they all stop there, even when only one
   of them was signalled. The same collective agrees on the next check: each rank proposes
   a step interval from its measured step time, and all take the mean of the proposals, which
   is the same number on every rank. The interval starts at one step and at most doubles from
   one check to the next (:func:`next_interval`): a step timed right after warm-up can be ten
   times faster than the average one (an epoch's end, a new iterator), and checks sized from it
   alone came minutes apart. A check costs about 4 ms with MWMS on loopback; at one a
   second that is 0.4% of the time.
3. At that step the state is saved (:class:`PreemptionCheckpoint` in ``fit``; your own save in a
   custom loop), and the process exits with :data:`EXIT_PREEMPTED`, which a job script turns into
   a requeue when the job cannot requeue itself.

Signal handlers are installed only while a watch is active (during ``fit`` with
``dist.callbacks(model_dir=...)``, or inside :func:`watch`), and the previous handlers come back
afterwards: outside those, ``SIGTERM`` ends the process as it always did.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from tfdist import model_dir as layout
from tfdist import uncaught, walltime
from tfdist.errors import ConfigError, StorageError
from tfdist.handle import Agreeing  # what a watch needs of a handle, every framework's
from tfdist.scratch import as_given, scratch_dir
from tfdist.settings import catchable_signal, resolve

if TYPE_CHECKING:
    from tfdist.env import ClusterEnvironment

__all__ = ["CHECKPOINT_DIR", "EXIT_PREEMPTED", "Agreeing", "Watch", "after_training", "commit",
           "default_signals_in_children", "exit_preempted", "load_loop_state", "next_interval",
           "parse_signal", "read_state", "read_states", "requeue", "requeue_plan",
           "save_loop_state", "save_state", "signals", "slow_save", "take_late_signal", "watch"]

logger = logging.getLogger("tfdist")

# What a preempted rank exits with after saving: EX_TEMPFAIL from sysexits.h, "try again later".
# srun returns the highest exit code of its tasks, so the job script sees it too.
EXIT_PREEMPTED = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
MAX_INTERVAL = 1000  # steps between two checks at most, however short the steps
CHECKPOINT_DIR = layout.PREEMPTED  # in model_dir: the state saved at the agreed step
# A safety save is worth a line of its own (a quiet run prints one tfdist line an epoch) when it
# takes longer than SLOW_SAVE_S, or than SLOW_SAVE_SHARE of its interval.
SLOW_SAVE_S = 1.0
SLOW_SAVE_SHARE = 0.05
STATE_FILE = "state.json"
_restores: list[Any] = []  # the custom loops' restore statuses, kept for deferred variables
_exiting = False  # exit_preempted has begun: the preemption signals are ignored until the end


def parse_signal(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` as a signal.

    Raises:
        ConfigError: not a signal this platform knows, or one that cannot be caught.
    """
    try:
        return catchable_signal(text)
    except ValueError as error:
        raise ConfigError(f"TFDIST_PREEMPT_SIGNAL={text!r} {error}") from None


def signals() -> tuple[signal.Signals, ...]:
    """The signals that request a checkpoint and a stop: SIGTERM, SIGUSR1 and the user's."""
    chosen = [signal.Signals[name] for name in DEFAULT_SIGNALS]
    extra = resolve("preempt_signal")
    if extra:
        found = parse_signal(extra)
        if found not in chosen:
            chosen.append(found)
    return tuple(chosen)


def default_signals_in_children() -> None:
    """Starts forked children (a ``PyDataset``'s or ``Sequence``'s process pool with
    ``use_multiprocessing=True``, a DataLoader's workers) with the preemption signals at their
    default action. Otherwise they inherit the training process's handlers, TensorFlow's
    preemption notifier's and tfdist's, which record SIGTERM instead of ending: the pool's
    ``terminate()`` then waits for children that never end, and the script hangs at its exit.
    Once a process."""
    if _fork_hook:
        return
    chosen = signals()
    _fork_hook.append(True)

    def default_actions() -> None:
        for sig in chosen:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_DFL)

    os.register_at_fork(after_in_child=default_actions)


_fork_hook: list[bool] = []  # registered in this process


def _clock_of(dist: Agreeing) -> walltime.Clock | None:
    """The chief's walltime clock, started (None on the other ranks: the chief decides)."""
    if not dist.is_chief:
        return None
    environment = getattr(dist, "environment", None)
    if environment is None:
        return None
    found = walltime.clock(environment)
    found.start()
    return found


def next_interval(previous: int, proposal: float) -> int:
    """Steps until the next check (pure): the ranks' mean ``proposal``, but at most twice the
    ``previous`` interval and :data:`MAX_INTERVAL`, and at least one step."""
    return max(1, min(2 * previous, int(proposal), MAX_INTERVAL))


class Watch:
    """Records the first preemption signal; tells every rank at the same step. So it does when
    the chief's walltime clock says the run's end is within the margin (:mod:`tfdist.walltime`),
    except at the run's first agreement: there every rank refuses the run alike
    (:func:`tfdist.walltime.refusal`).

    Args:
        dist: the handle; its :meth:`~tfdist.backends.base.Distributed.sum_over_ranks` is the
            one collective a check runs.
        check_seconds: about how much training time passes between two checks.
        catch: the signals to record (default :func:`signals`).
        clock: the walltime clock (default: this process's, :func:`tfdist.walltime.clock`, on
            the chief).
        every: seconds between two safety saves; None: none.

    Attributes:
        signal: the first signal this process received, or None.
        received_at: ``time.monotonic()`` when it arrived.
        stop_requested: set once a check found a signal on some rank, or the end near: every
            rank then stops.
        walltime: the stop came from the walltime guard.
        every: seconds between two safety saves (``TFDIST_CHECKPOINT_EVERY``), or None.
        save_now: set by the check of this step when a safety save is due: every rank saves
            the state here and trains on (then calls :meth:`saved`).
        clock: the chief's :class:`tfdist.walltime.Clock` (None on the other ranks).
        checks: how many checks ran (each one collective).
    """

    def __init__(self, dist: Agreeing, check_seconds: float = 1.0,
                 catch: Sequence[signal.Signals] | None = None,
                 clock: walltime.Clock | None = None, every: float | None = None) -> None:
        if not check_seconds > 0:
            raise ConfigError(f"check_seconds={check_seconds}: use a positive number of seconds")
        self.dist, self.check_seconds = dist, check_seconds
        self.catch = tuple(catch) if catch is not None else signals()
        self.signal: signal.Signals | None = None
        self.received_at: float | None = None
        self.stop_requested = False
        self.walltime = False  # the stop came from the walltime guard, not from a signal
        self.checks = 0
        # The walltime guard's clock: the chief's decides (tfdist.walltime).
        self.clock = clock if clock is not None else _clock_of(dist)
        self._margin = resolve("walltime_margin")
        self.every = every
        self.save_now = False  # this step is an agreed safety save (every `every` seconds)
        self._saved_at = time.monotonic()
        # Steps counted, the step of the next check, the agreed interval, and the step and time
        # of the last check.
        self._steps, self._next_check, self._interval = 0, 1, 1
        self._checked_step, self._checked_time = 0, time.monotonic()
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Installs the handlers (main thread only; elsewhere they cannot be set)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig in self.catch:
            self._previous[sig] = signal.signal(sig, self._record)

    def uninstall(self, redeliver: bool = True) -> None:
        """Puts the previous handlers back (not once :func:`exit_preempted` has begun: the
        signals stay ignored until the process has exited).

        Args:
            redeliver: a signal that arrived but was never acted on (training ended first)
                goes to the previous handler now, so it has the effect it would have had
                without tfdist (SIGTERM still ends the process).
        """
        for sig, previous in self._previous.items():
            if not _exiting:
                signal.signal(sig, previous)
        pending = self._previous and redeliver and self.signal and not self.stop_requested
        self._previous = {}
        if pending and self.signal is not None:
            signal.raise_signal(self.signal)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        del frame  # no I/O, no locks here: the step in progress must finish undisturbed
        if self.signal is None:
            self.signal, self.received_at = signal.Signals(signum), time.monotonic()

    def step(self) -> bool:
        """Counts one step; at the agreed steps runs the agreement collective.

        Call it on every rank after every step (or test batch): all ranks count the same
        steps, so they check at the same ones. Returns whether all ranks must stop now; once
        True it stays True without further collectives.
        """
        if self.stop_requested:
            return True
        self._steps += 1
        self.save_now = False
        if self._steps < self._next_check:
            return False
        return self.check()

    def check(self) -> bool:
        """Runs the agreement now (every rank at the same point, e.g. at an epoch's end).

        Returns whether all ranks must stop.

        Raises:
            ConfigError: on every rank, at the run's first agreement, when the walltime guard
                would stop it there (:func:`tfdist.walltime.refusal`).
        """
        if self.stop_requested:
            return True
        gap = time.monotonic() - self._checked_time
        per_step = gap / max(1, self._steps - self._checked_step)
        proposal = min(MAX_INTERVAL, max(1, round(self.check_seconds / max(per_step, 1e-6))))
        left = self.clock.left() if self.dist.is_chief and self.clock is not None else None
        # The chief's time left and margin (0 elsewhere): the sums are the chief's on every rank.
        guard = ([1.0, left, walltime.margin(walltime.longest_save(), gap, self._margin)]
                 if left is not None else [0.0, 0.0, 0.0])
        # At the run's first agreement also the time it had at its start and where its end came
        # from: every rank refuses the run there alike when it would stop (walltime.refusal).
        first = self.dist.is_chief and self.clock is not None and self.clock.take_first()
        started = self.clock.left_at_start() if first and self.clock is not None else None
        opening = ([1.0, started, walltime.source_number(self.clock.source)]
                   if started is not None and left is not None and self.clock is not None
                   else [0.0, 0.0, 0.0])
        # A safety save is due by the chief's clock.
        due = (self.dist.is_chief and self.every is not None
               and time.monotonic() - self._saved_at >= self.every)
        (signalled, proposals, known, left_s, margin_s, due_s, first_s, started_s,
         source_s) = self.dist.sum_over_ranks(
            [self.signal is not None, proposal, *guard, due, *opening])
        self.checks += 1
        # The mean of the proposals is the same number on every rank, and so is the interval.
        self._interval = next_interval(self._interval, proposals / self.dist.world_size)
        self._next_check = self._steps + self._interval
        self._checked_step, self._checked_time = self._steps, time.monotonic()
        refused = (walltime.refusal(started_s, left_s, margin_s, walltime.source_named(source_s),
                                    self._margin is not None, signalled > 0)
                   if first_s > 0 else None)
        if refused is not None:
            # Every rank raises it alike; uncaught, it ends the process with EXIT_REFUSED
            # (tfdist.uncaught), not with 1, which a restart would repeat.
            raise ConfigError(refused)
        if signalled > 0:
            self.stop_requested = True
            if self.dist.is_chief:
                logger.warning("tfdist: preemption requested (%s on %s): every rank stops "
                               "after step %d", self.signal.name if self.signal else "a signal",
                               "this rank" if self.signal else "another rank", self._steps)
        elif known > 0 and left_s <= margin_s:
            self.stop_requested = self.walltime = True
            if self.dist.is_chief:
                logger.warning("tfdist: walltime: %.0f s left before this run's end (from %s), "
                               "the margin is %.0f s (TFDIST_WALLTIME_MARGIN): every rank stops "
                               "after step %d, saves and exits %d", left_s,
                               self.clock.source if self.clock else "?", margin_s,
                               self._steps, EXIT_PREEMPTED)
        self.save_now = due_s > 0 and not self.stop_requested
        return self.stop_requested

    def saved(self) -> None:
        """Call after a safety save (or any save of the whole state): the next is ``every``
        seconds from now."""
        self._saved_at, self.save_now = time.monotonic(), False


@contextlib.contextmanager
def watch(dist: Agreeing, check_seconds: float | None = None,
          every: float | str | None = None) -> Iterator[Watch]:
    """Watches for preemption signals (and the walltime) in a custom loop; call ``.step()``
    after every step::

        with tfdist.preemption.watch(dist) as stop:
            for batch in dataset:
                train_step(batch)
                if stop.step():
                    save_state(); sys.exit(tfdist.preemption.EXIT_PREEMPTED)
                if stop.save_now:  # with TFDIST_CHECKPOINT_EVERY
                    save_state(); stop.saved()

    Args:
        dist: the handle.
        check_seconds: about how often to agree; env ``TFDIST_PREEMPT_CHECK_SECONDS``,
            default 1.
        every: seconds between two safety saves; env ``TFDIST_CHECKPOINT_EVERY``, default
            none.
    """
    found = Watch(dist, resolve("preempt_check_seconds", check_seconds),
                  every=resolve("checkpoint_every", every))
    found.install()
    try:
        yield found
    finally:
        found.uninstall()


def after_training(catch: Sequence[signal.Signals], pending: signal.Signals | None,
                   rank: int) -> None:
    """Keeps catching the preemption signals once a ``fit`` has ended, so that a walltime
    warning or a preemption during the script's last work (its ``evaluate``, its save) does
    not kill it: the script goes on and ends as it would (training is complete: nothing to
    save, and no requeue that would train it again), and a later ``fit`` stops at its first
    agreed step (:func:`take_late_signal`). Once per process; a rank that got such a signal
    says so as it exits.

    Args:
        catch: the signals the fit caught.
        pending: one that came too late for the fit to act on, if any.
        rank: this process's rank, for that line.
    """
    if pending is not None and _late["signal"] is None:
        _late["signal"] = pending
    if _late["installed"] or threading.current_thread() is not threading.main_thread():
        return
    for sig in catch:
        if not _exiting:
            signal.signal(sig, _record_late)
    _late["installed"] = True
    atexit.register(_say_late, rank)


def take_late_signal() -> signal.Signals | None:
    """The preemption signal that came after the last ``fit`` ended, if any; a ``fit`` that
    starts takes it (and stops at its first agreed step)."""
    late, _late["signal"] = _late["signal"], None
    return late


_late: dict[str, Any] = {"signal": None, "installed": False}


def _record_late(signum: int, frame: FrameType | None) -> None:
    del frame  # no I/O here: the main thread may hold a lock
    if _late["signal"] is None:
        _late["signal"] = signal.Signals(signum)


def _say_late(rank: int) -> None:
    late = _late["signal"]
    if late is None:
        return
    # Set by Python when an exception went uncaught (a peer's crash failing this rank's
    # collective, after which a launcher's SIGTERM arrives too): then nothing ended normally.
    failed = getattr(sys, "last_type", None)
    if failed is not None:
        logger.warning("tfdist: rank %d: %s came after training had ended, while the script "
                       "ended with an error (%s, above): nothing saved or requeued for the "
                       "signal", rank, late.name, failed.__name__)
    else:
        logger.warning("tfdist: rank %d: %s came after training had ended: the script finished "
                       "its work and ends normally (training is complete: nothing to save, no "
                       "requeue)", rank, late.name)


def exit_preempted(dist: Agreeing) -> NoReturn:
    """Ends a preempted process, once its state is saved: call it on every rank.

    The chief requeues the Slurm job (:func:`requeue`); then every rank waits for the others
    (no rank may exit first: ``srun --kill-on-bad-exit`` would kill the chief mid-requeue) and
    exits with :data:`EXIT_PREEMPTED`: ``SystemExit`` runs your ``finally`` blocks, then the
    process ends at once, without TensorFlow's (or torch's) teardown; close your own log
    writers in a ``finally`` block.
    """
    global _exiting
    # The state is saved: from here a SIGTERM has nothing left to protect, and one comes when
    # the first rank exits (srun --kill-on-bad-exit ends the step), which would turn this
    # rank's 75 into 143, and srun's code with it: the job script would not requeue. Ignored,
    # not handled, because Python keeps an ignored signal ignored through its shutdown.
    _exiting = True
    loops = sys.modules.get("tfdist.keras.loop_saves")
    if loops is not None:  # a loop's final save in the background: on the disk first
        loops.wait_all()
    if threading.current_thread() is threading.main_thread():
        for sig in signals():
            signal.signal(sig, signal.SIG_IGN)
    if dist.is_chief:
        requeue(dist.environment)
    dist.exit_barrier()
    # Registered last, so it runs first at shutdown, after every finally block: the process
    # ends there, without TensorFlow's teardown, which can wait for seconds on peers that have
    # already exited (the chief holds MWMS's coordination service) while srun's KillWait runs.
    atexit.register(uncaught.end, EXIT_PREEMPTED, dist.environment)
    raise SystemExit(EXIT_PREEMPTED)


def slow_save(took: float, every: float | None) -> bool:
    """Whether a safety save that took ``took`` seconds, one every ``every`` seconds (None: at
    epochs' ends only), deserves a line (pure): see :data:`SLOW_SAVE_S`."""
    return took > SLOW_SAVE_S or (every is not None and took > SLOW_SAVE_SHARE * every)


def commit(partial: str, final: str) -> None:
    """Makes the finished directory ``partial`` the checkpoint ``final``, atomically enough that
    a kill at any moment leaves a complete checkpoint: ``final``, else ``final.old``.

    The complete checkpoint before it stays as ``final.old`` until the next commit, so a resume
    whose newest state cannot be read (a damaged file) falls back to it (:func:`read_states`).
    ``partial``, ``final`` and ``final.old`` are siblings on one file system.
    """
    old = f"{final}.old"
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)


def read_states(model_dir: str) -> list[dict[str, Any]]:
    """The states of the complete checkpoints in ``model_dir``, the newest first: ``preempted``
    and the one before it, ``preempted.old`` (also the only one when a kill came between the two
    renames of :func:`commit`). Each dict has ``"path"``, the checkpoint's directory."""
    found = []
    for folder in (CHECKPOINT_DIR, f"{CHECKPOINT_DIR}.old"):
        path = os.path.join(model_dir, folder)
        try:
            with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
                state: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            found.append({**state, "path": path})
    return found


def read_state(model_dir: str) -> dict[str, Any] | None:
    """The state of the last complete preemption checkpoint in ``model_dir``, or None
    (:func:`read_states`' first)."""
    states = read_states(model_dir)
    if not states:
        return None
    walltime.record_save(states[0].get("save_seconds"))  # the run that saved it timed the save
    return states[0]


def requeue_plan(environment: ClusterEnvironment, max_requeues: int,
                 scontrol: str | None) -> tuple[list[str] | None, str]:
    """How this preempted job gets back into the queue (pure): the command, and why.

    Args:
        environment: the detected launch; only Slurm jobs are requeued.
        max_requeues: the limit on ``restart_count`` (``TFDIST_MAX_REQUEUES``).
        scontrol: the path of ``scontrol``, or None when it is not installed here (often inside
            a container).

    Returns:
        ``(command, reason)``; ``command`` is None when tfdist does not requeue, and then
        ``reason`` says what happens instead.
    """
    if environment.job_id is None or environment.facts.tfdist_launch:
        return None, ("not a Slurm job (or started by tfdist launch inside one): start it "
                      "again; tfdist launch --max-restarts does")
    if environment.step_loop is not None:
        return None, (f"tfdist {environment.step_loop} runs this step and decides what follows "
                      f"exit code {EXIT_PREEMPTED} (the job script requeues a preempted job)")
    if environment.restart_count >= max_requeues:
        return None, (f"the job was already requeued {environment.restart_count} times, the "
                      f"limit (TFDIST_MAX_REQUEUES={max_requeues}): not again")
    if scontrol is None:
        return None, ("scontrol is not installed here (inside a container?): the job script "
                      f"requeues the job when srun exits with {EXIT_PREEMPTED}")
    job = (f"{environment.array_job_id}_{environment.array_task_id}"
           if environment.array_job_id and environment.array_task_id else environment.job_id)
    return [scontrol, "requeue", job], f"requeue {run_count(environment)} of {max_requeues}"


def run_count(environment: ClusterEnvironment) -> int:
    """The number of the requeue this would be (1 for the first)."""
    return environment.restart_count + 1


def requeue(environment: ClusterEnvironment) -> bool:
    """Puts this Slurm job back into the queue with ``scontrol requeue`` where it can.

    Call it on one rank, after the state is saved. A failure is logged, not raised: the job
    script's fallback (exit code :data:`EXIT_PREEMPTED`) still applies.

    Returns:
        Whether ``scontrol requeue`` succeeded.
    """
    command, reason = requeue_plan(environment, resolve("max_requeues"),
                                   shutil.which("scontrol"))
    if command is None:
        logger.warning("tfdist: not requeueing: %s", reason)
        return False
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("tfdist: `%s` failed (%s): the job script's fallback must requeue",
                       " ".join(command), error)
        return False
    if done.returncode:
        logger.warning("tfdist: `%s` failed: %s; the job script's fallback must requeue (was "
                       "the job submitted with --requeue?)", " ".join(command),
                       done.stderr.strip() or f"exit code {done.returncode}")
        return False
    logger.warning("tfdist: %s: `%s`", reason, " ".join(command))
    return True


def save_state(dist: Agreeing, model_dir: str, write: Callable[[str], None],
               state: dict[str, Any]) -> str | None:
    """Writes one complete state folder and makes it ``model_dir/preempted`` (:func:`commit`).

    Call it on every rank: the chief makes a fresh folder, every rank runs ``write(folder)``
    (what a rank writes there must be its own files), the chief adds ``state.json`` (``state``
    and the world size) and, once every rank has written, commits.

    Returns:
        The committed folder on the chief, None on the other ranks.

    Raises:
        StorageError: on every rank, when a rank could not write (a full or read-only file
            system): nothing is committed, and the last complete state stays the one to resume.
    """
    final = os.path.join(model_dir, CHECKPOINT_DIR)
    partial = os.path.join(model_dir, f".{CHECKPOINT_DIR}.partial")
    started = time.monotonic()
    problem: OSError | None = None
    if dist.is_chief:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as error:
            problem = error
    _agree_written(dist, problem, final)  # also a barrier: the folder exists for every rank
    try:
        write(partial)
        took = time.monotonic() - started
        if dist.is_chief:
            with open(os.path.join(partial, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump({**state, "world_size": dist.world_size,
                           "save_seconds": round(took, 3)}, f)
    except OSError as error:
        problem = error
    try:
        _agree_written(dist, problem, final)  # every rank has written before the chief commits
    except StorageError:
        if dist.is_chief:  # what it wrote takes room the next save needs
            shutil.rmtree(partial, ignore_errors=True)
        raise
    walltime.record_save(time.monotonic() - started)  # the walltime margin follows the saves
    if not dist.is_chief:
        return None
    commit(partial, final)
    return final


def _agree_written(dist: Agreeing, problem: OSError | None, final: str) -> None:
    """One small collective: whether every rank could write; if not, every rank raises the same
    :class:`~tfdist.errors.StorageError` (the ranks that failed say why first)."""
    failed = round(dist.sum_over_ranks([1.0 if problem is not None else 0.0])[0])
    if not failed:
        return
    rank = getattr(dist, "rank", 0)
    if problem is not None:
        logger.error("tfdist: rank %d (%s) could not write in %s: %s", rank,
                     socket.gethostname(), os.path.dirname(final), problem)
    reason = (problem.strerror or str(problem)) if problem is not None else "see its line"
    older = [s["path"] for s in read_states(os.path.dirname(final))]
    kept = (f"the last complete state, {older[0]}, is kept and the next run resumes from it"
            if older else "no earlier complete state exists")
    raise StorageError(
        f"could not save the training state in {final} ({failed} rank(s) failed: {reason}). "
        f"{layout.storage_fix(problem.errno if problem is not None else None)}; {kept}")


def save_loop_state(dist: Agreeing, model_dir: str, position: dict[str, Any],
                    background: bool | None = None, **objects: Any) -> bool:
    """Saves a custom loop's state at the agreed step: call it on every rank.

    ``objects`` (a Keras model, its optimizer, a ``tf.Variable``, anything
    ``tf.train.Checkpoint`` takes) are written with one ``tf.train.Checkpoint`` by the chief
    and into a throw-away folder by the other ranks (MultiWorkerMirroredStrategy wants every
    worker to save); ``position`` (JSON: the epoch, the step, what your loop needs to go on)
    goes to ``state.json``. The folder ``model_dir/preempted`` is replaced as :func:`commit`
    does, so a kill at any moment leaves the last complete state.

    ``background`` (default: ``TFDIST_BACKGROUND_SAVES``): the step waits only for a copy of
    the values in host memory; the files are written, made durable and committed on this
    process's writer thread (:mod:`tfdist.keras.loop_saves`: Keras models, optimizers and
    variables). :func:`exit_preempted` waits for the save in flight.

    Returns:
        Whether this process wrote the state (the chief; in the background: started it).
    """
    if background if background is not None else resolve("background_saves"):
        from tfdist.keras import loop_saves

        loop_saves.saver(model_dir).save(
            dist, model_dir, position, objects, commit=commit, state_file=STATE_FILE,
            final=os.path.join(model_dir, CHECKPOINT_DIR))
        return dist.is_chief
    import tensorflow as tf

    def write(partial: str) -> None:
        folder = partial if dist.is_chief else scratch_dir(getattr(dist, "rank", 0))
        with as_given():  # routed here already: no comparison of the ranks' paths
            tf.train.Checkpoint(**_with_random_states(objects)).write(
                os.path.join(folder, "loop"))
        if folder != partial:
            shutil.rmtree(folder, ignore_errors=True)

    final = save_state(dist, model_dir, write, {**position, "loop": True})
    if final is not None:
        logger.warning("tfdist: saved the loop's state at %s in %s", position, final)
    return final is not None


def _with_random_states(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` plus the random generators' states of the Keras 2 models among them, which
    a ``tf.train.Checkpoint`` of the model leaves out (:func:`tfdist.keras.keras2.random_states`):
    Dropout then draws the same masks after a resume."""
    from tfdist.keras.keras2 import random_states

    extra = {f"{name}_random_generators": states for name, value in objects.items()
             if (states := random_states(value))}
    return {**objects, **extra}


def load_loop_state(model_dir: str | None, *, strategy_scope: Any = None,
                    **objects: Any) -> dict[str, Any] | None:
    """Restores what :func:`save_loop_state` saved into ``objects``; returns its ``position``,
    or None when ``model_dir`` holds no state (the first run). Call it on every rank, after
    the objects exist and before the first step. ``strategy_scope``: where an optimizer not
    built yet is built before a background save's values are assigned (the handle's).

    Raises:
        ConfigError: the state does not fit ``objects`` (another model or optimizer).
    """
    import tensorflow as tf

    states = [s for s in read_states(model_dir) if s.get("loop")] if model_dir else []
    damaged: list[str] = []
    restored: Any = None
    for state in states:
        try:
            if os.path.exists(os.path.join(state["path"], "variables.json")):
                from tfdist.keras import loop_saves  # a background save's

                loop_saves.restore(objects, state["path"], state.get("optimizers") or {},
                                   strategy_scope)
                break
            restored = tf.train.Checkpoint(**_with_random_states(objects)).read(
                os.path.join(state["path"], "loop"))
            restored.assert_existing_objects_matched()
        except (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError,
                IndexError) as error:  # damaged ("Read less bytes"): the state before it
            damaged.append(f"{state['path']}: {type(error).__name__}: {error}"[:300])
            continue
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise ConfigError(f"{state['path']} holds a loop state that does not fit the "
                              f"objects given ({', '.join(objects)}): {error}. Remove it to "
                              "start afresh, or build the same model and optimizer as the run "
                              "that saved it") from None
        break
    else:
        if damaged:
            newest = os.path.join(model_dir or "", CHECKPOINT_DIR)
            raise StorageError(f"the saved loop state in {model_dir} cannot be read "
                               f"({'; '.join(damaged)}), and there is no earlier complete one: "
                               f"start afresh with rm -r {newest}*")
        return None
    if damaged:
        logger.warning("tfdist: %s cannot be read (%s): resuming from the complete state before "
                       "it, %s", states[0]["path"], damaged[0], state["path"])
    walltime.record_save(state.get("save_seconds"))  # the run that saved it timed the save
    # Kept: variables made after this (an optimizer's, at its first step) are restored then,
    # through this status; once it is garbage collected, their values are dropped.
    if restored is not None:
        _restores.append(restored)
    position = {k: v for k, v in state.items()
                if k not in ("path", "loop", "world_size", "save_seconds", "optimizers",
                             "background")}
    logger.warning("tfdist: resuming the loop at %s from %s", position, state["path"])
    return position
