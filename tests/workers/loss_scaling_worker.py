"""User-shaped models whose losses Keras scales for the replicas (tests/test_loss_scaling.py):

- ``fit1``: a custom ``train_step`` (the DCGAN and distillation examples' shape) that calls a
  ``keras.losses`` object on its batch, applies the gradients itself, and logs that loss twice:
  returned as it is, and through a ``keras.metrics.Mean`` tracker;
- ``fit2``: a compiled ``keras.losses.Loss`` subclass whose ``call`` returns one number for the
  batch (the supervised-contrastive example's shape; here a mean over rows, so one process's
  number is reachable);
- ``fit3``: a model without ``call()`` that holds another and trains it in its own step (the
  VAE and GAN examples' shape), with a Mean tracker;
- ``fit4``: Dropout and a ``keras.random.normal`` draw over the batch (a VAE's sampling), on a
  dataset reshuffled each epoch with a seed;
- ``fit5``: a compiled loss with ``reduction="sum"``;
- ``fit6``: an ``Embedding`` trained with Adam (sparse gradients whose rows repeat: Adam squares
  each slice, so they must reach it as one process's slices, not summed into a dense one);
- ``fit7``: a model whose class overrides ``compute_loss`` to add a penalty's mean to
  ``super().compute_loss(...)`` (the "customizing fit" guides' advice);
- ``fit8``: a custom ``train_step`` that averages its loss over the rows itself (a mean of
  per-row sums, the VAE and WGAN-GP examples' shape) and applies the gradients;
- ``fit9`` (with ``uneven``, MWMS): a global batch of 33 on 199 rows, split 17/16 on every
  step and the last batch's one row leaving a replica none: Keras's losses weighed by each
  replica's rows (and the logs by the rows each replica counted).

Run by ``tfdist verify``'s machinery in one process and on 2 workers (MWMS, or Horovod); the
random draws are seeded.
"""

from __future__ import annotations

import sys

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


class Penalised(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,  # type: ignore[no-untyped-def]
                     training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        return loss + 0.5 * keras.ops.mean(keras.ops.square(y_pred))


def dense(model_class):  # type: ignore[no-untyped-def]
    inputs = keras.Input((8,))
    return model_class(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, "relu")(inputs)))


class NoCall(keras.Model):
    def __init__(self, inner):  # type: ignore[no-untyped-def]
        super().__init__()
        self.inner = inner
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):  # type: ignore[no-untyped-def]
        return [self.tracker]

    def train_step(self, batch):  # type: ignore[no-untyped-def]
        features, target = batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.inner(features) - target))
            scaled = loss / tf.distribute.get_strategy().num_replicas_in_sync
        grads = tape.gradient(scaled, self.inner.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.inner.trainable_variables, strict=True))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


class OwnMean(LoggedLoss):  # its tracker; a step that averages the loss itself
    def train_step(self, batch):  # type: ignore[no-untyped-def]
        features, target = batch
        with tf.GradientTape() as tape:
            error = tf.square(self(features, training=True) - target)
            loss = tf.reduce_mean(tf.reduce_sum(error, axis=1))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.tracker.update_state(loss)
        return {"tracked": self.tracker.result()}


class Noisy(keras.layers.Layer):
    def __init__(self):  # type: ignore[no-untyped-def]
        super().__init__()
        self.seeds = keras.random.SeedGenerator(7)

    def call(self, inputs, training=False):  # type: ignore[no-untyped-def]
        if not training:
            return inputs
        batch = keras.ops.shape(inputs)[0]
        return inputs + 0.1 * keras.random.normal((batch, 16), seed=self.seeds)


def random_model():  # type: ignore[no-untyped-def]
    inputs = keras.Input((8,))
    hidden = Noisy()(keras.layers.Dense(16, "relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dropout(0.3)(hidden)))


with strategy_scope() as dist:
    logged = dense(LoggedLoss)
    logged.compile(optimizer=keras.optimizers.SGD(0.05))
    one_number = dense(keras.Model)
    one_number.compile(optimizer=keras.optimizers.SGD(0.05), loss=OneNumber())
    no_call = NoCall(dense(keras.Model))
    no_call.compile(optimizer=keras.optimizers.SGD(0.05))
    noisy = random_model()
    noisy.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    summed = dense(keras.Model)
    summed.compile(optimizer=keras.optimizers.SGD(0.002),
                   loss=keras.losses.MeanSquaredError(reduction="sum"))
logged.fit(dist.shard(data), epochs=2, verbose=0)
one_number.fit(dist.shard(data), epochs=2, verbose=0)
no_call.fit(dist.shard(data), epochs=2, verbose=0)
shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=3).batch(32)
noisy.fit(dist.shard(shuffled), epochs=2, verbose=0)
summed.fit(dist.shard(data), epochs=2, verbose=0)
tokens = rng.randint(0, 16, size=(256, 4)).astype("int32")
with dist.scope():
    inputs = keras.Input((4,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(16, 6)(inputs))
    embedded = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    embedded.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
embedded.fit(dist.shard(tf.data.Dataset.from_tensor_slices((tokens, y)).batch(32)), epochs=2,
             verbose=0)
with dist.scope():
    penalised = dense(Penalised)
    penalised.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
penalised.fit(dist.shard(data), epochs=2, verbose=0)
with dist.scope():
    own_mean = dense(OwnMean)
    own_mean.compile(optimizer=keras.optimizers.SGD(0.05))
own_mean.fit(dist.shard(data), epochs=2, verbose=0)
if "uneven" in sys.argv[1:]:
    with dist.scope():
        uneven = dense(keras.Model)
        uneven.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    rows = tf.data.Dataset.from_tensor_slices((x[:199], y[:199]))
    uneven.fit(dist.shard(rows.batch(33)), epochs=2, verbose=0)
