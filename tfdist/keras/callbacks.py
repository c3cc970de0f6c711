"""Keras callbacks for distributed training: one writer, per-worker backups, LR warmup.

One writer without collective mismatches. Under MultiWorkerMirroredStrategy a save can run
collectives: tf_keras reads its metrics (sync-on-read variables) through an all-reduce, and
Keras 3 may create an optimizer variable during the first save, which under the strategy's scope
is broadcast from the chief. A save on the chief alone then leaves the others one collective
behind, and the job dies later with "Shape mismatch in the collective instance". So file writers
(checkpoints, TensorBoard, CSV logs) run on every rank (:class:`ChiefWrites`): the chief writes
the real path, the others write into a private scratch directory that is removed again. Under
Horovod and for one process a save runs no collective, and the writers run on the chief only.

Imported only after :func:`tfdist.init`, when ``tf.keras`` resolves to Keras 3 or, with
``TF_USE_LEGACY_KERAS=1``, to tf_keras; the classes below subclass whichever it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import failures, ownership, sync, walltime
from tfdist import model_dir as layout
from tfdist.errors import StorageError
from tfdist.keras import batch_statistics, fit_preemption, input_position, input_wait, versions
from tfdist.scratch import as_given, save_atomically, save_once, scratch_dir
from tfdist.settings import resolve
from tfdist.throughput import StepMeter, throughput_file

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["AtomicCheckpoint", "CallbackOptions", "ChiefOnly", "ChiefWrites", "LearningRateWarmup",
           "PerRankFiles", "PreemptionCheckpoint", "ThroughputMeter", "WorkerBackupAndRestore",
           "build", "route_writer", "save", "saves_model", "scratch_dir"]

keras: Any = tf.keras  # Keras 3 or tf_keras, known only at run time
logger = logging.getLogger("tfdist")
_KERAS3 = versions.is_keras3(keras)


class ChiefOnly(keras.callbacks.Callback):
    """Runs ``callback`` on the chief only; on the other ranks its hooks do nothing.

    For callbacks that run no collective (notifications, your own logs). File writers that
    may save a model belong in :class:`ChiefWrites`, which :func:`build` picks for the ones
    it knows.
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


# The attribute that holds each known writer's output path. tf_keras's TensorBoard and
# ModelCheckpoint derive their real paths from these in set_model or at save time.
_PATHS = {"AtomicCheckpoint": "path", "ModelCheckpoint": "filepath", "CSVLogger": "filename",
          "TensorBoard": "log_dir"}


def _keeps_logs_open(callback: Any) -> bool:
    """TensorBoard and CSVLogger (also wrapped by ChiefOnly or ChiefWrites)."""
    inner = callback.callback if isinstance(callback, (ChiefOnly, ChiefWrites)) else callback
    return any(cls.__name__ in ("TensorBoard", "CSVLogger") for cls in type(inner).__mro__)


def _path_attribute(callback: Any) -> str | None:
    for cls in type(callback).__mro__:
        if cls.__name__ in _PATHS:
            return _PATHS[cls.__name__]
    return None


class _Forwarding(keras.callbacks.Callback):
    """Holds ``callback`` and hands it the model and the params, as Keras hands them here."""

    def __init__(self, callback: Any) -> None:
        super().__init__()
        self.callback = callback

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self.callback.set_params(params)


class ChiefWrites(_Forwarding):
    """Runs a file-writing callback on every rank; only the chief's files are kept.

    On the chief ``callback`` runs unchanged. On the other ranks its output path points into a
    private scratch directory (:func:`scratch_dir`), emptied after each epoch and removed at the
    end of training, so every rank runs the same saves (and their collectives) while only the
    chief's land. Knows tfdist's :class:`AtomicCheckpoint` and Keras's ``ModelCheckpoint``,
    ``CSVLogger`` and ``TensorBoard`` (and their subclasses).

    Args:
        callback: the writer.
        rank: this process's rank.

    Raises:
        ValueError: ``callback`` is not a writer this class knows.
    """

    def __init__(self, callback: Any, rank: int) -> None:
        attribute = _path_attribute(callback)
        if attribute is None:
            raise ValueError(f"ChiefWrites does not know where {type(callback).__name__} "
                             f"writes; it knows {sorted(_PATHS)}")
        super().__init__(callback)
        self.rank = rank
        self.scratch: str | None = None
        if rank != 0:
            self.scratch = scratch_dir(rank)
            target = getattr(callback, attribute)
            setattr(callback, attribute, os.path.join(self.scratch, os.path.basename(
                str(target).rstrip("/")) or "out"))

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name not in ("on_epoch_end", "on_train_end"):
            hook = getattr(object.__getattribute__(self, "callback"), name)
            # The chief's saves go through tfdist.keras.writers (atomic); the others' already point
            # into their scratch folder, where they are written as given.
            return _as_given(hook) if object.__getattribute__(self, "scratch") else hook
        return object.__getattribute__(self, name)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        with as_given() if self.scratch else contextlib.nullcontext():
            self.callback.on_epoch_end(epoch, logs)
        if self.scratch and isinstance(self.callback, (AtomicCheckpoint,
                                                      keras.callbacks.ModelCheckpoint)):
            _empty(self.scratch)  # checkpoints may be large; logs stay open until the end

    def on_train_end(self, logs: Any = None) -> None:
        try:
            with as_given() if self.scratch else contextlib.nullcontext():
                self.callback.on_train_end(logs)
        finally:
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)


def _as_given(hook: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with as_given():
            return hook(*args, **kwargs)

    return run


class PerRankFiles(_Forwarding):
    """Runs ``callback`` on every rank with its saves written where it says
    (:func:`tfdist.scratch.as_given`): for a writer whose paths are this rank's own (a Keras 3
    ``BackupAndRestore`` moved to ``backup_dir/rank-N``)."""

    def __init__(self, callback: Any, root: str | None = None) -> None:
        super().__init__(callback)
        self.root = root

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name != "on_train_end":
            return _as_given(getattr(object.__getattribute__(self, "callback"), name))
        return object.__getattribute__(self, name)

    def on_train_end(self, logs: Any = None) -> None:
        with as_given():
            self.callback.on_train_end(logs)
        if self.root and getattr(self.callback, "delete_checkpoint", False):
            with contextlib.suppress(OSError):  # another rank's folder is still there, or gone
                os.rmdir(self.root)  # as Keras removes its backup_dir in one process


def _empty(folder: str) -> None:
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


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
        try:
            save_atomically(self.model, self.path)
        except OSError as error:  # the previous checkpoint stays (the write was to a new name)
            raise StorageError(
                f"could not write the epoch's checkpoint {self.path}: "
                f"{error.strerror or error}. {layout.storage_fix(error.errno)}; the previous "
                "checkpoint, if any, is kept") from None


def save(dist: Distributed, model: Any, path: str) -> bool:
    """Saves ``model`` to ``path`` once, from the chief, atomically: any path ``model.save``
    takes (``.keras``; ``.h5``; with tf_keras a SavedModel folder, which replaces the old one).

    Call it on every rank: where a save runs collectives (MultiWorkerMirroredStrategy) the
    other ranks save into a scratch directory that is removed at once, so that every rank runs
    the same collectives (:func:`tfdist.scratch.save_once`); then every rank waits until the
    chief's file is in place (one small collective), so that a load right after it finds the
    file on every rank of a shared file system.

    Returns:
        Whether this process wrote ``path``.
    """
    wrote = save_once(dist.is_chief, dist.rank, dist.save_on_every_rank, model, path)
    if dist.world_size > 1:
        dist.sum_over_ranks([0.0])  # the chief's file is complete before any rank returns
    return wrote


class PreemptionCheckpoint(fit_preemption.PreemptionCallback, keras.callbacks.Callback):
    """:class:`tfdist.keras.fit_preemption.PreemptionCallback` as a ``tf.keras`` callback: after a
    preemption signal or at the walltime, every rank stops at one agreed step, the exact state
    is saved in ``model_dir/preempted``, the process exits with 75, and the next ``fit`` with
    the same ``model_dir`` resumes there."""


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
        optimizer = self.model.optimizer
        schedule = getattr(optimizer, "_learning_rate", None)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            # It sets the rate every step: Keras 3 fails on the rate it returns, tf_keras
            # overwrites the warmup's. The same answer on every rank, before any step.
            from tfdist.errors import ConfigError

            raise ConfigError(
                f"dist.callbacks(warmup_epochs=...) ramps a constant learning rate, but this "
                f"optimizer's is a {type(schedule).__name__} schedule, which sets the rate every "
                "step. Put the warmup in the schedule (keras.optimizers.schedules.CosineDecay's "
                "warmup_steps and warmup_target) and drop warmup_epochs")
        self.target = float(keras.backend.get_value(optimizer.learning_rate))

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
        (FileExistsError) and abort the collectives. Each rank writes ``backup_dir/rank-N``, and
        every rank restores from rank 0's (the state is the same on every rank at an epoch's
        end), so every worker resumes from the same state: a rank with no backup of its own
        (the job grew) as one whose own is stale (left by a run with more workers).
        """

        _weights_path: str  # set by Keras's BackupAndRestore
        _training_metadata_path: str

        def __init__(self, backup_dir: str, rank: int, *, strategy_spans_workers: bool = True,
                     **kwargs: Any) -> None:
            del strategy_spans_workers  # Keras 3's callback never keeps workers apart
            self.root = backup_dir
            super().__init__(os.path.join(backup_dir, f"rank-{rank}"), double_checkpoint=True,
                             **kwargs)

        def on_train_begin(self, logs: Any = None) -> None:
            chief = os.path.join(self.root, "rank-0")
            if os.path.dirname(self._weights_path) == chief:
                return super().on_train_begin(logs)  # rank 0 (it recovers a half-written one)
            own = self._weights_path, self._training_metadata_path
            for suffix in ("", ".bkp"):  # rank 0's last complete one
                weights = os.path.join(chief, "latest.weights.h5" + suffix)
                if os.path.exists(weights):
                    self._weights_path = weights
                    self._training_metadata_path = os.path.join(
                        chief, "training_metadata.json" + suffix)
                    break
            else:
                return  # rank 0 has none: a backup of this rank alone is stale
            try:
                self._load_model()  # read-only: never writes into rank 0's directory
            finally:
                self._weights_path, self._training_metadata_path = own

        def _save_model(self) -> None:
            started = time.monotonic()
            with as_given():  # this rank's own folder
                super()._save_model()
            walltime.record_save(time.monotonic() - started)

        def on_train_end(self, logs: Any = None) -> None:
            super().on_train_end(logs)
            if self.delete_checkpoint:  # the other ranks remove theirs at the same moment
                with contextlib.suppress(OSError):  # not empty yet, or already gone
                    os.rmdir(self.root)

else:

    class WorkerBackupAndRestore(keras.callbacks.BackupAndRestore):  # type: ignore[no-redef]
        """tf_keras's BackupAndRestore, kept apart per worker.

        Under MultiWorkerMirroredStrategy tf_keras already keeps the workers apart; without such
        a strategy (Horovod) every rank would take itself for the chief and race on one
        directory, so each gets ``backup_dir/rank-N``.
        """

        def __init__(self, backup_dir: str, rank: int, *, strategy_spans_workers: bool = True,
                     **kwargs: Any) -> None:
            self.root = backup_dir
            super().__init__(backup_dir if strategy_spans_workers
                             else os.path.join(backup_dir, f"rank-{rank}"), **kwargs)

        def _backup(self, epoch: int, batch: int = 0) -> None:
            started = time.monotonic()
            super()._backup(epoch, batch)
            walltime.record_save(time.monotonic() - started)

        def on_train_end(self, logs: Any = None) -> None:
            super().on_train_end(logs)  # removes the checkpoints, not the folders above them
            for folder in (self.backup_dir, self.root):
                with contextlib.suppress(OSError):  # not empty: another rank's, or kept
                    os.rmdir(folder)


def _strategy_spans_workers(dist: Distributed) -> bool:
    in_multi_worker_mode = getattr(dist.strategy.extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode and in_multi_worker_mode())


def route_writer(dist: Distributed, callback: Any, *, announce: bool = False) -> Any:
    """``callback`` as it must run on this rank so that every file is written once.

    A file writer (:data:`_PATHS`) runs under :class:`ChiefWrites` where a save runs
    collectives (``dist.save_on_every_rank``), else on the chief only; a ``BackupAndRestore``
    gets a directory per rank where Keras would have every rank write one (Keras 3 always;
    tf_keras without a multi-worker strategy, as under Horovod); anything else is returned as
    it is.

    Args:
        dist: the handle.
        callback: a Keras callback.
        announce: log on the chief, once per kind of writer, that a callback of the user's was
            rerouted.
    """
    if dist.world_size == 1 or isinstance(callback, ChiefOnly | ChiefWrites | PerRankFiles):
        return callback
    if isinstance(callback, keras.callbacks.BackupAndRestore) and not isinstance(
            callback, WorkerBackupAndRestore):
        if not _KERAS3 and _strategy_spans_workers(dist):
            return callback  # tf_keras keeps the workers of its strategy apart itself
        _announce(dist, callback, announce, "keeps one folder per rank, backup_dir/rank-N")
        return _backup_per_rank(callback, dist.rank)
    if _path_attribute(callback) is None:
        return callback
    _announce(dist, callback, announce, "writes from the chief only; the other ranks " + (
        "write to a scratch directory that is removed" if dist.save_on_every_rank
        else "skip it"))
    if dist.save_on_every_rank:
        return ChiefWrites(callback, dist.rank)
    return ChiefOnly(callback, dist.is_chief)


_announced: set[tuple[str, str]] = set()


def _announce(dist: Distributed, callback: Any, announce: bool, what: str) -> None:
    key = (type(callback).__name__, what)
    if announce and dist.is_chief and key not in _announced:
        _announced.add(key)
        logger.info("tfdist: %s %s", type(callback).__name__, what)


def _backup_per_rank(callback: Any, rank: int) -> Any:
    """The user's ``BackupAndRestore`` moved to ``backup_dir/rank-N``: one writer per folder."""
    root = str(callback.backup_dir)
    folder = os.path.join(root, f"rank-{rank}")
    callback.backup_dir = folder
    if not _KERAS3:
        return callback  # tf_keras reads backup_dir when training begins
    # Keras 3 derives its files' paths in __init__: move each one into the rank's folder.
    for name in ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                 "_prev_training_metadata_path"):
        if isinstance(getattr(callback, name, None), str):
            setattr(callback, name, os.path.join(folder, os.path.relpath(
                getattr(callback, name), root)))
    return PerRankFiles(callback, root)  # its saves are this rank's own: written as given


def saves_model(callback: Any) -> bool:
    """Whether ``callback`` saves the model (a checkpoint or a backup, also under tfdist's
    wrappers): under MultiWorkerMirroredStrategy every rank must run such a save."""
    inner = getattr(callback, "callback", None) if isinstance(
        callback, ChiefOnly | ChiefWrites | PerRankFiles) else callback
    return isinstance(inner, AtomicCheckpoint | keras.callbacks.ModelCheckpoint
                      | keras.callbacks.BackupAndRestore)


def _tensorboard_installed(dist: Distributed) -> bool:
    # Keras writes summaries through the tensorboard package; without it the first summary
    # raises mid-epoch on the chief alone and the other workers' collectives abort.
    if importlib.util.find_spec("tensorboard") is not None:
        return True
    if dist.is_chief:
        logger.warning("tfdist: TensorBoard logs are off: the `tensorboard` package is not "
                       "installed (pip install tensorboard, or callbacks(tensorboard=False))")
    return False


@dataclass(frozen=True)
class CallbackOptions:
    """The options of :func:`build` (``dist.callbacks(**options)``).

    Attributes:
        model_dir: where outputs go (:mod:`tfdist.model_dir`); without it only warmup,
            progress and the callbacks given are set up.
        checkpoint: save ``model_dir/checkpoint.keras`` after each epoch (chief only, atomic).
        tensorboard: write TensorBoard logs to ``model_dir/logs`` (chief only).
        backup: save at each epoch's end so that a run killed without warning (SIGKILL, a
            lost node) resumes there: the exact state of :class:`PreemptionCheckpoint` (with
            ``preempt`` on, where tfdist follows ``fit``'s input: the resumed run ends
            bit-identical), else Keras's BackupAndRestore in ``model_dir/backup``, per rank.
        warmup_epochs: ramp the learning rate up from ``lr / size`` over this many epochs.
        chief_only: more callbacks to run on the chief only. The file writers tfdist knows
            (``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``) run as :func:`route_writer`
            says; others must not run collectives (no ``model.save``, no metric reads).
        sync_check: compare the weights of all ranks after the first step and at the end of
            training, and stop with ReplicaMismatchError naming the ranks that differ
            (:class:`tfdist.sync.ReplicaSyncCheck`); env ``TFDIST_SYNC_CHECK`` (1/0), default on.
        sync_check_every: also check every N steps; env ``TFDIST_SYNC_CHECK_EVERY``.
        preempt: with ``model_dir``, stop every rank at one agreed step after SIGTERM, SIGUSR1
            or ``TFDIST_PREEMPT_SIGNAL``, save the state in ``model_dir/preempted`` and exit
            with code 75 (:class:`PreemptionCheckpoint`).
        average_batch_statistics: at each epoch's end, replace each rank's BatchNormalization
            moving statistics by their mean over the ranks, before anything saves or compares
            (:class:`tfdist.keras.batch_statistics.BatchStatisticsAverage`); env
            ``TFDIST_AVERAGE_BATCH_STATISTICS``, default on.
        throughput: measure examples per second and step time
            (:class:`tfdist.throughput.ThroughputMeter`): one log line per epoch on the chief,
            and one JSON line in ``TFDIST_THROUGHPUT_FILE`` or ``model_dir/throughput.jsonl``.
        global_batch: examples per step over all workers, for the meter; default: the batch
            size of the dataset given to ``dist.shard``.
        checkpoint_every: with ``model_dir``, a safety save of the same exact state as for a
            preemption at one agreed step this often (seconds, or ``"10min"``), and at each
            epoch's end, training going on; env ``TFDIST_CHECKPOINT_EVERY``, default off.
    """

    model_dir: str | None = None
    checkpoint: bool = True
    tensorboard: bool = True
    backup: bool = True
    warmup_epochs: float = 0
    chief_only: tuple[Any, ...] = ()
    sync_check: bool | None = None
    sync_check_every: int | None = None
    preempt: bool = True
    average_batch_statistics: bool | None = None
    throughput: bool = True
    global_batch: int | None = None
    checkpoint_every: float | str | None = None


def build(dist: Distributed, *extra: Any, **options: Any) -> list[Any]:
    """Callbacks for ``model.fit`` that behave on any number of workers.

    Args:
        dist: the handle from :func:`tfdist.init`.
        *extra: your callbacks, run on every worker. File writers among them that would all
            write one path are routed by :func:`route_writer`: Keras's ``ModelCheckpoint``,
            ``CSVLogger`` and ``TensorBoard`` write once, from the chief; a Keras 3
            ``BackupAndRestore`` writes one directory per rank.
        **options: :class:`CallbackOptions`' fields.

    Returns:
        The list to pass as ``fit(callbacks=...)``. On non-chief workers it includes a silent
        progress bar, so only the chief prints progress whatever ``verbose`` is.
    """
    o = CallbackOptions(**options)
    model_dir = o.model_dir
    if model_dir:  # before anything reads or writes it: one run, a folder every rank sees
        ownership.claim(dist, model_dir)
    # The backend's own first (Horovod: the broadcast from rank 0).
    callbacks: list[Any] = list(dist.backend_callbacks())
    averaged = (resolve("batch_statistics", o.average_batch_statistics)
                and batch_statistics.averages_batch_statistics(dist))
    if averaged:  # first at an epoch's end: backups, checkpoints and checks see the mean
        callbacks.append(batch_statistics.BatchStatisticsAverage(dist))
    # The exact state replaces Keras's backup at each epoch's end where tfdist can resume it.
    exact = bool(model_dir and o.preempt and input_position.tracked())
    if model_dir and o.backup and not exact:
        callbacks.append(WorkerBackupAndRestore(
            layout.path(model_dir, layout.BACKUP), dist.rank,
            strategy_spans_workers=_strategy_spans_workers(dist)))
    if o.warmup_epochs:
        callbacks.append(LearningRateWarmup(o.warmup_epochs, dist.num_replicas))
    callbacks += [route_writer(dist, callback, announce=True) for callback in extra]
    check = sync.sync_check_callback(dist, o.sync_check, o.sync_check_every,
                                     batch_statistics_at_end=averaged)
    callbacks += [check] if check is not None else []  # after `extra`: it sees their changes
    callbacks += [route_writer(dist, writer) for writer in _chief_writers(dist, o)]
    if model_dir and o.preempt:  # last: a stop at an epoch's end comes after its backup
        callbacks.append(PreemptionCheckpoint(dist, model_dir, logs=[
            callback for callback in callbacks if _keeps_logs_open(callback)],
            every=o.checkpoint_every, epoch_saves=exact and o.backup))
    callbacks.append(_Progress())
    if o.throughput:
        callbacks.append(ThroughputMeter(dist, o.global_batch, throughput_file(model_dir)))
    if not dist.is_chief:
        callbacks.append(_SilentProgbar())
    return callbacks


def _chief_writers(dist: Distributed, o: CallbackOptions) -> list[Any]:
    """The callbacks that write files from the chief: ``chief_only``, the epoch checkpoint and
    TensorBoard's logs."""
    writers = [writer if _path_attribute(writer) else ChiefOnly(writer, dist.is_chief)
               for writer in o.chief_only]
    if o.model_dir and o.checkpoint:
        writers.append(AtomicCheckpoint(layout.path(o.model_dir, layout.CHECKPOINT)))
    if o.model_dir and o.tensorboard and _tensorboard_installed(dist):
        writers.append(keras.callbacks.TensorBoard(layout.path(o.model_dir, layout.LOGS)))
    return writers


class ThroughputMeter(keras.callbacks.Callback):
    """Times every training step of ``fit``: :class:`tfdist.throughput.StepMeter`'s callback.

    Args:
        dist: the handle from :func:`tfdist.init`.
        global_batch: examples per step over all workers; default: what ``dist.shard`` saw.
        path: the JSON lines file; default: :func:`tfdist.throughput.throughput_file`.
    """

    def __init__(self, dist: Distributed, global_batch: int | None = None,
                 path: str | None = None) -> None:
        super().__init__()
        self.meter = StepMeter(dist, global_batch, path)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.meter.begin_epoch()
        self._waited = input_wait.seconds()  # the steps' reads, timed in their graph

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.meter.steps_done(batch)  # Keras gives an execution's last step: one stamp each

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        waited = input_wait.seconds()
        if waited is not None:
            self.meter.waited(waited - (self._waited or 0.0))
        self.meter.epoch_end(epoch)


class _Progress(keras.callbacks.Callback):
    """Keeps :data:`tfdist.failures.progress` at the current epoch and step, so that a peer's
    failure can be reported with where this rank stopped."""

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        failures.progress.update(epoch=epoch, step=0)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        failures.progress["step"] = batch + 1
