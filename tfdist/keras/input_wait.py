"""How long each step of ``fit`` waited for its batch, measured inside the step.

Keras reads a training step's batch inside the step's own graph (``iterator.get_next()`` in
its traced train function), where no Python clock runs, so a callback cannot tell a step that
waited for its input from one that computed. While Keras traces its train function, tfdist puts
a clock read (``tf.timestamp``) before this worker's read of the batch and one after the batch
is there, and adds the difference to one float64 variable of this process, on its CPU
(:func:`seconds` reads it). The throughput meter reads it at each epoch's start and end: the
epoch's input wait, in the per-rank profile (``input_s``) and the input advice, as a custom
loop's :meth:`tfdist.throughput.StepMeter.batches` gives them.

Only this worker's own read is timed: under MultiWorkerMirroredStrategy the read of each
worker's part of the batch (``get_next_as_list`` / ``get_next_as_optional_list``), not the
collective that asks whether every worker still has a batch, which waits for the other
workers. Evaluation inside ``fit`` is not timed. A step costs two clock reads and one add, and
its computation starts after the second read.

Installed with :func:`install_timing` when a TensorFlow backend is created (patch
``fit-input-wait``; ``TFDIST_SKIP_PATCHES=fit-input-wait`` leaves it out).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras.versions import trainer_class

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["install", "install_timing", "seconds"]

logger = logging.getLogger("tfdist")

_state = threading.local()  # training: in a train function's call; nested: in a timed read
_clock: list[Any] = []  # the variable, once a traced step made it


def seconds() -> float | None:
    """The input wait of this process's traced training steps so far, in seconds; None before
    one traced step read a batch."""
    if not _clock:
        return None
    return float(_clock[0].numpy())


def _variable(tf: Any) -> Any:
    """The clock: made once, outside any function and strategy (a plain variable of this
    process on its CPU, not one that a strategy mirrors)."""
    if not _clock:
        from tensorflow.python.ops import resource_variable_ops

        with tf.init_scope(), tf.device("/CPU:0"):
            # The class itself, not tf.Variable: no strategy's or function's variable creator.
            _clock.append(resource_variable_ops.ResourceVariable(
                0.0, dtype=tf.float64, trainable=False, name="tfdist_input_wait"))
    return _clock[0]


def _timed_read(original: Callable[..., Any]) -> Callable[..., Any]:
    """A batch-reading method that, while a train function is traced, times its read."""

    @functools.wraps(original)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_state, "training", False) or getattr(_state, "nested", False):
            return original(self, *args, **kwargs)
        import tensorflow as tf

        if tf.executing_eagerly():
            return original(self, *args, **kwargs)
        clock = _variable(tf)
        _state.nested = True  # a read inside this read (the worker's iterator's): not timed
        try:
            started = tf.timestamp()
            with tf.control_dependencies([started]):
                data = original(self, *args, **kwargs)
            parts = tf.nest.flatten(data, expand_composites=True)
            there = [t for t in parts if isinstance(t, tf.Tensor)]
            with tf.control_dependencies(there):
                arrived = tf.timestamp()
            clock.assign_add(arrived - started)
            # The step computes on the batch only after the second clock read: else the
            # executor may run the model's first ops before it, and the wait would count them
            # (a cached dataset read for 7 of a 9 ms step, a one-thread process's conv net).
            with tf.control_dependencies([arrived]):
                parts = [tf.identity(t) if isinstance(t, tf.Tensor) else t for t in parts]
            data = tf.nest.pack_sequence_as(data, parts, expand_composites=True)
        finally:
            _state.nested = False
        return data

    return read


def _timed_train_function(function: Any) -> Any:
    """``function`` (a model's train function) with the reads it traces timed."""
    if getattr(function, "_tfdist_timed", False) or function is None:
        return function

    def train_function(*args: Any, **kwargs: Any) -> Any:
        _state.training = True
        try:
            return function(*args, **kwargs)
        finally:
            _state.training = False

    train_function._tfdist_timed = True  # type: ignore[attr-defined]
    train_function.__wrapped__ = function  # type: ignore[attr-defined]
    return train_function


def _make_train_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """``make_train_function`` that leaves the model a timed train function (Keras 3 returns
    nothing, Keras 2 the function: both set ``model.train_function``)."""

    @functools.wraps(original)
    def make_train_function(self: Any, *args: Any, **kwargs: Any) -> Any:
        made = original(self, *args, **kwargs)
        self.train_function = _timed_train_function(self.train_function)
        return self.train_function if made is not None else made

    return make_train_function


def install_timing(where: Where, dist: Any) -> None:
    """Patch ``fit-input-wait``'s installer (:func:`tfdist.patches.install`)."""
    install(keras2=not where.keras3)


def install(keras2: bool) -> bool:
    """Installs the timing for the Keras in use (``keras2``: Keras 2 as tf.keras or tf_keras),
    once. False where a class it hooks is missing (the meter then reports no input wait)."""
    try:
        from tensorflow.python.data.ops import iterator_ops
        from tensorflow.python.distribute import input_lib

        if keras2:
            from tfdist.keras.versions import keras2_module

            model = keras2_module("engine.training").Model
        else:
            model = trainer_class()
        worker = input_lib._SingleWorkerDatasetIteratorBase
        owners = [(worker, "get_next_as_list"), (worker, "get_next_as_optional_list"),
                  (iterator_ops.OwnedIterator, "_next_internal"),
                  (iterator_ops.OwnedIterator, "get_next_as_optional")]
        for owner, name in owners:
            getattr(owner, name)
        model.make_train_function  # noqa: B018  (each hooked attribute exists)
    except (ImportError, AttributeError) as error:
        logger.info("tfdist: cannot time fit's input reads on this TensorFlow or Keras (%s)",
                    error)
        return False
    for owner, name in owners:
        patches.apply("fit-input-wait", owner, name, _timed_read)
    patches.apply("fit-input-wait", model, "make_train_function", _make_train_function)
    return True
