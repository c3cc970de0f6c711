"""What ``tfdist verify`` records inside each process of a run it starts.

``tfdist verify`` (:mod:`tfdist.verify.run`) runs the user's script twice: in one process, and
on N workers. In each process the ``verify-record`` patch (:mod:`tfdist.patches`) is installed
when the strategy is created, only when the run was started by ``tfdist verify``
(``TFDIST_VERIFY_DIR`` set). It changes nothing the script computes; it writes down:

- each ``fit`` call's steps: the logs Keras gives its callbacks after each step, the model's
  weights before the first step and after each of the first :data:`WEIGHT_STEPS` steps, each
  epoch's logs, the weights when ``fit`` returns;
- each ``evaluate`` call's result and each ``predict`` call's output (whole where small, else
  its shape, sum and digest);
- tfdist's warnings (what it told the user);
- at the process's end, the weights of every Keras model still alive (custom training loops
  train models that no ``fit`` sees), by model name.

The calls are numbered in the order the script makes them (``fit1``, ``evaluate1``...), the
same in both runs of one script. With ``TFDIST_VERIFY_STEPS=S`` each ``fit`` stops after S
steps (the check a user runs before a long job needs a few). ``TFDIST_VERIFY_SEED`` seeds
Python, NumPy and the framework when the strategy is created, so both runs start from one
state; ``TFDIST_VERIFY_REPLICAS`` makes the one-process run's ``dist.scale_lr`` scale by the
compared run's replicas (the same learning rate in both).

Each rank writes ``record-RANK.json`` (the calls, their logs) and ``record-RANK.npz`` (the
arrays) into ``TFDIST_VERIFY_DIR`` when the process ends, also after an uncaught error.
Imported only by its installer, with the framework up.
"""

from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import inspect
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from tfdist import patches
from tfdist.keras.optimizers import optimizers, variables
from tfdist.verify import DIR, STEPS, seed_once

if TYPE_CHECKING:
    from tfdist.handle import Handle
    from tfdist.patches import Where

__all__ = ["MAX_OUTPUT", "MAX_VALUES", "WEIGHT_STEPS", "install_record"]

# The weights are recorded after each of a fit call's first steps, up to this many.
WEIGHT_STEPS = 64
# A model with more values than this is recorded by digest only (a few steps' copies in memory).
MAX_VALUES = 4_000_000
# A predict output with more values than this is recorded by shape, sum and digest.
MAX_OUTPUT = 200_000


class Book:
    """The record of one process: calls in order, their entries, arrays by key."""

    def __init__(self, rank: int, meta: dict[str, Any]) -> None:
        self.rank = rank
        self.meta = meta
        self.calls: list[dict[str, Any]] = []
        self.arrays: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.depth = 0  # fit calls under way (its validation's evaluate is not a call)

    def call(self, kind: str) -> dict[str, Any]:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        entry: dict[str, Any] = {"name": f"{kind}{self.counts[kind]}", "kind": kind,
                                 "steps": [], "epochs": [], "weights": []}
        self.calls.append(entry)
        return entry

    def weights(self, entry: dict[str, Any], label: str, model: Any) -> None:
        key = f"{entry['name']}/{label}"
        self._put_weights(key, model)
        entry["weights"].append(label)
        moments = _moments(model)
        if moments:  # an optimizer's first moments: the gradient's scale, under Adam too
            names, values = zip(*moments, strict=True)
            self.meta.setdefault("moments", {})[key] = list(names)
            for i, value in enumerate(values):
                self.arrays[f"{key}#moment/{i}"] = value

    def _put_weights(self, key: str, model: Any) -> None:
        values = [np.asarray(v) for v in model.get_weights()]
        names = [_variable_name(v) for v in model.weights]
        self.meta.setdefault("variables", {})[key] = names
        if sum(v.size for v in values) > MAX_VALUES:
            self.meta.setdefault("digests", {})[key] = _digest(values)
            return
        for i, value in enumerate(values):
            self.arrays[f"{key}/{i}"] = value

    def output(self, entry: dict[str, Any], value: Any) -> None:
        flat = [np.asarray(v) for v in _flatten(value)]
        entry["outputs"] = [{"shape": list(v.shape), "sum": float(np.sum(v, dtype=np.float64))
                             if v.dtype.kind in "fiub" else None, "digest": _digest([v])}
                            for v in flat]
        for i, v in enumerate(flat):
            if v.size <= MAX_OUTPUT and v.dtype.kind in "fiub":
                self.arrays[f"{entry['name']}/output/{i}"] = v

    def final(self) -> None:
        """The weights of every Keras model alive now, by name (custom loops)."""
        seen: dict[str, Any] = {}
        for model in _live_models():
            seen.setdefault(str(getattr(model, "name", "model")), model)
        self.meta["models"] = sorted(seen)
        for name, model in seen.items():
            try:
                self._put_weights(f"final/{name}", model)
            except Exception as error:  # a model never built has no weights to read
                self.meta.setdefault("unread", {})[name] = str(error)[:200]

    def write(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        arrays: dict[str, Any] = dict(self.arrays)
        np.savez(os.path.join(folder, f"record-{self.rank}.npz"), **arrays)
        data = {"rank": self.rank, "meta": self.meta, "calls": self.calls}
        path = os.path.join(folder, f"record-{self.rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f, default=_plain)
        os.replace(path + ".tmp", path)


def _moments(model: Any) -> list[tuple[str, np.ndarray]]:
    """The first-moment (momentum) variables of the model's optimizers, by name: linear in the
    gradients, so their ratio to one process's is the gradient's even where the update is not
    (Adam's first step). Small models only (the weights' bound)."""
    found: list[tuple[str, np.ndarray]] = []
    seen: set[int] = set()
    for optimizer in optimizers(model):
        for variable in variables(optimizer):
            name = _variable_name(variable)
            if id(variable) in seen or not any(m in name.lower() for m in _MOMENT_NAMES):
                continue
            seen.add(id(variable))
            value = np.asarray(variable)
            if value.size and sum(v.size for _, v in found) + value.size <= MAX_VALUES:
                found.append((name, value))
    return found


_MOMENT_NAMES = ("momentum", "/m/", "_m:", "/m:")


def _variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def _digest(values: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _flatten(value[k])]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _plain(value: Any) -> Any:
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return str(value)


def _scalars(logs: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in dict(logs or {}).items():
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            continue
        if array.size == 1:
            out[str(key)] = float(array.reshape(()))
    return out


def _live_models() -> list[Any]:
    found = []
    for obj in gc.get_objects():
        try:
            cls = type(obj)
            if any(c.__name__ in ("Model", "Functional", "Sequential")
                   and c.__module__.split(".")[0] in ("keras", "tf_keras")
                   for c in cls.__mro__) and getattr(obj, "built", False):
                found.append(obj)
        except Exception:  # an object whose type lookup fails is no model of ours
            continue
    # A model held inside another (a GAN's generator) is recorded with it and on its own.
    return found


_book: list[Book] = []


def install_record(where: Where, dist: Handle) -> None:
    """Patch ``verify-record``'s installer (runs under ``tfdist verify`` only, once)."""
    if _book:
        return
    from tfdist.backend_facts import JAX

    if where.backend.framework == JAX:
        import keras
    else:
        import tensorflow as tf

        keras = tf.keras
    meta = {"rank": dist.rank, "world_size": dist.world_size, "backend": where.backend.name,
            "replicas": dist.num_replicas, "keras3": where.keras3,
            # Horovod's step logs are each rank's own; the others' are the job's.
            "step_logs": "own" if where.backend.horovod else "global",
            "random_layers": []}
    book = Book(dist.rank, meta)
    _book.append(book)
    logging.getLogger("tfdist").addHandler(_Warnings(book))
    seed_once()  # where TensorFlow's first op has not seeded the run already
    steps = int(os.environ.get(STEPS, "0") or 0)
    folder = os.environ[DIR]
    model_class = keras.Model
    patches.apply("verify-record", model_class, "fit",
                  lambda original: _fit(original, book, keras, steps))
    patches.apply("verify-record", model_class, "evaluate",
                  lambda original: _returned(original, book, "evaluate"))
    patches.apply("verify-record", model_class, "predict",
                  lambda original: _returned(original, book, "predict"))
    atexit.register(_write, book, folder)


class _Warnings(logging.Handler):
    """tfdist's warnings in this process, into the record: what tfdist told the user."""

    def __init__(self, book: Book) -> None:
        super().__init__(logging.WARNING)
        self.book = book

    def emit(self, record: logging.LogRecord) -> None:
        said = self.book.meta.setdefault("warnings", [])
        line = record.getMessage().splitlines()[0] if record.getMessage() else ""
        if line and line not in said:
            said.append(line)


def _write(book: Book, folder: str) -> None:
    book.meta["patches"] = [patch.key for patch in patches.installed()]
    try:
        book.final()
    finally:
        book.write(folder)


def _random_layers(model: Any) -> list[str]:
    names = []
    stack = [model]
    seen: set[int] = set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        kind = type(layer).__name__
        if kind in _RANDOM_LAYERS or kind.startswith("Random"):
            names.append(f"{kind} '{getattr(layer, 'name', '?')}'")
        elif kind == "BatchNormalization" and not getattr(layer, "synchronized", False):
            names.append(f"{kind} '{getattr(layer, 'name', '?')}' (batch statistics)")
        stack.extend(getattr(layer, "layers", None) or getattr(layer, "_layers", None) or [])
        stack.extend(v for v in vars(layer).values()
                     if type(v).__module__.split(".")[0] in ("keras", "tf_keras")
                     and hasattr(v, "trainable_weights") and v is not layer)
    return sorted(set(names))


_RANDOM_LAYERS = frozenset({"Dropout", "SpatialDropout1D", "SpatialDropout2D",
                            "SpatialDropout3D", "GaussianNoise", "GaussianDropout",
                            "AlphaDropout"})


def _fit(original: Any, book: Book, keras: Any, steps: int) -> Any:
    class Recorder(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
        def __init__(self, entry: dict[str, Any]) -> None:
            super().__init__()
            self.entry = entry
            self.count = 0

        def on_train_begin(self, logs: Any = None) -> None:
            book.weights(self.entry, "initial", self.model)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.count += 1
            self.entry["steps"].append(_scalars(logs))
            if self.count <= WEIGHT_STEPS:
                book.weights(self.entry, f"step{self.count}", self.model)
            if steps and self.count >= steps:
                self.model.stop_training = True

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.entry["epochs"].append(_scalars(logs))

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = book.call("fit")
        entry["model"] = str(getattr(self, "name", "model"))

        def add_recorder(bound: inspect.BoundArguments) -> None:
            given = bound.arguments.get("callbacks")
            bound.arguments["callbacks"] = [*list(given or []), Recorder(entry)]

        book.depth += 1
        try:
            return patches.rebinding(original, add_recorder)(self, *args, **kwargs)
        finally:
            book.depth -= 1
            entry["random_layers"] = _random_layers(self)
            for name in entry["random_layers"]:
                if name not in book.meta["random_layers"]:
                    book.meta["random_layers"].append(name)
            if getattr(self, "built", False):
                book.weights(entry, "end", self)

    return fit


def _returned(original: Any, book: Book, kind: str) -> Any:
    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if book.depth:  # fit's validation: in the epoch's logs
            return original(self, *args, **kwargs)
        entry = book.call(kind)
        entry["model"] = str(getattr(self, "name", "model"))
        result = original(self, *args, **kwargs)
        if kind == "evaluate":
            entry["result"] = _scalars(result if isinstance(result, dict) else
                                       dict(enumerate(_flatten(result))))
        else:
            book.output(entry, result)
        return result

    return call

