"""Keras callbacks for distributed training: one writer, per-worker backups, LR warmup.

Imported only after :func:`tfdist.init`, when ``tf.keras`` resolves to Keras 3 or, with
``TF_USE_LEGACY_KERAS=1``, to tf_keras; the classes below subclass whichever it is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import keras_compat, sync

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["ChiefOnly", "AtomicCheckpoint", "LearningRateWarmup", "WorkerBackupAndRestore",
           "build"]

keras: Any = tf.keras  # Keras 3 or tf_keras, known only at run time
logger = logging.getLogger("tfdist")
_KERAS3 = keras_compat.is_keras3(keras)


class ChiefOnly(keras.callbacks.Callback):
    """Runs ``callback`` on the chief only (TensorBoard, CSV logs, checkpoints...).

    Safe under MultiWorkerMirroredStrategy: saving and logging read local values and run no
    collective, so the other workers do not wait for the chief.
    """

    def __init__(self, callback: Any, is_chief: bool) -> None:
        super().__init__()
        self.callback, self.is_chief = callback, is_chief

    # Forwarded on the chief only: Keras's TensorBoard.set_model already writes the graph.
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        if self.is_chief:
            self.callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        if self.is_chief:
            self.callback.set_params(params)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and not object.__getattribute__(self, "is_chief"):
            return lambda *args, **kwargs: None
        if name.startswith("on_"):
            return getattr(object.__getattribute__(self, "callback"), name)
        return object.__getattribute__(self, name)


class AtomicCheckpoint(keras.callbacks.Callback):
    """Saves the whole model (``.keras``) at each epoch end, atomically.

    The file is written under a temporary name and renamed, so a job killed mid-save leaves the
    previous checkpoint loadable.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        if not path.endswith(".keras"):
            raise ValueError(f"checkpoint path {path!r} must end with '.keras'")
        self.path = path

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        partial = os.path.join(os.path.dirname(self.path),
                               f".partial-{os.path.basename(self.path)}")
        self.model.save(partial)
        os.replace(partial, self.path)


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate from ``lr / size`` up to the (scaled) ``lr`` the optimizer has.

    Goyal et al. (2017): with linear scaling by the number of replicas, start at the
    single-replica rate and reach the scaled rate after ``warmup_epochs`` epochs.
    """

    def __init__(self, warmup_epochs: float, size: int) -> None:
        super().__init__()
        self.warmup_epochs, self.size = warmup_epochs, size
        self.target: float | None = None
        self._epoch = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self.target = float(keras.backend.get_value(self.model.optimizer.learning_rate))

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if not self.params.get("steps"):
            self._set(epoch)  # steps per epoch unknown: warm up once per epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        steps = self.params.get("steps")
        if steps:
            self._set(self._epoch + batch / steps)

    def _set(self, progress_epochs: float) -> None:
        assert self.target is not None
        fraction = min(1.0, progress_epochs / self.warmup_epochs) if self.warmup_epochs else 1.0
        start = self.target / self.size
        self.model.optimizer.learning_rate.assign(start + (self.target - start) * fraction)


class _SilentProgbar(keras.callbacks.ProgbarLogger):
    """Stands in for Keras's progress bar on non-chief workers, so only the chief prints."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        return object.__getattribute__(self, name)


if _KERAS3:

    class WorkerBackupAndRestore(keras.callbacks.BackupAndRestore):
        """Keras 3's BackupAndRestore with one directory per rank.

        Keras 3's callback is not multi-worker aware: two workers writing one directory race
        (FileExistsError) and abort the collectives. Each rank writes ``backup_dir/rank-N``; a
        rank with no backup of its own (the job grew) restores from rank 0's, so every worker
        resumes from the same state.
        """

        _weights_path: str  # set by Keras's BackupAndRestore
        _training_metadata_path: str

        def __init__(self, backup_dir: str, rank: int, **kwargs: Any) -> None:
            self.root = backup_dir
            super().__init__(os.path.join(backup_dir, f"rank-{rank}"), double_checkpoint=True,
                             **kwargs)

        def on_train_begin(self, logs: Any = None) -> None:
            chief = os.path.join(self.root, "rank-0")
            if os.path.exists(self._weights_path) or not os.path.exists(
                    os.path.join(chief, "latest.weights.h5")):
                return super().on_train_begin(logs)
            own = self._weights_path, self._training_metadata_path
            self._weights_path = os.path.join(chief, "latest.weights.h5")
            self._training_metadata_path = os.path.join(chief, "training_metadata.json")
            try:
                self._load_model()  # read-only: never writes into rank 0's directory
            finally:
                self._weights_path, self._training_metadata_path = own

        def on_train_end(self, logs: Any = None) -> None:
            super().on_train_end(logs)
            if self.delete_checkpoint and os.path.isdir(self.root) and not os.listdir(self.root):
                shutil.rmtree(self.root, ignore_errors=True)

else:

    def WorkerBackupAndRestore(  # type: ignore[no-redef]  # noqa: N802
            backup_dir: str, rank: int, **kwargs: Any) -> Any:
        """tf_keras's BackupAndRestore already writes one directory per worker."""
        return keras.callbacks.BackupAndRestore(backup_dir, **kwargs)


def _tensorboard_installed(dist: Distributed) -> bool:
    # Keras writes summaries through the tensorboard package; without it the first summary
    # raises mid-epoch on the chief alone and the other workers' collectives abort.
    if importlib.util.find_spec("tensorboard") is not None:
        return True
    if dist.is_chief:
        logger.warning("tfdist: TensorBoard logs are off: the `tensorboard` package is not "
                       "installed (pip install tensorboard, or callbacks(tensorboard=False))")
    return False


def build(dist: Distributed, *extra: Any, model_dir: str | None = None, checkpoint: bool = True,
          tensorboard: bool = True, backup: bool = True, warmup_epochs: float = 0,
          chief_only: tuple[Any, ...] = (), sync_check: bool | None = None,
          sync_check_every: int | None = None) -> list[Any]:
    """Callbacks for ``model.fit`` that behave on any number of workers.

    Args:
        dist: the handle from :func:`tfdist.init`.
        *extra: your callbacks, run on every worker.
        model_dir: where outputs go; without it only warmup, progress and ``extra`` are set up.
        checkpoint: save ``model_dir/checkpoint.keras`` after each epoch (chief only, atomic).
        tensorboard: write TensorBoard logs to ``model_dir/logs`` (chief only).
        backup: BackupAndRestore in ``model_dir/backup`` (per rank) to resume after preemption.
        warmup_epochs: ramp the learning rate up from ``lr / size`` over this many epochs.
        chief_only: more callbacks to run on the chief only.
        sync_check: compare the weights of all ranks after the first step and at the end of
            training, and stop with ReplicaMismatchError naming the ranks that differ
            (:class:`tfdist.sync.ReplicaSyncCheck`); env ``TFDIST_SYNC_CHECK`` (1/0), default on.
        sync_check_every: also check every N steps; env ``TFDIST_SYNC_CHECK_EVERY``.

    Returns:
        The list to pass as ``fit(callbacks=...)``. On non-chief workers it includes a silent
        progress bar, so only the chief prints progress whatever ``verbose`` is.
    """
    # The backend's own first (Horovod: broadcast from rank 0, then metric averaging, which
    # must run before anything reads the epoch's logs).
    callbacks: list[Any] = list(dist.backend_callbacks())
    if model_dir and backup:
        callbacks.append(WorkerBackupAndRestore(os.path.join(model_dir, "backup"), dist.rank))
    if warmup_epochs:
        callbacks.append(LearningRateWarmup(warmup_epochs, dist.num_replicas))
    callbacks += extra
    check = sync.sync_check_callback(dist, sync_check, sync_check_every)
    callbacks += [check] if check is not None else []  # after `extra`: it sees their changes
    writers = list(chief_only)
    if model_dir and checkpoint:
        writers.append(AtomicCheckpoint(os.path.join(model_dir, "checkpoint.keras")))
    if model_dir and tensorboard and _tensorboard_installed(dist):
        writers.append(keras.callbacks.TensorBoard(os.path.join(model_dir, "logs")))
    callbacks += [ChiefOnly(writer, dist.is_chief) for writer in writers]
    if not dist.is_chief:
        callbacks.append(_SilentProgbar())
    return callbacks
