"""Durations as people and Slurm write them, in seconds (pure).

``tfdist launch --time-limit`` and ``TFDIST_CHECKPOINT_EVERY`` read them (:mod:`tfdist.cli`,
:mod:`tfdist.settings`); the walltime guard (:mod:`tfdist.walltime`) acts on them.
"""

from __future__ import annotations

import re

__all__ = ["as_sbatch_time", "has_unit", "parse_duration"]

_UNITS = {"s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "minute": 60,
          "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400,
          "days": 86400}
_WITH_UNIT = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+)")
_SLURM = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def parse_duration(text: str, bare: str = "s") -> float:
    """Seconds in a duration (pure): ``30s``, ``10min``, ``2h``, ``1d``, or Slurm's ``--time``
    forms ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; a bare number is in
    the unit ``bare`` (``"min"`` as for ``sbatch --time``, or ``"s"``).

    Raises:
        ValueError: not a positive duration, with the forms allowed.
    """
    word = text.strip().lower()
    found = _WITH_UNIT.fullmatch(word)
    seconds: float | None = None
    if found and found.group(2) in _UNITS:
        seconds = float(found.group(1)) * _UNITS[found.group(2)]
    elif re.fullmatch(r"\d+(?:\.\d+)?", word):
        seconds = float(word) * _UNITS[bare]
    elif slurm := _SLURM.fullmatch(word):
        days, first, second, third = slurm.groups()
        if days is not None:  # D-HH[:MM[:SS]]
            seconds = (int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60
                       + int(third or 0))
        elif third is not None:  # HH:MM:SS
            seconds = int(first) * 3600 + int(second) * 60 + int(third)
        elif second is not None:  # MM:SS
            seconds = int(first) * 60 + int(second)
    if seconds is None or seconds <= 0:
        raise ValueError(f"{text!r} is no positive duration: write 90s, 10min, 2h, 1d, or as "
                         "sbatch --time: MM:SS, HH:MM:SS, D-HH:MM:SS")
    return seconds


def has_unit(text: str) -> bool:
    """Whether ``text`` is a duration written with a unit (``90s``, ``10min``, ``2h``) (pure)."""
    found = _WITH_UNIT.fullmatch(text.strip().lower())
    return bool(found and found.group(2) in _UNITS)


def as_sbatch_time(seconds: float) -> str:
    """``seconds`` as sbatch ``--time`` writes it, rounded up to whole minutes (pure):
    ``HH:MM:00``, or ``D-HH:MM:00`` from a day on."""
    minutes = -(-round(seconds) // 60)
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"
