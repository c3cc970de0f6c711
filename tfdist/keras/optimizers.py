"""The optimizers a Keras model trains with, and how to build them again before a resume.

A model's training state is its weights and the state of every optimizer it holds:
``model.optimizer``, and the optimizers a GAN's own ``compile(d_optimizer, g_optimizer)`` keeps
as attributes and applies in its own ``train_step`` (:func:`optimizers`). An optimizer's
variables (its step count, its slots) exist only once it is built, and Keras builds one at its
first ``apply_gradients`` (a model's optimizer in one process; a GAN's two always): a resume
must build each before loading, over the variables it trained, or Keras skips its state
("Skipping variable loading for optimizer") and the run goes on with fresh slots.

:func:`record` says, at a save, which optimizers were built and over which of the model's
weights (their positions in ``model.weights``); :func:`build_as_saved` builds them the same way
before the state is loaded. Keras 3 on TensorFlow or JAX and tf_keras's optimizers alike. It
imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_as_saved", "build_one", "entry", "held", "is_built", "is_optimizer",
           "optimizers", "record", "trained", "variables"]


def optimizers(model: Any) -> list[Any]:
    """``model.optimizer`` and every other optimizer the model holds as an attribute (a GAN's
    ``d_optimizer`` and ``g_optimizer``), each once, in that order (the attributes' names
    sorted: the same order in every process of the same program)."""
    return [optimizer for _, optimizer in held(model)]


def held(model: Any) -> list[tuple[str, Any]]:
    """:func:`optimizers` with the attribute each is held by (``optimizer`` first)."""
    found: list[tuple[str, Any]] = []
    attributes = sorted(vars(model).items(), key=lambda item: item[0]) if hasattr(
        model, "__dict__") else []
    for name, value in [("optimizer", getattr(model, "optimizer", None)), *attributes]:
        if is_optimizer(value) and all(value is not seen for _, seen in found):
            found.append((name, value))
    return found


def is_optimizer(value: Any) -> bool:
    """Whether ``value`` is a Keras optimizer (3, or tf_keras's)."""
    return callable(getattr(value, "apply_gradients", None)) and hasattr(value, "iterations")


def variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables (its step count, learning rate where it is one, slots), in its
    order: a property in Keras 3, a method in tf_keras."""
    try:
        found = optimizer.variables
    except TypeError:  # Horovod's stock wrapper around a Keras 3 optimizer calls the list
        found = super(type(optimizer), optimizer).variables
    return list(found() if callable(found) else found)


def is_built(optimizer: Any) -> bool:
    """Whether the optimizer has made its slots: Keras 3's ``built``; a tf_keras optimizer has
    no such flag, its index of the variables it trains is made by ``build``; True for one that
    builds nothing ahead (tf_keras's legacy optimizers)."""
    built = getattr(optimizer, "built", None)
    if built is not None:
        return bool(built)
    if callable(getattr(optimizer, "_var_key", None)) and callable(
            getattr(optimizer, "build", None)):  # tf_keras
        return hasattr(optimizer, "_index_dict")
    return True


def trained(optimizer: Any, weights: list[Any]) -> list[int] | None:
    """The positions in ``weights`` of the variables a built ``optimizer`` trains, in its own
    order; None where that cannot be told (an optimizer of another kind, or one that trains
    variables ``weights`` does not hold)."""
    mine = getattr(optimizer, "_trainable_variables", None)  # Keras 3
    if mine is not None:
        where = {id(weight): i for i, weight in enumerate(weights)}
        found = [where.get(id(variable)) for variable in mine]
        return None if None in found else [int(i) for i in found]  # type: ignore[arg-type]
    index, key = getattr(optimizer, "_index_dict", None), getattr(optimizer, "_var_key", None)
    if isinstance(index, dict) and callable(key):  # tf_keras: the variables' keys, in order
        where = {key(weight): i for i, weight in enumerate(weights)}
        if any(k not in where for k in index):
            return None
        return [where[k] for k, _ in sorted(index.items(), key=lambda item: item[1])]
    return None


def entry(optimizer: Any, weights: list[Any]) -> dict[str, Any]:
    """What a save records of ``optimizer``: whether it is built, and over which of
    ``weights`` (``variables``: their positions; None where not known)."""
    built = is_built(optimizer)
    return {"built": built, "variables": trained(optimizer, weights) if built else None}


def record(model: Any) -> list[dict[str, Any]]:
    """For a save's ``state.json``: each of :func:`optimizers` (:func:`entry`, over
    ``model.weights``), with the attribute that holds it and its class."""
    weights = list(getattr(model, "weights", []))
    return [{"attribute": name, "class": type(optimizer).__name__, **entry(optimizer, weights)}
            for name, optimizer in held(model)]


def build_one(optimizer: Any, was: dict[str, Any], weights: list[Any]) -> bool:
    """Builds ``optimizer`` as :func:`entry` ``was`` says it was built, over ``weights``, where
    it is not built yet. False where it cannot be (the variables it trained are not among
    ``weights``)."""
    if not was.get("built") or is_built(optimizer):
        return True
    positions = was.get("variables")
    if positions is None or any(i >= len(weights) for i in positions) or not callable(
            getattr(optimizer, "build", None)):
        return False
    optimizer.build([weights[i] for i in positions])
    return True


def build_as_saved(model: Any, saved: list[dict[str, Any]] | None) -> list[str]:
    """Builds each of the model's optimizers that ``saved`` (:func:`record` at the save)
    says was built and is not yet, over the same weights. Without a record (a state saved
    before there was one): ``model.optimizer`` over the trainable variables, as Keras's first
    step builds it. Returns, for each optimizer that cannot be built as saved, why (the
    caller's error names the fix)."""
    found = held(model)
    if saved is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and callable(getattr(optimizer, "build", None)) \
                and not is_built(optimizer):
            optimizer.build(model.trainable_variables)
        return []
    problems = []
    weights = list(getattr(model, "weights", []))
    if len(saved) != len(found):
        return [f"the saved state has {len(saved)} optimizer(s), this model {len(found)}"]
    for (attribute, optimizer), was in zip(found, saved, strict=True):
        if not build_one(optimizer, was, weights):
            problems.append(f"{attribute} ({type(optimizer).__name__}) trained variables the "
                            "model does not hold")
    return problems
