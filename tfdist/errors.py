"""The errors tfdist raises. Each message says what went wrong and how to fix it."""

from __future__ import annotations

__all__ = ["EXIT_CONFIG", "TfdistError", "LaunchError", "InitOrderError", "ConfigError",
           "ReplicaMismatchError", "StorageError"]

# The exit code of a process ended by one of these errors (tfdist.uncaught): EX_CONFIG from
# sysexits.h. Not retried by `tfdist launch --max-restarts` or a Slurm requeue: a run started
# again would stop at the same place.
EXIT_CONFIG = 78


class TfdistError(RuntimeError):
    """Base class of every error tfdist raises on purpose."""


class LaunchError(TfdistError):
    """The processes were not launched in a way tfdist can run distributed.

    For example the script runs in the sbatch shell of a multi-task job instead of under srun.
    """


class InitOrderError(TfdistError):
    """TensorFlow was initialised before tfdist could configure the distribution strategy."""


class ConfigError(TfdistError, ValueError):
    """An argument, flag or ``TFDIST_*`` environment variable has an impossible value."""


class ReplicaMismatchError(TfdistError):
    """Ranks hold different weights: data-parallel training is no longer training one model.

    Raised on every rank together by the replica sync check (:mod:`tfdist.sync`); the message
    names the ranks and variables that differ from rank 0.
    """


class StorageError(TfdistError):
    """``model_dir`` cannot be written or read as training needs: read-only, full, not seen by
    every rank, held by another run, or holding a damaged or foreign save. Raised on every rank
    together; the message names the folder, what is wrong and the fix."""
