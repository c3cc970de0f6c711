"""Mirrors the Keras losses API docs (keras.io/api/losses, "Loss class usage": reduction) and
the common "custom loss function" Q&A shape: a regression model whose loss object sums over
the batch, then a second model with a plain Python loss function.

Keras mechanisms: (1) compile(loss=keras.losses.MeanSquaredError(reduction="sum")) with
plain SGD, so the loss value and the gradient scale with the number of rows in a batch;
(2) compile(loss=<python function>) where the function returns per-example values
(tf.reduce_mean over the last axis only) and Keras applies its default reduction; both fit
on numpy arrays, then evaluate.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(55)

GLOBAL_BATCH = 32

rng = np.random.RandomState(15)
x_train = rng.normal(size=(640, 10)).astype("float32")
w = rng.normal(size=(10, 2)).astype("float32")
y_train = (x_train @ w * 0.5 + 0.05 * rng.normal(size=(640, 2))).astype("float32")
x_test = rng.normal(size=(128, 10)).astype("float32")
y_test = (x_test @ w * 0.5).astype("float32")


def build_regressor():
    return keras.Sequential(
        [
            keras.Input(shape=(10,)),
            layers.Dense(32, activation="relu"),
            layers.Dense(2),
        ]
    )


def per_example_mse(y_true, y_pred):
    # One value per example: Keras averages them over the batch.
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


with strategy_scope() as dist:
    summed = build_regressor()
    summed.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3),
                   loss=keras.losses.MeanSquaredError(reduction="sum"))

history_sum = summed.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
sum_test = summed.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)

with dist.scope():
    plain = build_regressor()
    plain.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss=per_example_mse)

history_fn = plain.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
fn_test = plain.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final reduction=sum loss {history_sum.history['loss'][-1]:.4f} (test {sum_test:.4f}); "
      f"function loss {history_fn.history['loss'][-1]:.4f} (test {fn_test:.4f})")
