"""A small regression with its own ``train_step``, for ``tfdist verify`` (tests/test_verify.py).

``PLANT`` plants a defect a user's step can have on several replicas, which one process does not
show:

- unset: correct: the loss is averaged over the global batch (``compute_average_loss``), and
  the logged value is unscaled (times the replicas);
- ``double``: the loss is the replica's own mean, one number for its rows, written as its sum
  over its rows divided by their count (which tfdist cannot tell from a sum that is right as
  it is, so it does not scale it as it scales a ``tf.reduce_mean`` of a step's own): the
  replicas' sum doubles the gradient on 2 replicas;
- ``half``: the logged value is the scaled loss: half of one process's on 2 replicas.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tfdist import strategy_scope

PLANT = os.environ.get("PLANT", "")
GLOBAL_BATCH = 32
keras = tf.keras
rng = np.random.RandomState(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")


class Regression(keras.Model):
    def train_step(self, data):  # type: ignore[no-untyped-def]
        features, target = data
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(self(features, training=True) - target), -1)
            if PLANT == "double":
                rows = tf.cast(tf.shape(per_example)[0], per_example.dtype)
                loss = tf.reduce_sum(per_example) / rows
            else:
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss if PLANT in ("half", "double") else loss * replicas}


with strategy_scope() as dist:
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = Regression(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
data = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
model.fit(data, epochs=2, verbose=2)
