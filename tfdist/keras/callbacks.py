"""Keras callbacks for distributed training: one writer, per-worker backups, LR warmup.

One writer without collective mismatches. Under MultiWorkerMirroredStrategy a save can run
collectives: tf_keras reads its metrics (sync-on-read variables) through an all-reduce, and
Keras 3 may create an optimizer variable during the first save, which under the strategy's scope
is broadcast from the chief. A save on the chief alone then leaves the others one collective
behind, and the job dies later with "Shape mismatch in the collective instance". So file writers
(checkpoints, TensorBoard, CSV logs) run on every rank (:class:`ChiefWrites`): the chief writes
the real path, the others write into a private scratch directory that is removed again. Under
Horovod and for one process a save runs no collective, and the writers run on the chief only.

Which callbacks, in which order, is :func:`tfdist.keras.plan.plan`'s answer, the same for every
Keras; here are TensorFlow's Keras's classes for its steps. The wrappers' and the warm-up's
bodies are shared with Keras 3 on JAX (:mod:`tfdist.keras.routing`, :mod:`tfdist.keras.warmup`).

Imported only after :func:`tfdist.init`, when ``tf.keras`` resolves to Keras 3 or, with
``TF_USE_LEGACY_KERAS=1``, to tf_keras; the classes below subclass whichever it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import failures, ownership, sync, walltime
from tfdist import model_dir as layout
from tfdist.errors import StorageError
from tfdist.keras import (
    batch_statistics,
    fit_preemption,
    input_position,
    input_wait,
    plan,
    routing,
    versions,
    warmup,
)
from tfdist.keras.plan import CallbackOptions
from tfdist.scratch import own_file, save_atomically, save_once, scratch_dir
from tfdist.throughput import StepMeter, say_notes, throughput_file

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["AtomicCheckpoint", "CallbackOptions", "ChiefOnly", "ChiefWrites", "LearningRateWarmup",
           "PerRankFiles", "PreemptionCheckpoint", "ThroughputMeter", "WorkerBackupAndRestore",
           "build", "route_writer", "save", "saves_model", "scratch_dir"]

keras: Any = tf.keras  # Keras 3 or tf_keras, known only at run time
logger = logging.getLogger("tfdist")
_KERAS3 = versions.is_keras3(keras)


class ChiefOnly(routing.ChiefOnly, keras.callbacks.Callback):
    """Runs ``callback`` on the chief only; on the other ranks its hooks do nothing.

    For callbacks that run no collective (notifications, your own logs). File writers that
    may save a model belong in :class:`ChiefWrites`, which :func:`build` picks for the ones
    it knows (:class:`tfdist.keras.routing.ChiefOnly`).
    """


class ChiefWrites(routing.ChiefWrites, keras.callbacks.Callback):
    """Runs a file-writing callback on every rank; only the chief's files are kept
    (:class:`tfdist.keras.routing.ChiefWrites`: the others write into a scratch folder)."""


class PerRankFiles(routing.PerRankFiles, keras.callbacks.Callback):
    """Runs ``callback`` on every rank with its saves written where it says
    (:class:`tfdist.keras.routing.PerRankFiles`)."""


_CLASSES = routing.Classes(ChiefOnly, ChiefWrites, PerRankFiles)


class AtomicCheckpoint(keras.callbacks.Callback):
    """Saves the whole model (``.keras``) at each epoch end, atomically; a model without a
    config (its constructor takes other models) as its weights and optimizer's state
    (``.weights.h5`` beside it), with one line saying so.

    The file is written under a temporary name and renamed, so a job killed mid-save leaves the
    previous checkpoint loadable.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        if not path.endswith(".keras"):
            raise ValueError(f"checkpoint path {path!r} must end with '.keras'")
        self.path = path

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        path = own_file(self.model, self.path)
        if path != self.path and not getattr(self, "_told", False):
            self._told = True
            logger.warning(
                "tfdist: %s has no get_config() (its constructor takes other models), so "
                "%s cannot hold it: its weights and optimizer's state go to %s (build the "
                "model, then model.load_weights(that file))", type(self.model).__name__,
                os.path.basename(self.path), path)
        try:
            save_atomically(self.model, path)
        except OSError as error:  # the previous checkpoint stays (the write was to a new name)
            raise StorageError(
                f"could not write the epoch's checkpoint {self.path}: "
                f"{error.strerror or error}. {layout.storage_fix(error.errno)}; the previous "
                "checkpoint, if any, is kept") from None


def save(dist: Handle, model: Any, path: str) -> bool:
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


class LearningRateWarmup(warmup.Warmup, keras.callbacks.Callback):
    """Ramps the learning rate from ``lr / size`` up to the (scaled) ``lr`` the optimizer has
    (:class:`tfdist.keras.warmup.Warmup`)."""

    def read(self, rate: Any) -> float:
        return float(keras.backend.get_value(rate))


class _SilentProgbar(keras.callbacks.ProgbarLogger):
    """Stands in for Keras's progress bar on non-chief workers, so only the chief prints."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        return object.__getattribute__(self, name)


if _KERAS3:

    class WorkerBackupAndRestore(routing.Keras3BackupPerRank, keras.callbacks.BackupAndRestore):
        """Keras 3's BackupAndRestore with one directory per rank, every rank restoring rank
        0's (:class:`tfdist.keras.routing.Keras3BackupPerRank`)."""

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


def _strategy_spans_workers(dist: Handle) -> bool:
    extended = getattr(dist.strategy, "extended", None)
    in_multi_worker_mode = getattr(extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode and in_multi_worker_mode())


def _facts(dist: Handle) -> plan.Facts:
    """What :func:`tfdist.keras.plan.plan` reads of ``dist`` and this process."""
    return plan.Facts(
        dist.facts, plan.KERAS3 if _KERAS3 else plan.TF_KERAS, dist.rank, dist.world_size,
        dist.num_replicas, dist.save_on_every_rank,
        strategy_spans_workers=_strategy_spans_workers(dist),
        input_tracked=input_position.tracked(),
        tensorboard_missing=() if importlib.util.find_spec("tensorboard") else ("tensorboard",))


def route_writer(dist: Handle, callback: Any, *, announce: bool = False) -> Any:
    """``callback`` as it must run on this rank so that every file is written once
    (:func:`tfdist.keras.plan.route`, :func:`tfdist.keras.routing.route_writer`).

    A file writer runs under :class:`ChiefWrites` where a save runs collectives
    (``dist.save_on_every_rank``), else on the chief only; a ``BackupAndRestore`` gets a
    directory per rank where Keras would have every rank write one (Keras 3 always; tf_keras
    without a multi-worker strategy, as under Horovod); anything else is returned as it is.

    Args:
        dist: the handle.
        callback: a Keras callback.
        announce: log on the chief, once per kind of writer, that a callback of the user's was
            rerouted.
    """
    if dist.world_size == 1:
        return callback
    return routing.route_writer(_facts(dist), callback, _CLASSES, announce=announce)


def saves_model(callback: Any) -> bool:
    """Whether ``callback`` saves the model (a checkpoint or a backup, also under tfdist's
    wrappers): under MultiWorkerMirroredStrategy every rank must run such a save."""
    inner = getattr(callback, "callback", None) if isinstance(
        callback, routing.ChiefOnly | routing.ChiefWrites | routing.PerRankFiles) else callback
    return isinstance(inner, AtomicCheckpoint | keras.callbacks.ModelCheckpoint
                      | keras.callbacks.BackupAndRestore)


def build(dist: Handle, *extra: Any, **options: Any) -> list[Any]:
    """Callbacks for ``model.fit`` that behave on any number of workers: the steps of
    :func:`tfdist.keras.plan.plan`, made with this module's classes.

    Args:
        dist: the handle from :func:`tfdist.init`.
        *extra: your callbacks, run on every worker. File writers among them that would all
            write one path are routed by :func:`route_writer`: Keras's ``ModelCheckpoint``,
            ``CSVLogger`` and ``TensorBoard`` write once, from the chief; a Keras 3
            ``BackupAndRestore`` writes one directory per rank.
        **options: :class:`~tfdist.keras.plan.CallbackOptions`' fields.

    Returns:
        The list to pass as ``fit(callbacks=...)``. On non-chief workers it includes a silent
        progress bar, so only the chief prints progress whatever ``verbose`` is.

    Raises:
        TypeError: an option that does not exist.
        ConfigError: an option this Keras cannot honour (:func:`tfdist.keras.plan.plan`).
    """
    o = plan.options(**options)
    chosen = plan.plan(o, _facts(dist), extra)
    if o.model_dir:  # before anything reads or writes it: one run, a folder every rank sees
        ownership.claim(dist, o.model_dir)
    for level, line in chosen.notes if dist.is_chief else ():
        logger.log(level, line)
    return plan.assemble(chosen, _makers(dist))


def _makers(dist: Handle) -> dict[str, plan.Maker]:
    """This Keras's callbacks for each kind of step (``made``: the callbacks before it)."""
    def route(callback: Any, announce: bool = False) -> Any:
        return route_writer(dist, callback, announce=announce)

    return {
        plan.BACKEND: lambda step, made: dist.backend_callbacks(),
        plan.BATCH_STATISTICS: lambda step, made: [
            batch_statistics.BatchStatisticsAverage(dist)],
        plan.BACKUP: lambda step, made: [WorkerBackupAndRestore(
            step.args["path"], dist.rank, strategy_spans_workers=_strategy_spans_workers(dist))],
        plan.WARMUP: lambda step, made: [LearningRateWarmup(step.args["epochs"],
                                                            step.args["replicas"])],
        plan.YOURS: lambda step, made: [route(c, True) for c in step.args["callbacks"]],
        plan.SYNC_CHECK: lambda step, made: [sync.ReplicaSyncCheck(
            dist, step.args["every"], batch_statistics_at_end=step.args["batch_statistics"])],
        plan.CHIEF_ONLY: lambda step, made: [
            route(c if routing.path_attribute(c) else ChiefOnly(c, dist.is_chief))
            for c in step.args["callbacks"]],
        plan.CHECKPOINT: lambda step, made: [route(AtomicCheckpoint(step.args["path"]))],
        plan.TENSORBOARD: lambda step, made: [route(keras.callbacks.TensorBoard(
            step.args["path"]))],
        plan.PREEMPTION: lambda step, made: [PreemptionCheckpoint(
            dist, step.args["model_dir"], logs=[c for c in made if routing.keeps_logs_open(c)],
            every=step.args["every"], epoch_saves=step.args["epoch_saves"])],
        plan.PROGRESS: lambda step, made: [_Progress()],
        plan.THROUGHPUT: lambda step, made: [ThroughputMeter(
            dist, step.args["global_batch"], throughput_file(step.args["model_dir"]))],
        plan.SILENT_PROGRESS_BAR: lambda step, made: [_SilentProgbar()],
    }


class ThroughputMeter(keras.callbacks.Callback):
    """Times every training step of ``fit``: :class:`tfdist.throughput.StepMeter`'s callback.

    Args:
        dist: the handle from :func:`tfdist.init`.
        global_batch: examples per step over all workers; default: what ``dist.shard`` saw.
        path: the JSON lines file; default: :func:`tfdist.throughput.throughput_file`.
    """

    def __init__(self, dist: Handle, global_batch: int | None = None,
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

    def on_train_end(self, logs: Any = None) -> None:
        say_notes()


class _Progress(keras.callbacks.Callback):
    """Keeps :data:`tfdist.failures.progress` at the current epoch and step, so that a peer's
    failure can be reported with where this rank stopped."""

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        failures.progress.update(epoch=epoch, step=0)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        failures.progress["step"] = batch + 1
