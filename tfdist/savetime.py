"""Does a save of this run's state fit the time the run has to make it?

A run saves its exact state in three places, each with its own time: at a preemption signal,
in the seconds before the kill (``--signal=USR1@N``'s N, a partition's GraceTime:
``TFDIST_SIGNAL_LEAD``); before the walltime, within the margin (``TFDIST_WALLTIME_MARGIN``,
whose default follows the saves timed); and every ``TFDIST_CHECKPOINT_EVERY``, between two
of which training goes on. A save longer than the first loses everything since the last
complete save (srun kills the tasks mid-write); longer than the interval, training waits for
saves more than it trains. :func:`problems` names each in one line with its fix, from a save's
seconds: the first save's, measured (``fit``'s preemption callback says it once), or an
estimate from the state's size and the bandwidth :func:`measure_mb_per_s` measures in
model_dir (``tfdist doctor --model-dir``).

:func:`estimate_s`, :func:`needed_lead_s` and :func:`problems` are pure and table-tested.
"""

from __future__ import annotations

import json
import math
import os
import time

__all__ = ["SAMPLE_MB", "estimate_s", "measure_mb_per_s", "needed_lead_s", "problems",
           "recorded_s", "state_bytes"]

SAMPLE_MB = 64  # what the doctor writes to measure model_dir's bandwidth
EXIT_S = 10.0  # after the save: the agreement before it, the commit and the exit


def estimate_s(size_bytes: int, mb_per_s: float) -> float:
    """Seconds to write ``size_bytes`` at ``mb_per_s`` (pure)."""
    return size_bytes / 1e6 / mb_per_s if mb_per_s > 0 else math.inf


def needed_lead_s(save_s: float) -> int:
    """The lead time a save of ``save_s`` seconds needs (pure): the save twice over (the
    storage is slower some days) and :data:`EXIT_S`, in whole seconds."""
    return math.ceil(2 * save_s + EXIT_S)


def problems(save_s: float, *, lead_s: float | None = None, margin_s: float | None = None,
             every_s: float | None = None, background: bool = False) -> list[tuple[str, str]]:
    """What a save of ``save_s`` seconds does not fit, each as (what, fix) (pure).

    Args:
        save_s: the save's seconds (measured or estimated).
        lead_s: the seconds between the signal and the kill (``TFDIST_SIGNAL_LEAD``), or None.
        margin_s: the walltime margin where it is set by hand (the default follows the saves).
        every_s: ``TFDIST_CHECKPOINT_EVERY``'s seconds, or None.
        background: saves are written in the background (``TFDIST_BACKGROUND_SAVES=1``).
    """
    needed, found = needed_lead_s(save_s), []
    faster = ("" if background else ", or TFDIST_BACKGROUND_SAVES=1 (the final save then "
              "writes the state's raw bytes, several times faster)")
    if lead_s is not None and needed > lead_s:
        found.append((f"a save of this run's state takes {save_s:.1f} s: with the {lead_s:.0f} s "
                      f"between the signal and the kill (TFDIST_SIGNAL_LEAD) the final save may "
                      f"not end before the kill, and the run would lose what it trained since "
                      f"its last complete save",
                      f"signal at least {needed} s before the end (sbatch --signal=USR1@{needed}; "
                      f"signal: USR1@{needed} in a tfdist job config), or save to faster "
                      f"storage{faster}"))
    if margin_s is not None and needed > margin_s:
        found.append((f"a save of this run's state takes {save_s:.1f} s, and the walltime "
                      f"margin (TFDIST_WALLTIME_MARGIN) is {margin_s:.0f} s: the save before the "
                      f"time limit may not end in time",
                      f"set TFDIST_WALLTIME_MARGIN to at least {needed} s, or leave it unset "
                      "(its default follows the saves timed)"))
    if every_s is not None and save_s > every_s / 2:
        waits = ("each save waits for the one before it" if background
                 else "training stops for each save")
        found.append((f"a save of this run's state takes {save_s:.1f} s, and one is made every "
                      f"{every_s:g} s (TFDIST_CHECKPOINT_EVERY): {waits}, so the run spends "
                      "much of its time saving",
                      f"set TFDIST_CHECKPOINT_EVERY to {math.ceil(max(4 * save_s, 60))}s or "
                      f"more, or save to faster storage{faster}"))
    return found


def measure_mb_per_s(folder: str, mb: int = SAMPLE_MB) -> float:
    """The bandwidth of writes into ``folder`` as a save makes them: ``mb`` MB written (with
    direct I/O where the file system takes it), made durable, and removed."""
    from tfdist.keras.snapshot import host_buffer, write_bytes

    data = host_buffer(mb << 20)
    path = os.path.join(folder, f".tfdist-bandwidth-{os.getpid()}")
    started = time.monotonic()
    try:
        write_bytes(path, memoryview(data))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        took = time.monotonic() - started
    finally:
        data.close()
        if os.path.exists(path):
            os.unlink(path)
    return (mb << 20) / 1e6 / max(took, 1e-6)


def _last_save(model_dir: str) -> str | None:
    from tfdist import preemption

    for name in (preemption.CHECKPOINT_DIR, f"{preemption.CHECKPOINT_DIR}.old"):
        folder = os.path.join(model_dir, name)
        if os.path.isdir(folder):
            return folder
    return None


def state_bytes(model_dir: str) -> int | None:
    """The size of the last complete save in ``model_dir`` (its files), or None without one."""
    folder = _last_save(model_dir)
    if folder is None:
        return None
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(folder) for f in files)


def recorded_s(model_dir: str) -> float | None:
    """How long the last complete save in ``model_dir`` took, as the run that made it timed
    it (its ``state.json``), or None."""
    folder = _last_save(model_dir)
    try:
        with open(os.path.join(folder or "", "state.json"), encoding="utf-8") as f:
            found = json.load(f).get("save_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return float(found) if isinstance(found, (int, float)) else None
