"""``dist.callbacks()`` for Keras 3 on JAX (:mod:`tfdist.backends.keras_jax`): Keras callbacks
that import no TensorFlow.

What is here: your own callbacks, ``model_dir/checkpoint.keras`` saved at each epoch's end once,
from the chief (every rank runs the save: :func:`tfdist.scratch.save_once`), TensorBoard's logs
in ``model_dir/logs`` from the chief (where tensorboard and TensorFlow are installed: Keras
writes them through ``tf.summary``), the preemption and walltime stop with the exact state saved
at one agreed step and resumed there, the same state saved at each epoch's end and every
``checkpoint_every`` (:class:`tfdist.keras.fit_preemption.PreemptionCallback`, as on the TensorFlow
backends), the replica sync check (where TensorFlow is installed), the throughput meter with
every rank's profile (:class:`tfdist.throughput.StepMeter`; the input wait timed where ``fit``
draws its batches, :func:`tfdist.keras.input_position._counted`), the chief's progress bar alone;
the learning-rate warm-up, ``chief_only``, Keras's BackupAndRestore per rank where the exact
state does not replace it (``preempt=False``), and your own writers routed as on TensorFlow
(:func:`route_writer`: the chief writes, a BackupAndRestore gets a folder per rank).

Which callbacks, in which order, is :func:`tfdist.keras.plan.plan`'s answer, the same as for
TensorFlow's Keras (an option Keras 3 on JAX cannot honour is refused there, with the fix); here
are Keras 3 on JAX's classes for its steps, made from the bodies TensorFlow's Keras shares
(:mod:`tfdist.keras.routing`, :mod:`tfdist.keras.warmup`,
:mod:`tfdist.keras.fit_preemption`). Imported only by the JAX handle's ``callbacks``, once Keras
runs on JAX.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

import keras

from tfdist import ownership
from tfdist.keras import fit_preemption, input_position, plan, routing, warmup
from tfdist.scratch import save_once
from tfdist.throughput import StepMeter, say_notes, throughput_file

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["ChiefOnly", "ChiefWrites", "LearningRateWarmup", "PerRankFiles",
           "PreemptionCheckpoint", "WorkerBackupAndRestore", "build", "route_writer"]

logger = logging.getLogger("tfdist")

Callback: Any = keras.callbacks.Callback


class ChiefOnly(routing.ChiefOnly, Callback):
    """:class:`tfdist.keras.routing.ChiefOnly` on Keras 3 on JAX: the chief alone runs it."""


class ChiefWrites(routing.ChiefWrites, Callback):
    """:class:`tfdist.keras.routing.ChiefWrites` on Keras 3 on JAX: every rank runs the writer
    (a save reads the replicated arrays through JAX's runtime), the chief's files are kept."""


class PerRankFiles(routing.PerRankFiles, Callback):
    """:class:`tfdist.keras.routing.PerRankFiles` on Keras 3 on JAX."""


_CLASSES = routing.Classes(ChiefOnly, ChiefWrites, PerRankFiles)


class WorkerBackupAndRestore(routing.Keras3BackupPerRank, keras.callbacks.BackupAndRestore):
    """Keras 3's BackupAndRestore with one directory per rank, every rank restoring rank 0's
    (:class:`tfdist.keras.routing.Keras3BackupPerRank`)."""


class LearningRateWarmup(warmup.Warmup, Callback):
    """:class:`tfdist.keras.warmup.Warmup` on Keras 3 on JAX. Reading ``self.model`` writes
    ``fit``'s variables back first (Keras's ``jax_state_sync``), so the next step starts from
    the rate set here; it is set only while it changes."""


class PreemptionCheckpoint(fit_preemption.PreemptionCallback, Callback):
    """:class:`tfdist.keras.fit_preemption.PreemptionCallback` as a Keras 3 callback on JAX."""


class EpochCheckpoint(Callback):
    """``model_dir/checkpoint.keras`` at each epoch's end: every rank runs the save, the
    chief's file is kept (:func:`tfdist.scratch.save_once`)."""

    def __init__(self, dist: Handle, path: str) -> None:
        super().__init__()
        self.dist, self.path = dist, path

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        dist = self.dist
        save_once(dist.is_chief, dist.rank, dist.save_on_every_rank, self.model, self.path)


def _facts(dist: Handle) -> plan.Facts:
    """What :func:`tfdist.keras.plan.plan` reads of ``dist`` and this process. Keras writes
    TensorBoard's logs through ``tf.summary``, and :mod:`tfdist.sync` reads variables through
    TensorFlow's types: both need TensorFlow installed."""
    installed = {m: importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorflow")}
    return plan.Facts(dist.facts, plan.KERAS3_JAX, dist.rank, dist.world_size, dist.num_replicas,
                      dist.save_on_every_rank, input_tracked=input_position.tracked(),
                      tensorboard_missing=tuple(m for m, found in installed.items() if not found),
                      sync_check_readable=installed["tensorflow"])


def route_writer(dist: Handle, callback: Any, *, announce: bool = False) -> Any:
    """``callback`` as it must run on this rank so that every file is written once, as on
    TensorFlow (:func:`tfdist.keras.routing.route_writer`): Keras's ``ModelCheckpoint``,
    ``CSVLogger`` and ``TensorBoard`` under :class:`ChiefWrites` (a save runs on every rank), a
    ``BackupAndRestore`` in ``backup_dir/rank-N``; anything else as it is."""
    if dist.world_size == 1:
        return callback
    return routing.route_writer(_facts(dist), callback, _CLASSES, announce=announce)


def build(dist: Handle, *extra: Any, **options: Any) -> list[Any]:
    """The callbacks for ``fit``: the steps of :func:`tfdist.keras.plan.plan`, made with this
    module's classes; ``options`` are :class:`tfdist.keras.plan.CallbackOptions`' fields.

    Raises:
        TypeError: an option that does not exist.
        ConfigError: an option Keras 3 on JAX cannot honour (:func:`tfdist.keras.plan.plan`).
    """
    o = plan.options(**options)
    chosen = plan.plan(o, _facts(dist), extra)
    if o.model_dir:  # before anything reads or writes it: one run, a folder every rank sees
        ownership.claim(dist, o.model_dir)
    for level, line in chosen.notes if dist.is_chief else ():
        logger.log(level, line)
    return plan.assemble(chosen, _makers(dist))


def _makers(dist: Handle) -> dict[str, plan.Maker]:
    """Keras 3 on JAX's callbacks for each kind of step (``made``: the callbacks before it)."""
    def route(callback: Any, announce: bool = False) -> Any:
        return route_writer(dist, callback, announce=announce)

    return {
        plan.BACKEND: lambda step, made: dist.backend_callbacks(),
        plan.BACKUP: lambda step, made: [WorkerBackupAndRestore(step.args["path"], dist.rank)],
        plan.WARMUP: lambda step, made: [LearningRateWarmup(step.args["epochs"],
                                                            step.args["replicas"])],
        plan.YOURS: lambda step, made: [route(c, True) for c in step.args["callbacks"]],
        plan.SYNC_CHECK: lambda step, made: _sync_check(dist, step),
        plan.CHIEF_ONLY: lambda step, made: [
            route(c if routing.path_attribute(c) else ChiefOnly(c, dist.is_chief))
            for c in step.args["callbacks"]],
        plan.CHECKPOINT: lambda step, made: [EpochCheckpoint(dist, step.args["path"])],
        # The chief alone: writing the logs runs no collective here.
        plan.TENSORBOARD: lambda step, made: [keras.callbacks.TensorBoard(
            step.args["path"])] if dist.is_chief else [],
        plan.PREEMPTION: lambda step, made: [PreemptionCheckpoint(
            dist, step.args["model_dir"], logs=[c for c in made if routing.keeps_logs_open(c)],
            every=step.args["every"], epoch_saves=step.args["epoch_saves"])],
        plan.THROUGHPUT: lambda step, made: [_meter(StepMeter(
            dist, step.args["global_batch"], throughput_file(step.args["model_dir"])))],
        plan.SILENT_PROGRESS_BAR: lambda step, made: [SilentProgbar()],
    }


def _sync_check(dist: Handle, step: plan.Step) -> list[Any]:
    """The replica sync check (:class:`tfdist.sync.ReplicaSyncCheck`): every process's copies
    of the variables compared after the first step and at the end. Its module reads variables
    through TensorFlow's types (the plan leaves it out where TensorFlow is not installed)."""
    from tfdist import sync

    return [sync.ReplicaSyncCheck(dist, step.args["every"],
                                  batch_statistics_at_end=step.args["batch_statistics"])]


def _meter(meter: StepMeter) -> Any:
    """The meter as a callback; an epoch's input wait is what the ``fit``'s own batches took to
    arrive (:meth:`tfdist.keras.input_position.JaxInput.waited`), where tfdist follows its input."""

    class ThroughputMeter(Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            found = input_position.current(self.model)  # this fit's, not its evaluation's
            self._input = found if isinstance(found, input_position.JaxInput) else None

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            meter.begin_epoch()
            self._waited = self._input_wait() or 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            meter.steps_done(batch)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            waited = self._input_wait()
            if waited is not None:
                meter.waited(waited - self._waited)
            meter.epoch_end(epoch)

        def on_train_end(self, logs: Any = None) -> None:
            say_notes()

        def _input_wait(self) -> float | None:
            return self._input.waited() if self._input is not None else None

    return ThroughputMeter()


class SilentProgbar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar that prints nothing: the chief's alone is shown."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        return object.__getattribute__(self, name)
