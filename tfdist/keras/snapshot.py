"""A Keras model's exact state as host arrays: what a background save writes
(:mod:`tfdist.background`) and a resume assigns back.

:func:`take` copies every weight of the model and every variable of its optimizer (its step
count, its learning rate where it is a variable, its slots) to numpy arrays on the training
thread, at the agreed step; :func:`write` puts them in one file of raw bytes
(``variables.bin``, with its index ``variables.json``: no archive, no checksum pass, so the
writer thread costs the training processes little processor time) from the writer thread
while training goes on; :func:`restore` assigns them in the same order to a model and
optimizer built the same way (``fit``'s resume builds the optimizer first). For Keras 3 on
TensorFlow or JAX and tf_keras alike: their variables turn into numpy arrays and take
``assign``. It imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

__all__ = ["FILE", "optimizer_variables", "restore", "take", "write"]

FILE = "variables.json"  # the index of variables.bin: each array's key, dtype, shape, offset
_DATA = "variables.bin"


def optimizer_variables(model: Any) -> list[Any]:
    """The variables of ``model``'s optimizer, in its order (none without one)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    found = getattr(optimizer, "variables", [])
    return list(found() if callable(found) else found)  # tf_keras's legacy optimizers: a method


def _variables(model: Any) -> dict[str, Any]:
    found = {f"w{i}": v for i, v in enumerate(getattr(model, "weights", []))}
    found.update({f"o{i}": v for i, v in enumerate(optimizer_variables(model))})
    return found


def _host(variable: Any) -> np.ndarray:
    value = variable.numpy() if callable(getattr(variable, "numpy", None)) else variable
    return np.array(value, copy=True)


def take(model: Any) -> dict[str, np.ndarray]:
    """Copies of the model's weights and its optimizer's variables, by position."""
    return {key: _host(variable) for key, variable in _variables(model).items()}


def write(folder: str, values: dict[str, np.ndarray]) -> None:
    """Writes :func:`take`'s arrays into ``folder``: their bytes, then the index."""
    index, offset = [], 0
    with open(os.path.join(folder, _DATA), "wb") as f:
        for key, value in values.items():
            value = value if value.flags.c_contiguous else value.copy(order="C")
            value.tofile(f)
            index.append([key, value.dtype.str, list(value.shape), offset])
            offset += value.nbytes
    with open(os.path.join(folder, FILE), "w", encoding="utf-8") as f:
        json.dump(index, f)


def _read(path: str) -> dict[str, np.ndarray]:
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    data = os.path.join(os.path.dirname(path), _DATA)
    values = {}
    for key, dtype, shape, offset in index:
        count = int(np.prod(shape))
        value = np.fromfile(data, dtype=np.dtype(dtype), count=count, offset=offset)
        if value.size != count:
            raise ValueError(f"{data} ends inside {key}: a damaged save")
        values[key] = value.reshape(shape)
    return values


def restore(model: Any, path: str) -> None:
    """Assigns the arrays of ``path`` (a :func:`write`) to ``model`` and its optimizer.

    Raises:
        ValueError: they do not fit (another model or optimizer): nothing is assigned.
    """
    variables = _variables(model)
    values = _read(path)
    if set(values) != set(variables):
        raise ValueError(f"{path} holds {len(values)} arrays, this model and its optimizer "
                         f"have {len(variables)} variables")
    for key, variable in variables.items():
        if tuple(values[key].shape) != tuple(variable.shape):
            raise ValueError(f"{path}: {key} has shape {values[key].shape}, the variable "
                             f"{getattr(variable, 'path', getattr(variable, 'name', key))} "
                             f"{tuple(variable.shape)}")
    for key, variable in variables.items():
        variable.assign(values[key])
