"""``tfdist doctor --model-dir D``: is ``D`` one folder every rank can write and sees?

Each rank writes a small mark, ``D/.tfdist-doctor-KEY-rank-R`` (``KEY`` names this launch: the
same on every rank, another for the next launch), before the meeting, and removes it at its
exit; a rank that cannot write there reports it as its own error. At the meeting, once every
rank has written, rank 0 reads each rank's mark: one it cannot read means that rank's ``D`` is
another folder (node-local scratch at the same path) and training would stop there
(:mod:`tfdist.ownership`). Rank 0 also says whether a live run holds ``D``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Sequence

from tfdist import ownership, savetime, settings
from tfdist.doctor.report import Problem, RankReport, model_dir_problems
from tfdist.env import ClusterEnvironment

__all__ = ["leave", "mark_path", "problems", "save_time"]


def mark_path(model_dir: str, environment: ClusterEnvironment, rank: int) -> str:
    """Where rank ``rank`` of this launch leaves its mark."""
    launch = "|".join([environment.job_id or "", environment.step_id or "",
                       environment.coordinator or "", *environment.worker_addresses[:1]])
    key = hashlib.blake2b(launch.encode(), digest_size=6).hexdigest()
    return os.path.join(model_dir, f".tfdist-doctor-{key}-rank-{rank}")


def leave(mine: RankReport, environment: ClusterEnvironment, model_dir: str) -> RankReport:
    """Writes this rank's mark into ``model_dir`` (removed at exit); ``mine`` with an error
    added when it cannot."""
    path = mark_path(model_dir, environment, mine.rank)
    try:
        os.makedirs(model_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{mine.rank} {mine.host}\n")
    except OSError as error:
        return dataclasses.replace(mine, errors=(*mine.errors, (
            f"cannot write in model_dir {model_dir}: {error.strerror or error}. Fix: point "
            "model_dir at a folder this job can write, on a file system every node mounts")))
    atexit.register(_remove, path)
    return mine


def problems(reports: Sequence[RankReport], environment: ClusterEnvironment,
             model_dir: str) -> list[Problem]:
    """Rank 0's checks of ``model_dir``: every rank's mark read, and no live run holding it."""
    visible = {report.rank: os.path.exists(mark_path(model_dir, environment, report.rank))
               for report in reports if not report.errors}
    found = model_dir_problems(reports, visible, model_dir)
    held = ownership.held_by_another(model_dir, environment)
    if held:
        found.append(Problem(None, "", held, "train in another model_dir, or end that run "
                             "first", "warning"))
    return found


def save_time(model_dir: str, measure: bool = True) -> tuple[str, list[Problem]]:
    """Rank 0's save-time budget: ``model_dir``'s write bandwidth, measured as a save writes
    (:func:`tfdist.savetime.measure_mb_per_s`), what the last save there would take, and the
    limits (``TFDIST_SIGNAL_LEAD``, ``TFDIST_WALLTIME_MARGIN``, ``TFDIST_CHECKPOINT_EVERY``)
    that time does not fit, as warnings with the fix."""
    try:
        rate = savetime.measure_mb_per_s(model_dir) if measure else 0.0
    except OSError as error:
        return "", [Problem(None, "", f"cannot measure the writes into model_dir {model_dir}: "
                            f"{error.strerror or error}", "point model_dir at a folder this "
                            "job can write", "warning")]
    line = (f"model_dir {model_dir} takes {rate:.0f} MB/s ({savetime.SAMPLE_MB} MB written as a "
            "save writes, made durable)")
    size = savetime.state_bytes(model_dir)
    if size is None or rate <= 0:
        return line + "; no save there yet to time", []
    seconds = savetime.estimate_s(size, rate)
    took = savetime.recorded_s(model_dir)  # Keras's own file writes slower than the disk
    timed = f" (it took {took:.1f} s when it was made)" if took is not None else ""
    seconds = max(seconds, took or 0.0)
    found = savetime.problems(
        seconds, lead_s=settings.resolve("signal_lead"),
        margin_s=settings.resolve("walltime_margin"),
        every_s=settings.resolve("checkpoint_every"),
        background=bool(settings.resolve("background_saves")))
    line += (f": the last save there, {size / 1e6:.0f} MB, would take about {seconds:.1f} s"
             f"{timed}")
    return line, [Problem(None, "", what, fix, "warning") for what, fix in found]


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
