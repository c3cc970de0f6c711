"""Regression with a Huber loss, MAE, and a custom keras.metrics.Metric (a weighted mean).

Shape of the keras-io guide "Training & evaluation with the built-in methods", section
"Custom metrics" (a `keras.metrics.Metric` subclass with `add_weight` state variables,
`update_state`, `result`, `reset_state`), on a small regression in the spirit of the
"Regression" tutorials: `keras.losses.Huber(delta=1.0)`, `metrics=["mae", WeightedMeanError()]`
where the custom metric is the mean absolute error weighted by |y_true| + 1 (its state: a
weighted sum and a weight sum), `fit` on numpy arrays with `validation_data`, then `evaluate`.
`from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(17)

GLOBAL_BATCH = 32
N = 800


class WeightedMeanError(keras.metrics.Metric):
    def __init__(self, name="weighted_mean_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.weighted_sum = self.add_weight(name="weighted_sum", shape=(), initializer="zeros")
        self.weight_total = self.add_weight(name="weight_total", shape=(), initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = tf.cast(y_true, self.dtype)
        y_pred = tf.cast(y_pred, self.dtype)
        weights = tf.abs(y_true) + 1.0
        if sample_weight is not None:
            weights = weights * tf.reshape(tf.cast(sample_weight, self.dtype), tf.shape(weights))
        self.weighted_sum.assign_add(tf.reduce_sum(weights * tf.abs(y_true - y_pred)))
        self.weight_total.assign_add(tf.reduce_sum(weights))

    def result(self):
        return tf.math.divide_no_nan(self.weighted_sum, self.weight_total)

    def reset_state(self):
        self.weighted_sum.assign(0.0)
        self.weight_total.assign(0.0)


rng = np.random.RandomState(17)
x = rng.normal(size=(N, 10)).astype("float32")
y = (2.0 * x[:, :1] - x[:, 1:2] * x[:, 2:3] + 0.2 * rng.standard_t(3, size=(N, 1))).astype("float32")
x_train, y_train = x[:640], y[:640]
x_val, y_val = x[640:], y[640:]

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(10,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(5e-3),
        loss=keras.losses.Huber(delta=1.0),
        metrics=["mae", WeightedMeanError()],
    )

history = model.fit(
    x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, validation_data=(x_val, y_val), verbose=2
)
results = model.evaluate(x_val, y_val, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
print(
    "final loss %.5f  val_weighted_mean_error %.5f  evaluate %s"
    % (
        history.history["loss"][-1],
        history.history["val_weighted_mean_error"][-1],
        " ".join("%s=%.5f" % (k, v) for k, v in sorted(results.items())),
    )
)
