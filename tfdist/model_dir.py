"""What tfdist writes into a training's ``model_dir``, named in one place (pure).

``dist.callbacks(model_dir=...)`` (:func:`tfdist.keras.callbacks.build`) and the preemption
checkpoint (:mod:`tfdist.preemption`) write these; a user's own files (``final.keras`` in the
examples) sit beside them::

    model_dir/
      checkpoint.keras      the chief's model after every epoch, replaced atomically
      backup/               BackupAndRestore's state of the last epoch, per rank, only where
                            tfdist cannot follow fit's input (else preempted/ does it)
      logs/                 TensorBoard's event files (the chief)
      preempted/            the exact state every rank saved at the agreed step of a
                            preemption, a safety save or an epoch's end: the model and
                            optimizer, each rank's random generators, the input's position;
                            removed when a fit ends
      preempted.old/        the complete state before it, kept until the next is committed:
                            a resume falls back to it when preempted/ cannot be read
      throughput.jsonl      the throughput meter's line per epoch (the chief)
      tfdist.lock           which run holds the folder (:mod:`tfdist.ownership`): one run at
                            a time, and the file every rank reads to show it sees the folder

A model's *fingerprint* (:func:`difference`) goes with each saved state, so that a resume from a
save of another model is refused with one line instead of half-loading it.
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = ["BACKUP", "CHECKPOINT", "LOCK", "LOGS", "PREEMPTED", "THROUGHPUT", "difference",
           "path", "storage_fix"]

CHECKPOINT = "checkpoint.keras"
BACKUP = "backup"
LOGS = "logs"
PREEMPTED = "preempted"
THROUGHPUT = "throughput.jsonl"
LOCK = "tfdist.lock"


def path(model_dir: str | os.PathLike[str], name: str) -> str:
    """``model_dir/name``, for one of this module's names."""
    return os.path.join(os.fspath(model_dir), name)


def difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How the model that wrote a state differs from the one resuming it (pure), or None.

    A fingerprint is ``{"weights": [[shape...], ...], "dtypes": [...], "optimizer": name}``: the
    shapes and types of the model's weights in order (not their names, which Keras numbers by
    creation order), and the optimizer's class.
    """
    before, after = saved.get("weights"), now.get("weights")
    if before is not None and after is not None:
        if len(before) != len(after):
            return f"it has {len(after)} weights, the saved model {len(before)}"
        for index, (was, shape) in enumerate(zip(before, after, strict=True)):
            if list(was) != list(shape):
                return (f"weight {index} is {_shape(shape)}, the saved model's "
                        f"{_shape(was)}")
    types_before, types_after = saved.get("dtypes"), now.get("dtypes")
    if (types_before is not None and types_after is not None and types_before != types_after
            and len(types_before) == len(types_after)):
        index = next(i for i, (a, b) in enumerate(zip(types_before, types_after, strict=False))
                     if a != b)
        return (f"weight {index} is {types_after[index]}, the saved model's "
                f"{types_before[index]}")
    if saved.get("optimizer") and now.get("optimizer") and saved["optimizer"] != now["optimizer"]:
        return f"its optimizer is {now['optimizer']}, the saved model's {saved['optimizer']}"
    return None


def _shape(shape: Any) -> str:
    return "x".join(str(d) for d in shape) if len(shape) else "a scalar"


def storage_fix(code: int | None) -> str:
    """What to do about a failed write in ``model_dir``, by its ``errno`` (pure)."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ("Free space there (or raise the quota), or point model_dir at a file system "
                "with room for two saves")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "Point model_dir at a folder this job can write, on a file system every node mounts"
    return "Check the file system model_dir is on (mounted, healthy, the same on every node)"
