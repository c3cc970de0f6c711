"""``model.fit`` under Horovod: the optimizer wrapper and callbacks, for Keras 3 and tf_keras.

tf_keras (Keras 2) uses Horovod's own ``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``
and ``MetricAverageCallback``. Keras 3 cannot: Horovod's optimizer wrapper silently stops
averaging there, and its callbacks fail (``.ref``, ``keras.backend.constant``). For Keras 3 tfdist
averages the gradients in ``optimizer.apply`` and broadcasts and averages with its own callbacks,
all on Horovod's core collective ops (:mod:`tfdist.horovod.ops`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import tensorflow as tf

from tfdist.horovod import ops

__all__ = ["DistributedOptimizer", "callbacks", "install_compile_hook", "is_keras3"]

logger = logging.getLogger("tfdist")
keras: Any = tf.keras  # Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1
_MARK = "_tfdist_averages_gradients"


def is_keras3() -> bool:
    """Whether ``tf.keras`` is Keras 3 (not tf_keras)."""
    from tfdist.keras_compat import is_keras3 as check

    return check(keras)


def is_stock_horovod(optimizer: Any) -> bool:
    """Whether ``optimizer`` came from horovod.tensorflow(.keras).DistributedOptimizer."""
    return hasattr(optimizer, "_allreduce_grads") and hasattr(optimizer, "_agg_helper")


def DistributedOptimizer(optimizer: Any) -> Any:  # noqa: N802 (Horovod's name)
    """Makes ``optimizer`` average its gradients across ranks before applying them.

    Keras 3: patches this optimizer's ``apply`` (the instance keeps its class, so saved models
    load without tfdist) and returns it. tf_keras: returns Horovod's ``DistributedOptimizer``.
    An optimizer already wrapped by tfdist is returned as it is.
    """
    if getattr(optimizer, _MARK, False):
        return optimizer
    if is_stock_horovod(optimizer):
        if is_keras3():
            logger.warning(
                "tfdist: hvd.DistributedOptimizer around a Keras 3 optimizer does NOT average "
                "gradients (Horovod 0.28 predates Keras 3): the ranks will drift apart. Pass "
                "the plain optimizer; tfdist averages its gradients.")
        return optimizer
    if not is_keras3():
        from tfdist.horovod.install import import_horovod_keras

        wrapped = import_horovod_keras().DistributedOptimizer(optimizer)
        object.__setattr__(wrapped, _MARK, True)
        return wrapped
    apply = optimizer.apply

    @functools.wraps(apply)
    def averaged_apply(grads: Any, trainable_variables: Any = None) -> Any:
        return apply(ops.allreduce_gradients(list(grads), "average"), trainable_variables)

    object.__setattr__(optimizer, "apply", averaged_apply)
    object.__setattr__(optimizer, _MARK, True)
    return optimizer


def install_compile_hook() -> None:
    """Makes every ``Model.compile`` wrap its optimizer with :func:`DistributedOptimizer`."""
    model_class = keras.Model
    if getattr(model_class.compile, _MARK, False):
        return
    original = model_class.compile

    @functools.wraps(original)
    def compile(self: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
        if not is_keras3():  # Horovod's wrapper must be in place before compile uses it
            optimizer = DistributedOptimizer(keras.optimizers.get(optimizer))
        else:
            # Keras 3 turns XLA on for GPUs ("auto"); Horovod's ops cannot be XLA-compiled.
            kwargs.setdefault("jit_compile", False)
        result = original(self, optimizer, *args, **kwargs)
        if is_keras3():
            DistributedOptimizer(self.optimizer)
        return result

    setattr(compile, _MARK, True)
    model_class.compile = compile


def callbacks() -> list[Any]:
    """Broadcast of the initial state from rank 0, then metric averaging; put them first."""
    if not is_keras3():
        from tfdist.horovod.install import import_horovod_keras

        hvd_keras = import_horovod_keras()
        # Horovod's averages the epoch's logs only; evaluate() gets tfdist's.
        return [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                hvd_keras.callbacks.MetricAverageCallback(), MetricAverage(epochs=False)]
    return [BroadcastInitialState(), MetricAverage()]


def broadcast_initial_state(model: Any, optimizer: Any = None, root_rank: int = 0) -> None:
    """Builds the optimizer's slots, then copies the model's and optimizer's variables from
    ``root_rank``, so that every rank starts the first step from the same state."""
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    variables = list(model.variables)
    if optimizer is not None:
        _build_optimizer(optimizer, model.trainable_variables)
        variables += optimizer_variables(optimizer)
    ops.broadcast_variables(variables, root_rank)


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables: a property in Keras 3, a method in tf_keras."""
    try:
        found = optimizer.variables
    except TypeError:  # Horovod's stock wrapper around a Keras 3 optimizer calls the list
        found = super(type(optimizer), optimizer).variables
    return list(found() if callable(found) else found)


def _build_optimizer(optimizer: Any, trainable: list[Any]) -> None:
    if getattr(optimizer, "built", True) is False and hasattr(optimizer, "build"):
        optimizer.build(trainable)  # Keras 3 and tf_keras's new optimizers
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(trainable)  # tf_keras legacy optimizers


class BroadcastInitialState(keras.callbacks.Callback):
    """Keras 3: copies rank 0's weights and optimizer state to every rank at train begin.

    Keras 3's ``fit`` builds the model and the optimizer's slots before ``on_train_begin``, so
    the first step already starts from rank 0's state.
    """

    def on_train_begin(self, logs: Any = None) -> None:
        broadcast_initial_state(self.model)


class MetricAverage(keras.callbacks.Callback):
    """Averages the epoch's (``epochs=True``) and evaluate()'s metrics across ranks, in place,
    so that logs, checkpoints and History see the job's values rather than one rank's shard."""

    def __init__(self, epochs: bool = True) -> None:
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.epochs:
            ops.average_logs(logs, f"tfdist_metrics_epoch_{epoch}")

    def on_test_end(self, logs: Any = None) -> None:
        ops.average_logs(logs, "tfdist_metrics_test")
