"""The Horovod backend: ``tfdist.init(backend="horovod")``, or auto under horovodrun/mpirun.

With Horovod, ``strategy_scope()`` does the steps of Horovod's tutorials: ``hvd.init()``, one GPU
per local rank, and from then on ``Model.compile`` averages gradients across ranks; the handle
shards data by rank (``dist.shard``), scales the learning rate (``dist.scale_lr``), and
``dist.callbacks()`` broadcasts the initial state from rank 0 and checkpoints and logs on rank 0
only; the epoch's and ``evaluate``'s metrics are over every rank's examples
(:mod:`tfdist.keras.step_results`). tf_keras (Keras 2) starts from Horovod's own broadcast callback;
Keras 3, which Horovod's Keras helpers do not support, uses tfdist's on Horovod's core ops.

For custom loops: ``dist.gradient_tape()``, ``dist.broadcast_initial_state(model, optimizer)``
and ``dist.reduce(op, value)``, or :class:`DistributedGradientTape` directly.

Importing this package loads neither Horovod nor TensorFlow; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "broadcast_variables",
           "import_horovod", "is_installed"]

_LAZY = {
    "DistributedGradientTape": "tfdist.horovod.ops",
    "broadcast_variables": "tfdist.horovod.ops",
    "DistributedOptimizer": "tfdist.horovod.fit",
    "import_horovod": "tfdist.horovod.install",
    "is_installed": "tfdist.horovod.install",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdist.horovod' has no attribute {name!r}")
