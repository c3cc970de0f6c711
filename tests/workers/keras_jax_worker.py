"""Keras 3 on JAX (``KERAS_BACKEND=jax``): one small model trained the tfdist way.

    python keras_jax_worker.py OUT MODE

MODE ``dist``: ``tfdist.init()``, each rank seeded with its own rank (tfdist must start every
rank from rank 0's weights); ``one``: the same in one plain process, seeded as rank 0; ``control``:
no tfdist, each process seeded with its rank from ``tfdist.detect()`` and training alone on
everything (its weights must differ from the other rank's); ``desync``: rank 1's copy of a
variable changed by hand before ``fit`` (:func:`_desync`).

The model has a BatchNormalization layer. It trains one epoch on in-memory arrays with
validation arrays, then one on a ``tf.data`` dataset through ``dist.shard`` whose every batch
takes ``DECODE_S`` to make (the input advice's case, the arrays' epoch its control); then
``evaluate`` and ``predict``; then a second model with its own ``train_step`` trains one
epoch. Each rank writes ``OUT/rank-N.json`` (history, results, predictions' shape and sum, the
second model's history) and ``OUT/rank-N.npz`` (the weights of both, in order).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import numpy as np

import tfdist
from tfdist import patches
from tfdist.keras import iterators

ROWS, GLOBAL_BATCH = 256, 32
# Each batch of the dataset epoch takes this long to make: far slower than a step, even under
# load. At 0.15 s a run on a machine oversubscribed about six times (load 12 on 2 cores) took
# 0.17 s a step to compute: the decode kept up, the input wait was 0.007 s, the test failed.
DECODE_S = 0.4


def main(out: str, mode: str) -> None:
    if mode == "desync":
        return _desync()
    dist = tfdist.init() if mode != "control" else None
    rank = dist.rank if dist else tfdist.detect().rank
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(rank)  # the ranks' seeds differ; one process is seeded as 0
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x[:, :2] * 3 + 1).astype("float32")
    with dist.scope() if dist else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.BatchNormalization(),
                                  keras.layers.Activation("relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    callbacks = dist.callbacks(model_dir=os.path.join(out, "model")) if dist else []
    arrays = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False,
                       validation_data=(x[:64], y[:64]), callbacks=callbacks)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).map(
        lambda a, b: (tf.ensure_shape(tf.numpy_function(_slow, [a], tf.float32, stateful=True),
                                      [None, 8]), b))
    datasets = model.fit(dist.shard(dataset) if dist else dataset, epochs=1, verbose=0,
                         callbacks=callbacks)
    results = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    predicted = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    # fewer rows than ranks, and a last batch that leaves a rank none: every row, no hang
    few = [model.predict(x[:rows], batch_size=GLOBAL_BATCH, verbose=0) for rows in (1, 33)]
    custom = _custom_step(keras, dist, x, y)
    weights = model.get_weights() + custom.get_weights()
    np.savez(os.path.join(out, f"rank-{rank}.npz"), *weights)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"history": {**arrays.history, **{f"ds_{k}": v for k, v in
                                                     datasets.history.items()}},
                   "evaluate": results, "custom": custom.history.history,
                   "predicted": [list(predicted.shape), float(predicted.sum())],
                   "few": [[list(p.shape), float(p.sum())] for p in few],
                   "replicas": dist.num_replicas if dist else 1,
                   "patches": _patches() if dist else None,
                   "freed_elsewhere": iterators.freed(wait_s=10)}, f)


def _patches() -> dict:
    """The patches this process installed, in order, and those the inventory plans for its
    launch (tfdist.patches.plan), by phase: the test holds the two together."""
    where = patches.plan()
    assert where is not None, "tfdist.init installed no patches"
    return {"installed": [p.key for p in patches.installed()],
            "planned": {phase: [p.key for p in patches.planned(where, phase)]
                        for phase in patches.PHASES}}


def _slow(rows: np.ndarray) -> np.ndarray:
    """A decode far slower than the step (stateful: tf.data cannot run it in parallel)."""
    time.sleep(DECODE_S)
    return rows


def _custom_step(keras, dist, x, y):
    """A model whose own ``train_step`` (JAX's stateless form) returns values that are no
    compiled metric: the spread of the labels in the step's batch, which equals one process's
    only when each step sees the GLOBAL batch, and the rows the compiled step sees. Trained one
    epoch on arrays, then one on a ``PyDataset`` with loader processes (each rank must read its
    part of every batch: read whole on every rank, the step would see twice the rows)."""
    import jax

    class Custom(keras.Model):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            inputs, labels = data

            def loss_of(values):
                outputs, kept = self.stateless_call(values, non_trainable, inputs,
                                                    training=True)
                return keras.ops.mean((outputs - labels) ** 2), kept

            (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable)
            spread = keras.ops.max(labels) - keras.ops.min(labels)
            rows = keras.ops.cast(keras.ops.shape(labels)[0], "float32")  # the global batch's
            return ({"loss": loss, "spread": spread, "rows": rows},
                    (trainable, non_trainable, optimizer_variables, metrics_variables))

    with dist.scope() if dist else contextlib.nullcontext():
        inputs = keras.Input((8,))
        model = Custom(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    first = model.history.history

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return ROWS // GLOBAL_BATCH

        def __getitem__(self, index):
            rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
            return x[rows], y[rows]

    model.fit(Batches(workers=2, use_multiprocessing=True), epochs=1, verbose=0, shuffle=False)
    model.history.history = {key: first[key] + values
                             for key, values in model.history.history.items()}
    return model


def _desync() -> None:
    """Rank 1's own copy of the first kernel moved by 1e-3 (by hand: JAX assumes the copies of a
    replicated array equal and never compares them), then ``fit`` with ``dist.callbacks()``:
    the replica sync check after the first step must stop both ranks, naming rank 1."""
    dist = tfdist.init()
    import jax
    import keras

    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    kernel = model.layers[0].kernel
    shard = kernel.value.addressable_shards[0]
    mine = np.asarray(shard.data) + np.float32(1e-3 * dist.rank)
    kernel._value = jax.make_array_from_single_device_arrays(
        kernel.value.shape, kernel.value.sharding, [jax.device_put(mine, shard.device)])
    x = np.random.default_rng(0).normal(size=(ROWS, 8)).astype("float32")
    model.fit(x, x[:, :2], batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
              callbacks=dist.callbacks())
    print(f"tfdist-test: rank {dist.rank} trained on", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
