"""What tfdist writes into a training's ``model_dir``, named in one place (pure).

``dist.callbacks(model_dir=...)`` (:func:`tfdist.callbacks.build`) and the preemption
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
      throughput.jsonl      the throughput meter's line per epoch (the chief)
"""

from __future__ import annotations

import os

__all__ = ["BACKUP", "CHECKPOINT", "LOGS", "PREEMPTED", "THROUGHPUT", "path"]

CHECKPOINT = "checkpoint.keras"
BACKUP = "backup"
LOGS = "logs"
PREEMPTED = "preempted"
THROUGHPUT = "throughput.jsonl"


def path(model_dir: str | os.PathLike[str], name: str) -> str:
    """``model_dir/name``, for one of this module's names."""
    return os.path.join(os.fspath(model_dir), name)
