"""``model.fit`` under Horovod: the optimizer wrapper and callbacks, for Keras 3 and tf_keras.

Keras 3 cannot use Horovod's Keras parts: its optimizer wrapper silently stops averaging there,
and its callbacks fail (``.ref``, ``keras.backend.constant``). For both Kerases tfdist averages
the gradients in the optimizer itself (:func:`DistributedOptimizer`) and broadcasts rank 0's
state before the first step with its own callback (:class:`BroadcastInitialState`), all on
Horovod's core collective ops (:mod:`tfdist.horovod.ops`). Horovod's own tf_keras
``BroadcastGlobalVariablesCallback`` broadcasts after the first step, which every rank took
from its own weights, and copies rank 0's metric states over the others' (a first epoch's
metrics then count rank 0's first batch twice and the others' not at all).

:func:`install_horovod_fit` (patch ``horovod-fit``) also makes ``Model.fit`` behave as under
MultiWorkerMirroredStrategy where plain Horovod would not: arrays passed to ``fit`` are split by
rank (:func:`shard_arrays`), and a model Keras 3 would build lazily in the first step is built
before the initial broadcast, so that every rank starts from rank 0's weights. Other rows of
the inventory do the rest on Horovod as on MWMS: the epoch's, validation's and ``evaluate``'s
results over every rank's examples (``epoch-results``: :mod:`tfdist.keras.step_results`), and
``jit_compile=True`` trained without XLA, with a warning (``compile-without-xla``: Horovod's ops
cannot be compiled by XLA).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import patches
from tfdist.horovod import ops
from tfdist.keras import optimizers
from tfdist.keras.checks import compile_owner
from tfdist.keras.fit_inputs import (
    ARRAYS_ORDER,
    GENERATOR,
    SEQUENCE_ORDER,
    is_arrays,
    is_generator,
    is_sequence,
    loader_threads,
    warn_about_arrays,
    warn_once,
)
from tfdist.keras.versions import trainer_class

__all__ = ["DistributedOptimizer", "callbacks", "install_horovod_fit", "is_keras3",
           "shard_arrays"]

if TYPE_CHECKING:
    from tfdist.patches import Where

logger = logging.getLogger("tfdist")
keras: Any = tf.keras  # Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1
_MARK = "_tfdist_averages_gradients"


def is_keras3() -> bool:
    """Whether ``tf.keras`` is Keras 3 (not tf_keras)."""
    from tfdist.keras.versions import is_keras3 as check

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


def install_horovod_fit(where: Where, dist: Any) -> None:
    """Patch ``horovod-fit``'s installer (:func:`tfdist.patches.install`): wraps
    ``Model.compile`` (gradient averaging) and ``Model.fit`` (arrays split by rank); on several
    ranks ``Model.predict`` (every row of a dataset ``dist.shard`` split); with Keras 3 the
    symbolic build (models built before the first step). Once. The rows that Horovod shares
    with MWMS (``compile-without-xla``, ``sequence-one-order``, ``epoch-results``) have their
    own installers."""
    model_class = keras.Model
    rank, world_size = int(dist.rank), int(dist.world_size)
    if not patches.apply("horovod-fit", compile_owner(model_class), "compile",
                         lambda original: _compile_hook(original, world_size)):
        return  # installed already
    patches.apply("horovod-fit", model_class, "fit",
                  lambda original: _fit_hook(original, rank, world_size))
    if world_size > 1:
        patches.apply("horovod-fit", model_class, "predict", _predict_hook)
    if is_keras3():
        patches.apply("horovod-fit", trainer_class(), "_maybe_symbolic_build",
                      _build_hook)


def _predict_hook(original: Any) -> Any:
    """``predict`` on a dataset that ``dist.shard`` split by rank predicts every row, in order,
    on every rank, as under MWMS (each rank would otherwise return its own slices)."""
    @functools.wraps(original)
    def predict(self: Any, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        from tfdist.horovod.sharding import whole

        return original(self, whole(x) if whole(x) is not None else x, *args, **kwargs)

    return predict


def summed_over_ranks(loss: Any, world_size: int) -> Any:
    """A compiled loss object with ``reduction="sum"`` made to sum over the job's rows: each
    rank's values times ``world_size``, which Horovod's average of the ranks' gradients (and
    of their logged losses) turns into the sum one process takes over the global batch. Any
    other loss (and a dict or list of them, each) as given."""
    if isinstance(loss, dict):
        return {key: summed_over_ranks(value, world_size) for key, value in loss.items()}
    if isinstance(loss, list | tuple):
        return type(loss)(summed_over_ranks(value, world_size) for value in loss)
    reduction = str(getattr(loss, "reduction", "")).lower()
    if world_size > 1 and reduction == "mean_with_sample_weight":
        logger.warning(
            "tfdist: Horovod: %s(reduction='mean_with_sample_weight') divides each rank's "
            "weighted sum by its own weights' sum; averaged over the ranks that is not one "
            "process's weighted mean where the ranks' weights differ. Fix: "
            "reduction='sum_over_batch_size', or the backend mwms (which divides by every "
            "rank's weights)", type(loss).__name__)
    if world_size < 2 or reduction not in ("sum", "reduction.sum"):
        return loss
    scaled = copy.copy(loss)
    call = loss.call

    def summed(y_true: Any, y_pred: Any) -> Any:
        return call(y_true, y_pred) * world_size

    scaled.call = summed
    return scaled


def _compile_hook(original: Any, world_size: int) -> Any:
    @functools.wraps(original)
    def compile(self: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
        if "loss" in kwargs:
            kwargs["loss"] = summed_over_ranks(kwargs["loss"], world_size)
        elif args:
            args = (summed_over_ranks(args[0], world_size), *args[1:])
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
        from tfdist.horovod.sharding import generator_slices, sequence_slices

        x = bound.arguments.get("x")
        if world_size > 1:
            loader_threads(bound.arguments, rank == 0)
            _every_optimizer_averaged(bound.arguments.get("self"))
        if world_size > 1 and is_arrays(x):
            if rank == 0:
                warn_about_arrays(bound.arguments, world_size)
                if bound.arguments.get("shuffle", True):
                    warn_once(ARRAYS_ORDER)
            bound.arguments.update(shard_arrays(bound.arguments, rank, world_size))
        elif world_size > 1 and is_sequence(x):  # each rank its part of every global batch
            if rank == 0 and bound.arguments.get("shuffle", True):
                warn_once(SEQUENCE_ORDER)
            bound.arguments["x"] = sequence_slices(x, rank, world_size)
        elif world_size > 1 and is_generator(x):
            if rank == 0:
                warn_once(GENERATOR)
            bound.arguments["x"] = generator_slices(x, rank, world_size)
        given = bound.arguments.get("callbacks")
        if world_size > 1 and (given is None or isinstance(given, list | tuple)) and not any(
                type(c).__name__ in _BROADCASTS for c in given or ()):
            # A script's own fit, without dist.callbacks(): rank 0's initial state and the
            # epoch's averaged logs all the same, or the ranks would train apart.
            given = bound.arguments["callbacks"] = [*callbacks(), *(given or ())]
        if world_size > 1 and isinstance(given, list | tuple):
            from tfdist.keras.keras3 import reads_step_logs

            if reads_step_logs(given):
                # each rank's step logs are its own rows'; a callback that reads them (and
                # stops the training at a threshold) would act on some ranks only: a hang
                bound.arguments["callbacks"] = [_StepLogsAveraged(), *given]

    return patches.rebinding(original, split)


_BROADCASTS = ("BroadcastInitialState", "BroadcastGlobalVariablesCallback")


def _every_optimizer_averaged(model: Any) -> None:
    """Every optimizer ``model`` holds averages its gradients over the ranks, not only the one
    given to ``compile``: a GAN's ``compile(d_optimizer, g_optimizer, loss_fn)`` calls
    ``super().compile()`` without one and its ``train_step`` applies the gradients with its
    own two; left as they were, each rank trained the networks on its own rows' gradients
    (the corpus's DCGAN and WGAN-GP ended with other weights on each rank)."""
    if model is not None:
        for optimizer in optimizers.optimizers(model):
            DistributedOptimizer(optimizer)


class _StepLogsAveraged(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """First among a fit's callbacks where one reads each step's logs: they are averaged over
    the ranks, in place, before any other callback reads them (Horovod's logs are each rank's
    own rows'; MWMS averages them itself)."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        ops.average_logs(logs, "tfdist_step_logs")

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        ops.average_logs(logs, "tfdist_test_step_logs")


def _build_hook(original: Any) -> Any:
    # Keras 3 builds a model symbolically before training only under a tf.distribute strategy;
    # without one (Horovod) it builds in the first step, after the initial broadcast has found
    # no variables. Build it the same way here, from the first batch (fit resets the iterator).
    @functools.wraps(original)
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        if self._distribute_strategy is None and (iterator is not None or data_batch is not None):
            from tfdist.keras.keras3 import (
                build_without_call,
                built_or_deferred,
                lacks_call,
                peeked_batch,
                spec_batch,
            )

            if lacks_call(self):
                return build_without_call(self)
            # a PyDataset's or generator's batch, or a tf.data input's specs: not drawn from
            # the iterator (a reshuffling dataset would train epoch 1 on its second order)
            peeked = peeked_batch(iterator) if data_batch is None else None
            if peeked is None and data_batch is None:
                peeked = spec_batch(iterator)
            if peeked is not None:
                return built_or_deferred(lambda: self._symbolic_build(data_batch=peeked), self)
            return built_or_deferred(
                lambda: self._symbolic_build(iterator=iterator, data_batch=data_batch), self)
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def shard_arrays(arguments: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The ``fit`` arguments that make this rank train on its part of in-memory arrays: the
    dataset of :func:`tfdist.keras.fit_inputs.arrays_as_dataset`, of which each rank keeps its
    slice of
    every global batch (:func:`tfdist.horovod.sharding.shard`), as MultiWorkerMirroredStrategy
    splits arrays.

    Raises:
        ConfigError: see :func:`tfdist.keras.fit_inputs.arrays_as_dataset`.
    """
    from tfdist.horovod.sharding import shard
    from tfdist.keras.fit_inputs import arrays_as_dataset

    changed = arrays_as_dataset(arguments, world_size)
    changed["x"] = shard(changed["x"], rank, world_size)
    return changed


def callbacks() -> list[Any]:
    """Broadcast of the initial state from rank 0; put it first. (The epoch's and evaluate's
    results are over every rank's examples without a callback: :mod:`tfdist.keras.step_results`.)"""
    return [BroadcastInitialState()]


def broadcast_initial_state(model: Any, optimizer: Any = None, root_rank: int = 0) -> None:
    """Builds the optimizer's slots, then copies the model's and optimizer's variables from
    ``root_rank``, so that every rank starts the first step from the same state."""
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    # tf_keras counts a subclassed model's metrics among its variables: their states stay each
    # rank's own (tfdist.keras.step_results adds them over the ranks).
    metrics = {id(v) for metric in getattr(model, "metrics", ()) for v in metric.variables}
    variables = [v for v in model.variables if id(v) not in metrics]
    if optimizer is not None:
        _build_optimizer(optimizer, model.trainable_variables)
        variables += optimizers.variables(optimizer)
    ops.broadcast_variables(variables, root_rank)


def _build_optimizer(optimizer: Any, trainable: list[Any]) -> None:
    if getattr(optimizer, "built", True) is False and hasattr(optimizer, "build"):
        optimizer.build(trainable)  # Keras 3 and tf_keras's new optimizers
    elif hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(trainable)  # tf_keras legacy optimizers


class BroadcastInitialState(keras.callbacks.Callback):
    """Copies rank 0's weights and optimizer state to every rank before the first step.

    Keras 3: at the first batch's begin, after every ``on_train_begin`` (a backup or a
    preempted state restored on any rank: rank 0's wins, so a rank that restored a stale state
    of its own cannot train apart); ``fit`` has built the model by then (tfdist's build hook).
    tf_keras: at train begin for a model made from ``keras.Input`` (a batch hook would have
    tf_keras warn that it is slow), after the first step for a model built by it, as Horovod's
    own callback does.
    """

    def __init__(self) -> None:
        super().__init__()
        self._done = False

    def on_train_begin(self, logs: Any = None) -> None:
        self._done = False
        if not is_keras3() and getattr(self.model, "built", False):
            self._broadcast()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self._done and is_keras3():
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._done:
            self._broadcast()

    def _broadcast(self) -> None:
        broadcast_initial_state(self.model)
        self._done = True
