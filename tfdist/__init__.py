"""tfdist: data-parallel Keras training from one GPU to many Slurm nodes.

    from tfdist import strategy_scope

    with strategy_scope() as dist:   # first thing in main(): before any TensorFlow op
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(dist.scale_lr(1e-3)), ...)
    model.fit(dist.shard(train_ds), callbacks=dist.callbacks(model_dir=...), ...)

Importing tfdist loads no TensorFlow, Horovod or torch; they load when ``init`` runs.
"""

from __future__ import annotations

from tfdist import autostart as _autostart
from tfdist import uncaught as _uncaught
from tfdist.env import ClusterEnvironment, detect
from tfdist.errors import (
    ConfigError,
    InitOrderError,
    LaunchError,
    ReplicaMismatchError,
    TfdistError,
)
from tfdist.scratch import per_rank_files
from tfdist.strategy import Distributed, current, init, strategy_scope

__all__ = [
    "ClusterEnvironment",
    "ConfigError",
    "Distributed",
    "InitOrderError",
    "LaunchError",
    "ReplicaMismatchError",
    "TfdistError",
    "__version__",
    "current",
    "detect",
    "init",
    "per_rank_files",
    "strategy_scope",
]

# A multi-process launch whose first TensorFlow op comes before strategy_scope() starts tfdist
# there (tfdist.autostart: nothing is imported now).
_autostart.arm()
# tfdist's own errors, uncaught: one line, once, exit code 78 (tfdist.uncaught).
_uncaught.install()

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("tfdist")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
