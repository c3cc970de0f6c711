"""BatchNormalization's moving statistics across replicas: which they are, whether a backend
must average them, and their mean over every replica at an epoch's end.

Keras updates the moving mean and variance of a BatchNormalization layer that is not
``synchronized`` from each replica's own batches, so the replicas' copies drift apart. tf_keras
under a tf.distribute strategy keeps them as sync-on-read means; everywhere else (Keras 3,
Horovod) tfdist replaces them by their mean at each epoch's end
(:class:`BatchStatisticsAverage`, added by ``dist.callbacks()``), before anything saves or
compares the weights. The replica sync check (:mod:`tfdist.sync`) leaves them out until then.
Imported only after :func:`tfdist.init`, like :mod:`tfdist.keras.callbacks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["BatchStatisticsAverage", "as_tf_variable", "average_batch_statistics",
           "averages_batch_statistics", "batch_statistics", "has_batch_statistics", "to_numpy"]

keras: Any = tf.keras  # Keras 3 or tf_keras, known only at run time


def batch_statistics(model: Any) -> list[Any]:
    """The moving means and variances of the BatchNormalization layers that are not
    ``synchronized``, which each replica updates from its own batches (of the layers built so
    far: a subclassed model's are made by its first batch)."""
    return [v for layer in _layers(model) if _is_unsynced_batch_norm(layer)
            and getattr(layer, "moving_mean", None) is not None
            for v in (layer.moving_mean, layer.moving_variance)]


def has_batch_statistics(model: Any) -> bool:
    """Whether ``model`` holds a BatchNormalization layer that is not ``synchronized``, built
    or not yet (a subclassed model's layers are built by its first batch, after ``fit``
    started)."""
    return any(_is_unsynced_batch_norm(layer) for layer in _layers(model))


def averages_batch_statistics(dist: Handle) -> bool:
    """Whether the replicas' moving statistics need averaging: several replicas, other than
    tf_keras under a tf.distribute strategy, whose statistics are sync-on-read means already."""
    if dist.num_replicas == 1:
        return False
    from tfdist.keras.versions import is_keras3

    return not dist.facts.keras2_synced_batch_norm or is_keras3(keras)


def average_batch_statistics(dist: Handle, model: Any) -> int:
    """Replaces every replica's BatchNormalization moving statistics by their mean over all
    replicas (the copies this process holds, one per device, then the ranks, in one
    collective); returns how many values it averaged. Every rank must call it."""
    variables = batch_statistics(model)
    if not variables:
        return 0
    local = [_mean_of_copies(as_tf_variable(v)) for v in variables]
    flat = np.concatenate([value.reshape(-1).astype(np.float64) for value in local])
    mean = np.asarray(dist.sum_over_ranks(flat.tolist()), dtype=np.float64) / dist.world_size
    offset = 0
    for variable, value in zip(variables, local, strict=True):
        part = mean[offset:offset + value.size].reshape(value.shape).astype(value.dtype)
        variable.assign(part)
        offset += value.size
    return int(flat.size)


class BatchStatisticsAverage(keras.callbacks.Callback):
    """Averages the ranks' BatchNormalization moving statistics at each epoch's end, before
    anything saves or compares the weights: every rank then holds the same model, and the
    chief's checkpoint reflects all the data, as tf_keras's sync-on-read statistics do."""

    def __init__(self, dist: Handle) -> None:
        super().__init__()
        self.dist = dist

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        average_batch_statistics(self.dist, self.model)


def _mean_of_copies(variable: Any) -> np.ndarray:
    """The mean of a mirrored variable's per-device copies (the value itself for one)."""
    copies = [to_numpy(c) for c in getattr(variable, "values", (variable,))]
    if len(copies) == 1:
        return copies[0]
    return (np.sum([c.astype(np.float64) for c in copies], axis=0) / len(copies)).astype(
        copies[0].dtype)


def _layers(model: Any) -> list[Any]:
    flatten = getattr(model, "_flatten_layers", None)  # Keras 3 and tf_keras: nested layers too
    return list(flatten(include_self=True, recursive=True)) if flatten else list(model.layers)


def _is_unsynced_batch_norm(layer: Any) -> bool:
    return (isinstance(layer, keras.layers.BatchNormalization)
            and not getattr(layer, "synchronized", False))


def to_numpy(value: Any) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def as_tf_variable(variable: Any) -> Any:
    # Keras 3 wraps the tf.Variable (a DistributedVariable under a strategy) in `.value`;
    # a tf_keras variable is the tf.Variable itself, and its `.value` is a method.
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable
