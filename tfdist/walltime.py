"""The walltime guard: training stops, saves and is requeued before the job's time runs out,
without any signal.

At its time limit Slurm sends SIGTERM to every task and srun kills them about 0.2 s later: a
script that waits for that signal saves nothing, and everything since the last epoch backup is
lost. A warning signal (``--signal=USR1@90``) gives time, but many jobs are submitted without
one. Every Slurm job has an end, which newer Slurm exports (``SLURM_JOB_END_TIME``; 22.05 does
not, in the batch shell or in a step: measured) and ``squeue`` tells, so tfdist stops in time by
itself:

1. The end (:attr:`tfdist.env.ClusterEnvironment.end_time`, :func:`end_from`, :class:`Clock`),
   first found: ``TFDIST_END_TIME`` (seconds since the epoch; ``tfdist launch --time-limit``
   sets it for each run), ``SLURM_JOB_END_TIME``, else Slurm itself (``squeue -h -o %e -j
   JOBID``). Under Slurm the chief asks Slurm again every :data:`REREAD_S` seconds, in a thread
   of its own, so that a job extended with ``scontrol update TimeLimit`` trains on.
2. The margin (:func:`margin`): ``TFDIST_WALLTIME_MARGIN`` seconds, else twice the longest save
   this process timed (or the saved state it resumed from records), plus twice the time between
   two agreements, plus :data:`EXIT_S`; at least :data:`FLOOR_S`.
3. At each agreement of :class:`tfdist.preemption.Watch` (about once a second, one small
   collective that already runs for the signals) the chief adds its time left and its margin.
   When the time left is at most the margin, every rank stops at that step, saves the same exact
   state as for a signal, exits 75, and the job is requeued where it may be.
4. Except at the run's first agreement (:func:`refusal`): a run the guard would stop there made
   no progress since it started, and every restart would stop there again. Every rank raises
   the same :class:`~tfdist.errors.ConfigError` instead, which names the margin, the time left
   and the fix; nothing is saved or requeued, and the process exits :data:`EXIT_REFUSED`, which
   ``tfdist launch --max-restarts`` does not restart. A preemption signal there is no loop: it
   is requeued as ever, unless the margin is at or above the whole time the run had.

The pure parts (:func:`end_from`, :func:`parse_squeue_end`, :func:`margin`,
:func:`refusal`) are table-tested; :class:`Clock` takes its reader and time as
arguments.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tfdist.errors import EXIT_CONFIG

if TYPE_CHECKING:
    from tfdist.env import ClusterEnvironment

__all__ = ["EXIT_REFUSED", "EXIT_S", "FLOOR_S", "REREAD_S", "SOURCES", "Clock", "clock",
           "end_from", "longest_save", "margin", "parse_squeue_end",
           "record_save", "refusal", "source_named", "source_number", "squeue_end"]

logger = logging.getLogger("tfdist")

FLOOR_S = 60.0  # the default margin at least: no save timed yet, or a fast one
EXIT_S = 10.0  # after the save: the exit handshake, `scontrol requeue`, the processes' end
REREAD_S = 300.0  # how often the chief asks Slurm for the job's end again
# What a run refused at its first agreement exits with (:func:`refusal`): the exit code of
# tfdist's own errors, EX_CONFIG. Not 75: a restart or a requeue would stop where this run did,
# again and again.
EXIT_REFUSED = EXIT_CONFIG
# Where an end can come from; the agreement carries the chief's as a number (source_number).
SOURCES = ("TFDIST_END_TIME", "SLURM_JOB_END_TIME", "squeue")
_YEAR_S = 366 * 24 * 3600.0  # an end further away than this is no limit (an "infinite" job)
_longest: list[float] = [0.0]  # the longest save this process timed, in seconds


def end_from(end: float | None, source: str | None, now: float) -> tuple[float | None, str]:
    """The end of this run as the guard takes it (pure): ``end`` (seconds since the epoch, from
    the launch: :attr:`tfdist.env.ClusterEnvironment.end_time`) and where it came from, or
    ``(None, why not)``; 0 or more than a year away is no limit."""
    if end is None:
        return None, "no TFDIST_END_TIME or SLURM_JOB_END_TIME"
    if end <= 0 or end - now > _YEAR_S:
        return None, f"{source}={end:.0f}: no time limit"
    return end, source or "?"


def parse_squeue_end(text: str) -> float | None:
    """``squeue -o %e``'s end time (local time, ``2026-11-26T14:03:00``) in seconds since the
    epoch; None for ``Unknown``, ``N/A``, ``NONE`` or anything else that is no date (pure, but
    for the local time zone)."""
    text = text.strip()
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def squeue_end(job_id: str, squeue: str | None = None, timeout_s: float = 20.0) -> float | None:
    """The job's end as Slurm has it now, or None (no squeue, no answer, no limit)."""
    squeue = squeue or shutil.which("squeue")
    if squeue is None:
        return None
    try:
        done = subprocess.run([squeue, "-h", "-o", "%e", "-j", job_id], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return parse_squeue_end(lines[0]) if done.returncode == 0 and lines else None


def margin(save_s: float, gap_s: float, override: float | None = None) -> float:
    """Seconds before the end at which training stops (pure): ``override``
    (``TFDIST_WALLTIME_MARGIN``), else twice the longest save, twice the time between two
    agreements, and :data:`EXIT_S`, at least :data:`FLOOR_S`."""
    if override is not None:
        return override
    return max(FLOOR_S, 2 * save_s + 2 * gap_s + EXIT_S)


def refusal(started: float, left: float, margin_s: float, end_from: str, margin_set: bool,
            signalled: bool = False) -> str | None:
    """Why the guard refuses a run at its first agreement (pure), or None: it trains on.

    Where the time left there is at most the margin, the guard would stop the run at its first
    agreement, and every restart (a requeued job gets the same time limit) there again: it would
    make no progress, restart after restart. So it is refused, in one line: the margin and where
    it came from, the time left and where the end came from, and the fix. A preemption signal
    at that agreement is no loop: the run stops and is requeued as ever, unless the margin is at
    or above the whole time the run had at its start.

    Args:
        started: seconds the run had left when its training began (:attr:`Clock.started`).
        left: seconds left at its first agreement.
        margin_s: the margin then (:func:`margin`).
        end_from: where the end came from (one of :data:`SOURCES`, or ``"?"``).
        margin_set: the margin is ``TFDIST_WALLTIME_MARGIN``'s, not the default.
        signalled: a rank got a preemption signal by that agreement.
    """
    if left > margin_s or (signalled and started > margin_s):
        return None
    given = ("TFDIST_WALLTIME_MARGIN" if margin_set else "the default: twice the longest save "
             "and twice the time between two agreements, plus 10 s, at least 60 s")
    limit = {"TFDIST_END_TIME": "tfdist launch --time-limit, or whatever sets TFDIST_END_TIME",
             "SLURM_JOB_END_TIME": "sbatch --time", "squeue": "sbatch --time"}.get(
                 end_from, "the job's time limit")
    longer = f"a longer time limit ({limit})"
    fix = (f"Set TFDIST_WALLTIME_MARGIN below {left:.0f} s or give the run {longer}"
           if left >= 1 else f"Give the run {longer}")
    if margin_s >= started:
        return (f"walltime: the margin, {margin_s:.0f} s ({given}), is at or above the "
                f"{started:.0f} s this run had left when its training began (its end from "
                f"{end_from}): the walltime guard would stop every run at its first step and "
                f"start it again, without end; refused, nothing saved or requeued. {fix}")
    return (f"walltime: this run made no progress since its last start: {left:.0f} s were left "
            f"at its first step (its end from {end_from}), within the margin, {margin_s:.0f} s "
            f"({given}), of the {started:.0f} s it had when its training began, and every "
            f"restart would stop there again; refused, nothing saved or requeued. {fix}")


def source_number(source: str) -> float:
    """``source`` (where an end came from) as the agreement carries it: its place in
    :data:`SOURCES` from 1, else 0 (pure)."""
    return float(SOURCES.index(source) + 1) if source in SOURCES else 0.0


def source_named(number: float) -> str:
    """The source :func:`source_number` made ``number`` of, or ``"?"`` (pure)."""
    index = round(number) - 1
    return SOURCES[index] if 0 <= index < len(SOURCES) else "?"


def record_save(seconds: float | None) -> None:
    """Notes how long a save of the training state took (tfdist's exact saves, the epoch
    backups, and the time a resumed state records)."""
    if seconds is not None and seconds >= 0:
        _longest[0] = max(_longest[0], float(seconds))


def longest_save() -> float:
    """The longest save this process knows of, in seconds (0 before the first)."""
    return _longest[0]


class Clock:
    """The end of this run, as the chief follows it.

    Args:
        end: seconds since the epoch, or None (no limit known yet).
        source: where ``end`` came from, for the log line.
        reread: asks for the end again (Slurm's), or None; called in a thread of its own, first
            at :meth:`start` and then every ``every`` seconds.
        now: the clock (``time.time``).

    Attributes:
        started: when the clock was made (``now()``): the first watch of the process makes it,
            as training begins.
    """

    def __init__(self, end: float | None, source: str,
                 reread: Callable[[], float | None] | None = None, every: float = REREAD_S,
                 now: Callable[[], float] = time.time) -> None:
        self.end, self.source = end, source
        self._reread, self._every, self._now = reread, every, now
        self.started = now()  # the run's start as the guard knows it: its training's
        self._first = True  # no agreement has asked yet (take_first)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def left(self) -> float | None:
        """Seconds until the end, or None without one."""
        return None if self.end is None else self.end - self._now()

    def left_at_start(self) -> float | None:
        """Seconds the run had when this clock was made (until the end as known now), or None
        without an end."""
        return None if self.end is None else self.end - self.started

    def take_first(self) -> bool:
        """True at the first call only: the run's first agreement, where the guard refuses a
        margin that leaves the run no time (:func:`refusal`); never again later."""
        first, self._first = self._first, False
        return first

    def start(self) -> None:
        """Starts re-reading the end, if there is a reader (once)."""
        if self._reread is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._follow, name="tfdist-walltime", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        while True:
            assert self._reread is not None
            with contextlib.suppress(Exception):  # a failed query keeps the end known
                found = self._reread()
                if found is not None and found != self.end:
                    if self.end is not None:
                        logger.warning("tfdist: the job's end moved by %+.0f s (now %s): the "
                                       "walltime guard follows it", found - self.end,
                                       _local(found))
                    self.end, self.source = found, "squeue"
            if self._stop.wait(self._every):
                return


def _local(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).isoformat(timespec="seconds")


_clock: list[Clock] = []  # this process's, made once


def clock(environment: ClusterEnvironment) -> Clock:
    """This process's clock, made at the first call: the end the launch gives and, for a Slurm
    job whose end is not ``TFDIST_END_TIME``, Slurm's answer at once and every
    :data:`REREAD_S` seconds once :meth:`Clock.start` runs."""
    if _clock:
        return _clock[0]
    end, source = end_from(environment.end_time, environment.end_time_from, time.time())
    job = environment.job_id
    follow = job is not None and environment.end_time_from != "TFDIST_END_TIME"
    reread = (lambda: squeue_end(job)) if follow and job and shutil.which("squeue") else None
    _clock.append(Clock(end, source, reread))
    return _clock[0]
