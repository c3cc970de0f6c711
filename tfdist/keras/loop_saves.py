"""A custom loop's state saved in the background (``dist.save_state`` with
``TFDIST_BACKGROUND_SAVES=1`` or ``background=True``).

The synchronous save writes the loop's objects with one ``tf.train.Checkpoint``, which reads
and writes on the training thread. TensorFlow's own asynchronous checkpoint
(``CheckpointOptions(experimental_enable_async_checkpoint=True)``) cannot stand in: with
Keras 3's variables its second save stops ("tf.function only supports singleton tf.Variables
created on the first call"; Keras 3.15, TensorFlow 2.21). So a background save takes what
:mod:`tfdist.keras.snapshot` takes for ``fit``: the objects' variables, by name
(:func:`variables`: a Keras model's weights and random generators' states, an optimizer's
variables, a variable), copied on the training thread into one host buffer made once and
reused, and written, made durable and committed by the writer thread with the two renames of
``fit``'s background saves (:func:`tfdist.background.start_save`). The chief writes the
values; every rank marks its part done (the values are the same on every rank).

An optimizer that a resume has not built yet (Keras builds one at its first
``apply_gradients``) is built first, over the weights it trained at the save (their places
among the models' weights given with it, ``state.json``'s ``optimizers``), then the values are
assigned by name: :func:`restore`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from typing import Any

from tfdist import background
from tfdist.errors import ConfigError, StorageError
from tfdist.keras import keras2, optimizers, snapshot

__all__ = ["LoopSaves", "restore", "saver", "variables", "wait_all"]

logger = logging.getLogger("tfdist")


def _is_model(value: Any) -> bool:
    return hasattr(value, "weights") and hasattr(value, "layers")


def _is_variable(value: Any) -> bool:
    return callable(getattr(value, "assign", None)) and hasattr(value, "shape") and hasattr(
        value, "dtype")


def variables(objects: dict[str, Any]) -> dict[str, Any]:
    """The variables a background save writes, by name: ``NAME/wI`` a model's weights,
    ``NAME/rI`` its random generators' states, ``NAME/oI`` an optimizer's variables, ``NAME``
    a variable.

    Raises:
        ConfigError: an object of another kind, which only a ``tf.train.Checkpoint`` saves.
    """
    found: dict[str, Any] = {}
    for name, value in objects.items():
        if _is_model(value):
            found.update({f"{name}/w{i}": v for i, v in enumerate(value.weights)})
            found.update({f"{name}/r{i}": v for i, v in
                          enumerate(keras2.random_states(value))})
        elif optimizers.is_optimizer(value):
            found.update({f"{name}/o{i}": v for i, v in
                          enumerate(optimizers.variables(value))})
        elif _is_variable(value):
            found[name] = value
        else:
            raise ConfigError(
                f"a background save writes Keras models, optimizers and variables; {name} is "
                f"a {type(value).__name__}: save this loop's state with "
                "dist.save_state(..., background=False) (TFDIST_BACKGROUND_SAVES=0)")
    return found


def _weights(objects: dict[str, Any]) -> list[Any]:
    """The weights of the models among ``objects``, in their order."""
    return [w for value in objects.values() if _is_model(value) for w in value.weights]


def record(objects: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each optimizer among ``objects``: whether it is built, over which of the models' weights
    (their places in :func:`_weights`)."""
    weights = _weights(objects)
    return {name: optimizers.entry(value, weights) for name, value in objects.items()
            if optimizers.is_optimizer(value)}


def restore(objects: dict[str, Any], folder: str, saved: dict[str, Any],
            scope: Any = None) -> None:
    """Builds the optimizers among ``objects`` that ``saved`` (``state.json``'s ``optimizers``)
    says were built, over the same weights, in ``scope`` (the strategy's), then assigns the
    values of ``folder`` (a background save) by name.

    Raises:
        ValueError: the values do not fit the objects (another model or optimizer).
    """
    weights = _weights(objects)
    with scope() if callable(scope) else contextlib.nullcontext():
        for name, was in saved.items():
            optimizer = objects.get(name)
            if optimizer is not None and not optimizers.build_one(optimizer, was, weights):
                raise ValueError(f"{name} ({type(optimizer).__name__}) trained variables the "
                                 "models given with it do not hold")
    snapshot.restore_variables(variables(objects), os.path.join(folder, snapshot.FILE))


class LoopSaves:
    """One process's background saves of a custom loop into one model_dir (see the module)."""

    def __init__(self) -> None:
        self.writer = background.Writer()
        self.saves = 0
        self._snapshot: snapshot.Snapshot | None = None
        atexit.register(self._at_exit)

    def save(self, dist: Any, model_dir: str, position: dict[str, Any],
             objects: dict[str, Any], *, commit: Any, state_file: str, final: str) -> None:
        """Copies the objects' values (the chief) and starts the write on the writer thread."""
        found = variables(objects)
        _waited(self.writer, model_dir)  # the buffer is free again; a failed write raises
        if self.saves == 0:  # no rank writes before the chief removed an older run's folders
            if dist.is_chief:
                background.remove_partials(model_dir)
            dist.sum_over_ranks([0.0])
        values = snapshot.take_variables(found, self._snapshot) if dist.is_chief else None
        self._snapshot = values
        self.saves += 1

        def write(folder: str) -> None:
            if values is not None:
                snapshot.write(folder, values)

        background.start_save(
            self.writer, model_dir=model_dir, final=final, number=self.saves,
            rank=getattr(dist, "rank", 0),
            world_size=dist.world_size, is_chief=dist.is_chief, write=write,
            state={**position, "loop": True, "optimizers": record(objects)}, commit=commit,
            state_file=state_file)

    def _at_exit(self) -> None:
        try:
            self.writer.wait()  # the loop's last save is on the disk before the process ends
        except Exception as error:  # at exit: said, not raised
            logger.error("tfdist: the loop's last background save failed: %s", error)


_savers: dict[str, LoopSaves] = {}


def saver(model_dir: str) -> LoopSaves:
    """This process's :class:`LoopSaves` for ``model_dir``."""
    return _savers.setdefault(os.path.abspath(model_dir), LoopSaves())


def wait_all() -> None:
    """Waits for every background save of this process's loops; raises a failed one's error."""
    for model_dir, found in _savers.items():
        _waited(found.writer, model_dir)


def _waited(writer: background.Writer, model_dir: str) -> None:
    try:
        writer.wait()
    except OSError as error:
        raise StorageError(
            f"could not save the loop's state in {model_dir} in the background: "
            f"{error.strerror or error}; the last complete state is kept") from None
