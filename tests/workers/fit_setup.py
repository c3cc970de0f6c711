"""The long 2-worker fit that the failure workers share (fault_fit_worker.py,
long_fit_worker.py, stall_worker.py): 4096 rows of 8 features, a two-layer model built in the
strategy's scope, batches of 32 split by rank, 200 epochs, and one callback of the worker's own
that acts at a step (kills, stops, stalls or announces)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def fit(dist: Any, at_step: Callable[[Any, int], None], **options: Any) -> None:
    """Trains until the worker's ``at_step(callback, batch)``, called after every batch, ends
    the run; ``options`` go to ``dist.callbacks`` (TensorBoard is off)."""
    import tensorflow as tf

    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class AtStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            at_step(self, batch)

    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=200, verbose=0,
              callbacks=dist.callbacks(AtStep(), tensorboard=False, **options))
