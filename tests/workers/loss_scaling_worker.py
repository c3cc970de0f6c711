"""Two user-shaped models whose losses Keras scales for the replicas (tests/test_loss_scaling.py):

- ``fit1``: a custom ``train_step`` (the DCGAN and distillation examples' shape) that calls a
  ``keras.losses`` object on its batch, applies the gradients itself, and logs that loss twice:
  returned as it is, and through a ``keras.metrics.Mean`` tracker;
- ``fit2``: a compiled ``keras.losses.Loss`` subclass whose ``call`` returns one number for the
  batch (the supervised-contrastive example's shape; here a mean over rows, so one process's
  number is reachable).

Run by ``tfdist verify``'s machinery in one process and on 2 workers; nothing random.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist import strategy_scope

keras = tf.keras
rng = np.random.RandomState(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)


class LoggedLoss(keras.Model):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.MeanSquaredError()
        self.tracker = keras.metrics.Mean(name="tracked")

    @property
    def metrics(self):  # type: ignore[no-untyped-def]
        return [self.tracker]

    def train_step(self, batch):  # type: ignore[no-untyped-def]
        features, target = batch
        with tf.GradientTape() as tape:
            loss = self.loss_fn(target, self(features, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.tracker.update_state(loss)
        return {"step_loss": loss, "tracked": self.tracker.result()}


class OneNumber(keras.losses.Loss):
    def call(self, y_true, y_pred):  # type: ignore[no-untyped-def]
        return tf.reduce_mean(tf.square(y_true - y_pred))


def dense(model_class):  # type: ignore[no-untyped-def]
    inputs = keras.Input((8,))
    return model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, "relu")(inputs)))


with strategy_scope() as dist:
    logged = dense(LoggedLoss)
    logged.compile(optimizer=keras.optimizers.SGD(0.05))
    one_number = dense(keras.Model)
    one_number.compile(optimizer=keras.optimizers.SGD(0.05), loss=OneNumber())
logged.fit(dist.shard(data), epochs=2, verbose=0)
one_number.fit(dist.shard(data), epochs=2, verbose=0)
