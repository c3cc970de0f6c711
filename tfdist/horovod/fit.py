"""``model.fit`` under Horovod: the optimizer wrapper and callbacks, for Keras 3 and tf_keras.

tf_keras (Keras 2) uses Horovod's own ``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``
and ``MetricAverageCallback``. Keras 3 cannot: Horovod's optimizer wrapper silently stops
averaging there, and its callbacks fail (``.ref``, ``keras.backend.constant``). For Keras 3 tfdist
averages the gradients in ``optimizer.apply`` and broadcasts and averages with its own callbacks,
all on Horovod's core collective ops (:mod:`tfdist.horovod.ops`).

:func:`install_hooks` also makes ``Model.fit`` behave as under MultiWorkerMirroredStrategy where
plain Horovod would not: arrays passed to ``fit`` are split by rank (:func:`shard_arrays`), and
a model Keras 3 would build lazily in the first step is built before the initial broadcast, so
that every rank starts from rank 0's weights. ``jit_compile=True`` trains without XLA, with a
warning: Horovod's ops cannot be compiled by XLA.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tfdist import patches
from tfdist.horovod import ops
from tfdist.keras_compat import compile_owner, compile_without_xla
from tfdist.sharding import is_arrays

__all__ = ["DistributedOptimizer", "callbacks", "install_hooks", "is_keras3", "shard_arrays"]

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

    Patches this optimizer's ``apply`` (Keras 3) or ``apply_gradients`` (tf_keras) and returns
    it: the instance keeps its class, so saved models load without tfdist, and a custom
    ``train_step`` that calls ``apply_gradients`` itself is averaged too (Horovod's own tf_keras
    wrapper averages only in ``minimize``). An optimizer already wrapped by tfdist is returned
    as it is.
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
        apply_gradients = optimizer.apply_gradients

        @functools.wraps(apply_gradients)
        def averaged_apply_gradients(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            grads = ops.allreduce_gradients([g for g, _ in pairs], "average")
            # No strict=: this runs in fit's tf.function, and TensorFlow 2.12's autograph zip
            # takes none.
            return apply_gradients(list(zip(grads, [v for _, v in pairs])),  # noqa: B905
                                   *args, **kwargs)

        object.__setattr__(optimizer, "apply_gradients", averaged_apply_gradients)
        object.__setattr__(optimizer, _MARK, True)
        return optimizer
    apply = optimizer.apply

    @functools.wraps(apply)
    def averaged_apply(grads: Any, trainable_variables: Any = None) -> Any:
        return apply(ops.allreduce_gradients(list(grads), "average"), trainable_variables)

    object.__setattr__(optimizer, "apply", averaged_apply)
    object.__setattr__(optimizer, _MARK, True)
    return optimizer


def install_hooks(rank: int, world_size: int) -> None:
    """Wraps ``Model.compile`` (gradient averaging, no XLA) and ``Model.fit`` (arrays split by
    rank); with Keras 3 also the symbolic build (models built before the first step). Once."""
    model_class = keras.Model
    if not patches.apply("horovod-fit", compile_owner(model_class), "compile", _compile_hook):
        return  # installed already
    compile_without_xla(model_class, "Horovod's all-reduce cannot be compiled by XLA; "
                        "backend='mwms' with NCCL on GPUs can")
    patches.apply("horovod-fit", model_class, "fit",
                  lambda original: _fit_hook(original, rank, world_size))
    if world_size > 1:
        patches.apply("horovod-fit", model_class, "evaluate", _evaluate_hook)
        patches.apply("horovod-fit", model_class, "predict", _predict_hook)
    if is_keras3():
        from keras.src.backend.tensorflow import trainer

        patches.apply("horovod-fit", trainer.TensorFlowTrainer, "_maybe_symbolic_build",
                      _build_hook)


def _evaluate_hook(original: Any) -> Any:
    """``evaluate`` returns the metrics over every rank's examples, as under MWMS: each rank
    evaluates its shard, then the metrics' states (totals and counts) are summed over the
    ranks, so uneven shards weigh by their examples."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        return_dict = bool(bound.arguments.get("return_dict", False))
        bound.arguments["return_dict"] = True
        original(*bound.args, **bound.kwargs)
        variables = [v for metric in self.metrics for v in metric.variables]
        if variables:
            summed = ops.reduce([tf.convert_to_tensor(v) for v in variables], "sum")
            for variable, value in zip(variables, summed, strict=True):
                variable.assign(value)
        logs = {name: float(value) for name, value in self.get_metrics_result().items()}
        if return_dict:
            return logs
        return _in_order(self, logs)

    return evaluate


def _predict_hook(original: Any) -> Any:
    """``predict`` on a dataset that ``dist.shard`` split by rank predicts every row, in order,
    on every rank, as under MWMS (each rank would otherwise return its own slices)."""
    @functools.wraps(original)
    def predict(self: Any, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        from tfdist.horovod.sharding import whole

        return original(self, whole(x) if whole(x) is not None else x, *args, **kwargs)

    return predict


def _in_order(model: Any, logs: dict[str, float]) -> Any:
    """``evaluate``'s list result (a scalar for one metric), in Keras's order."""
    if hasattr(model, "_flatten_metrics_in_order"):  # Keras 3
        return model._flatten_metrics_in_order(logs)
    from tfdist.keras_compat import keras2_module

    training = keras2_module("engine.training")
    return training.flatten_metrics_in_order(logs, model.metrics_names)


def _compile_hook(original: Any) -> Any:
    @functools.wraps(original)
    def compile(self: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
        if not is_keras3():  # Horovod's wrapper must be in place before compile uses it
            optimizer = DistributedOptimizer(keras.optimizers.get(optimizer))
        else:
            # Keras 3 turns XLA on for GPUs ("auto"); Horovod's ops cannot be XLA-compiled.
            kwargs["jit_compile"] = False
        result = original(self, optimizer, *args, **kwargs)
        if is_keras3():
            DistributedOptimizer(self.optimizer)
        return result

    return compile


def _fit_hook(original: Any, rank: int, world_size: int) -> Any:
    def split(bound: inspect.BoundArguments) -> None:
        if world_size > 1 and is_arrays(bound.arguments.get("x")):
            bound.arguments.update(shard_arrays(bound.arguments, rank, world_size))
        given = bound.arguments.get("callbacks")
        if world_size > 1 and (given is None or isinstance(given, list | tuple)) and not any(
                type(c).__name__ in _BROADCASTS for c in given or ()):
            # A script's own fit, without dist.callbacks(): rank 0's initial state and the
            # epoch's averaged logs all the same, or the ranks would train apart.
            bound.arguments["callbacks"] = [*callbacks(), *(given or ())]

    return patches.rebinding(original, split)


_BROADCASTS = ("BroadcastInitialState", "BroadcastGlobalVariablesCallback")


def _build_hook(original: Any) -> Any:
    # Keras 3 builds a model symbolically before training only under a tf.distribute strategy;
    # without one (Horovod) it builds in the first step, after the initial broadcast has found
    # no variables. Build it the same way here, from the first batch (fit resets the iterator).
    @functools.wraps(original)
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        if self._distribute_strategy is None and (iterator is not None or data_batch is not None):
            return self._symbolic_build(iterator=iterator, data_batch=data_batch)
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def shard_arrays(arguments: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The ``fit`` arguments that make this rank train on its part of in-memory arrays: the
    dataset of :func:`tfdist.sharding.arrays_as_dataset`, of which each rank keeps its slice of
    every global batch (:func:`tfdist.horovod.sharding.shard`), as MultiWorkerMirroredStrategy
    splits arrays.

    Raises:
        ConfigError: see :func:`tfdist.sharding.arrays_as_dataset`.
    """
    from tfdist.horovod.sharding import shard
    from tfdist.sharding import arrays_as_dataset

    changed = arrays_as_dataset(arguments, world_size)
    changed["x"] = shard(changed["x"], rank, world_size)
    return changed


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
