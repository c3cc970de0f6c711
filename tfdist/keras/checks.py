"""What tfdist checks of a Keras model before its first step on several processes.

A model's own ``train_step``/``test_step`` (:func:`own_step`, pure), the optimizer's
gradient accumulation and clipping (:func:`check_optimizer`), compiled metrics made outside the
scope (:func:`check_metrics`), ``compile(jit_compile=True)`` where XLA cannot compile the step's
all-reduce (:func:`compile_without_xla`, patch ``compile-without-xla``), and a Keras 3 model
under ``TF_USE_LEGACY_KERAS=1`` (:func:`install_mixed_keras`, patch ``mixed-keras``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras.versions import trainer_class

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["MIXED_KERAS", "check_empty_replicas", "check_metrics", "check_optimizer",
           "compile_owner", "compile_without_xla", "install_compile_without_xla",
           "install_mixed_keras", "own_step", "owns"]

logger = logging.getLogger("tfdist")


_LIBRARIES = frozenset({"keras", "tf_keras", "tensorflow", "tfdist"})


def owns(model: Any, name: str) -> bool:
    """Whether ``model``'s class defines method ``name`` itself, outside Keras and tfdist
    (pure)."""
    owner = next((c for c in type(model).__mro__ if name in vars(c)), None)
    return owner is not None and owner.__module__.split(".")[0] not in _LIBRARIES


def own_step(model: Any) -> str | None:
    """The name of the first of ``train_step``, ``test_step`` that ``model``'s class defines
    itself (outside Keras and tfdist), or ``None`` (pure)."""
    if model is None:
        return None
    return next((name for name in ("train_step", "test_step") if owns(model, name)), None)


def check_optimizer(optimizer: Any, is_chief: bool = True) -> None:
    """What Keras 3's optimizer does differently on several MWMS workers, before the first step:
    ``gradient_accumulation_steps`` fails upstream ("merge_call called while defining a new
    graph"): refused with the fix; clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``)
    is applied to each replica's gradients before they are averaged, not to the average as in
    one process: one warning saying so.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` is set.
    """
    if optimizer is None:
        return
    if getattr(optimizer, "gradient_accumulation_steps", None):
        from tfdist.errors import ConfigError

        raise ConfigError(
            f"{type(optimizer).__name__}(gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}) fails in Keras 3 under several "
            "MultiWorkerMirroredStrategy workers (upstream: 'merge_call called while defining "
            "a new graph'). Raise the global batch instead (more workers already add to it), "
            "or train with backend='horovod', which accumulates correctly")
    clipping = {name: getattr(optimizer, name, None)
                for name in ("clipnorm", "global_clipnorm", "clipvalue")}
    clipping = {name: value for name, value in clipping.items() if value is not None}
    if clipping and is_chief and id(optimizer) not in _optimizer_warned:
        _optimizer_warned.add(id(optimizer))
        logger.warning(
            "tfdist: %s (%s) clips each replica's gradients before they are averaged (Keras 3 "
            "under tf.distribute), not their average as one process does: the weights differ "
            "from one process's while clipping is active. backend='horovod' or tf_keras clip "
            "the averaged gradients", getattr(optimizer, "name", type(optimizer).__name__),
            ", ".join(f"{k}={v}" for k, v in clipping.items()))


_optimizer_warned: set[int] = set()


def check_empty_replicas(model: Any, rows_left: int | None, num_replicas: int) -> None:
    """Refuses, before the first step, an epoch whose last batch (``rows_left`` rows) leaves a
    replica no rows when ``model`` has a BatchNormalization layer that normalises each
    replica's own rows: the empty batch's statistics are NaN, then its moving statistics and,
    averaged, every replica's.

    Raises:
        ConfigError: naming the layer, the rows and the fix.
    """
    if not rows_left or rows_left >= num_replicas or num_replicas < 2:
        return
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False)) if callable(flatten) else []
    normalising = next((layer for layer in layers
                        if any(c.__name__ == "BatchNormalization" for c in type(layer).__mro__)
                        and not getattr(layer, "synchronized", False)), None)
    if normalising is None:
        return
    from tfdist.errors import ConfigError

    raise ConfigError(
        f"each epoch's last batch holds {rows_left} row(s) for {num_replicas} replicas, so "
        f"{num_replicas - rows_left} of them get none, and BatchNormalization "
        f"({normalising.name}) on an empty batch makes its statistics, then every weight, NaN. "
        "Batch with drop_remainder=True (arrays: pass a number of rows the batch size "
        "divides), or pick a batch size that leaves at least one row per replica")


def check_metrics(model: Any) -> None:
    """Refuses a compiled metric object that was created outside the strategy's scope (Keras 3
    accepts it, tf_keras refuses it): under several MultiWorkerMirroredStrategy workers its
    state stays each worker's own, so its results differ from rank to rank and from one
    process's. The same answer on every rank, before the first step.

    Raises:
        ConfigError: naming the metric and the fix.
    """
    compiled = getattr(model, "_compile_metrics", None)
    strategy = model.distribute_strategy
    stack = [getattr(compiled, name, None) for name in ("_user_metrics", "_user_weighted_metrics")]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif any(not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
                 for v in getattr(item, "variables", None) or ()):
            from tfdist.errors import ConfigError

            name = getattr(item, "name", type(item).__name__)
            raise ConfigError(
                f"the metric {name} ({type(item).__name__}) was created outside `with "
                "dist.scope():`: under several MultiWorkerMirroredStrategy workers its state "
                "stays each worker's own, and its results differ from rank to rank and from "
                "one process's (tf_keras refuses it too). Create it inside the scope, or pass "
                "its name to compile (metrics=['auc'])")


def compile_without_xla(model_class: Any, reason: str) -> None:
    """Makes ``compile(jit_compile=True)`` compile without XLA, with one warning saying why.

    For the launches where XLA cannot compile the step's all-reduce: MWMS on CPUs (TensorFlow
    has no XLA collectives for CPU devices, b/194942685; with NCCL on GPUs it has) and Horovod
    (its ops are not XLA ops). The script runs unchanged; only the step is not XLA-compiled.
    """
    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("jit_compile") is True:
                if not _warned:
                    logger.warning("tfdist: compile(jit_compile=True) trains without XLA here: "
                                   "%s", reason)
                    _warned.append(True)
                kwargs["jit_compile"] = False
            return original(self, *args, **kwargs)

        return compile

    patches.apply("compile-without-xla", compile_owner(model_class), "compile", wrap)


# Why XLA cannot compile the step's all-reduce, per kind of backend (the warning's reason).
_NO_XLA_MWMS = ("TensorFlow has no XLA collectives for CPU devices (b/194942685), so the step's "
                "all-reduce cannot be compiled; with NCCL on GPUs it can")
_NO_XLA_HOROVOD = ("Horovod's all-reduce cannot be compiled by XLA; backend='mwms' with NCCL on "
                   "GPUs can")


def install_compile_without_xla(where: Where, dist: Any) -> None:
    """Patch ``compile-without-xla``'s installer (:func:`tfdist.patches.install`): MWMS's CPU
    workers and Horovod, each with its reason."""
    import tensorflow as tf

    compile_without_xla(tf.keras.Model, _NO_XLA_HOROVOD if where.backend.horovod
                        else _NO_XLA_MWMS)


def compile_owner(model_class: Any) -> Any:
    """The class that defines ``compile`` for ``model_class`` (Keras 3: ``Trainer``; tf_keras:
    ``Model``), where tfdist wraps it. Keras compiles a loaded model from its saved config only
    where ``compile`` is that class's own (``compile_from_config``: "the model's compile()
    method is custom" otherwise), so a wrapper set on a subclass would leave every
    ``load_model`` without its optimizer."""
    return next(cls for cls in model_class.__mro__ if "compile" in vars(cls))


_warned: list[bool] = []


MIXED_KERAS = (
    "this model is a Keras 3 model (`import keras`), but TF_USE_LEGACY_KERAS=1 makes tf.keras, "
    "and so tfdist's strategy set-up and callbacks, tf_keras (Keras 2): the two do not mix on "
    "several workers (Keras 3's fit fails on PerReplica values; under Horovod its gradients "
    "would not be averaged). Build the model with `tf.keras` (or `import tf_keras as keras`), "
    "or unset TF_USE_LEGACY_KERAS to train with Keras 3")


def install_mixed_keras(where: Where, dist: Any) -> None:
    """Patch ``mixed-keras``'s installer: with ``TF_USE_LEGACY_KERAS=1`` and Keras 3 imported
    too (``import keras``), makes Keras 3 models' ``fit``, ``evaluate`` and ``predict`` raise
    :data:`MIXED_KERAS` instead of failing deep inside TensorFlow (or, under Horovod, training
    without averaging). A script that imports Keras 3 only after :func:`tfdist.init` is not
    seen (the inventory plans it where Keras 3 is imported then)."""
    from tfdist.errors import ConfigError

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise ConfigError(MIXED_KERAS)

        return refuse

    for name in ("fit", "evaluate", "predict"):
        patches.apply("mixed-keras", trainer_class(), name, wrap)
