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
draws its batches, :func:`tfdist.keras.input_position._counted`), the chief's progress bar alone.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from tfdist import model_dir as layout
from tfdist import ownership
from tfdist.keras import fit_preemption, input_position
from tfdist.scratch import save_once
from tfdist.throughput import StepMeter, throughput_file

__all__ = ["build"]

logger = logging.getLogger("tfdist")

_OPTIONS = ("model_dir", "checkpoint", "throughput", "global_batch", "preempt", "backup",
            "tensorboard", "sync_check", "sync_check_every", "checkpoint_every",
            "average_batch_statistics", "warmup_epochs", "chief_only")


def build(dist: Any, *extra: Any, **options: Any) -> list[Any]:
    """The callbacks for ``fit`` (see the module docstring); ``options`` are those of
    :class:`tfdist.keras.callbacks.CallbackOptions`.

    Raises:
        TypeError: an option :class:`~tfdist.keras.callbacks.CallbackOptions` does not have.
    """
    import keras

    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"dist.callbacks() got unknown options {unknown}")
    model_dir = options.get("model_dir")
    if model_dir:  # before anything reads or writes it: one run, a folder every rank sees
        ownership.claim(dist, model_dir)
    callbacks: list[Any] = list(extra)
    if model_dir and options.get("checkpoint", True):
        callbacks.append(_checkpoint(keras, dist, layout.path(model_dir, layout.CHECKPOINT)))
    logs = []
    if model_dir and options.get("tensorboard", True) and dist.is_chief and all(
            importlib.util.find_spec(m) for m in ("tensorboard", "tensorflow")):
        logs.append(keras.callbacks.TensorBoard(layout.path(model_dir, layout.LOGS)))
    callbacks += logs
    callbacks += _sync_check(dist, options)  # after `extra`: it sees their changes
    if model_dir and options.get("preempt", True):  # last: a stop at an epoch's end comes
        # after its checkpoint; each epoch's end saves the exact state (a kill resumes there)
        epoch_saves = bool(options.get("backup", True)) and input_position.tracked()
        callbacks.append(_preemption(keras)(dist, model_dir, logs=logs,
                                            every=options.get("checkpoint_every"),
                                            epoch_saves=epoch_saves))
    if options.get("throughput", True):
        callbacks.append(_meter(keras, StepMeter(dist, options.get("global_batch"),
                                                 throughput_file(model_dir))))
    if not dist.is_chief:
        callbacks.append(_Silent(keras))
    return callbacks


def _checkpoint(keras: Any, dist: Any, path: str) -> Any:
    class Checkpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            save_once(dist.is_chief, dist.rank, dist.save_on_every_rank, self.model, path)

    return Checkpoint()


def _sync_check(dist: Any, options: dict[str, Any]) -> list[Any]:
    """The replica sync check (:class:`tfdist.sync.ReplicaSyncCheck`): every process's copies
    of the variables compared after the first step and at the end. Its module reads variables
    through TensorFlow's types: without TensorFlow installed the check is left out, said once."""
    if importlib.util.find_spec("tensorflow") is None:
        if dist.is_chief and dist.num_replicas > 1 and options.get("sync_check") is not False:
            logger.info("tfdist: the replica sync check is off: it needs TensorFlow installed")
        return []
    from tfdist import sync

    check = sync.sync_check_callback(dist, options.get("sync_check"),
                                     options.get("sync_check_every"))
    return [check] if check is not None else []


def _preemption(keras: Any) -> Any:
    class PreemptionCheckpoint(fit_preemption.PreemptionCallback, keras.callbacks.Callback):
        """:class:`tfdist.keras.fit_preemption.PreemptionCallback` as a Keras 3 callback on JAX."""

    return PreemptionCheckpoint


def _meter(keras: Any, meter: StepMeter) -> Any:
    """The meter as a callback; an epoch's input wait is what the ``fit``'s own batches took to
    arrive (:meth:`tfdist.keras.input_position.JaxInput.waited`), where tfdist follows its input."""

    class ThroughputMeter(keras.callbacks.Callback):
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

        def _input_wait(self) -> float | None:
            return self._input.waited() if self._input is not None else None

    return ThroughputMeter()


def _Silent(keras: Any) -> Any:  # noqa: N802 (a class, made where Keras is imported)
    class SilentProgbar(keras.callbacks.ProgbarLogger):
        """Keras's progress bar that prints nothing: the chief's alone is shown."""

        def __getattribute__(self, name: str) -> Any:
            if name.startswith("on_"):
                return lambda *args, **kwargs: None
            return object.__getattribute__(self, name)

    return SilentProgbar()
