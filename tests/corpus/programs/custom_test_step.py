"""Mirrors the Keras guide "Customizing what happens in `fit()`" (guides/custom_train_step_in_tensorflow.py),
its sections "A first simple example" and "Providing your own evaluation step".

Keras mechanisms: a functional model built by a CustomModel(keras.Model) subclass that
overrides train_step (tf.GradientTape, self.compute_loss(y=..., y_pred=...) using the loss
given to compile, self.optimizer.apply_gradients) and test_step (self.compute_loss), both
updating the "loss" tracker by hand where Keras 3 needs it and returning
self.compute_metrics(x, y, y_pred) (the compiled metrics' results); compile(optimizer, loss="mse",
metrics=["mae"]); fit and evaluate on numpy arrays.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(31)

GLOBAL_BATCH = 64
KERAS_3 = hasattr(keras, "ops")  # Keras 3 (tf_keras has no keras.ops)

# Stand-in for the guide's np.random.random((1000, 32)) data, with a target the model can
# learn (a noisy linear function) so that the loss moves.
rng = np.random.RandomState(4)
x = rng.random_sample((640, 32)).astype("float32")
w = rng.normal(size=(32, 1)).astype("float32")
y = (x @ w + 0.1 * rng.normal(size=(640, 1))).astype("float32")
x_test = rng.random_sample((192, 32)).astype("float32")
y_test = (x_test @ w).astype("float32")


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        # Keras 3's compute_loss leaves the "loss" tracker to the step; tf_keras's updates it.
        if KERAS_3:
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
        return self.compute_metrics(x, y, y_pred, sample_weight=None)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        # Keras 3's compute_loss leaves the "loss" tracker to the step; tf_keras's updates it.
        if KERAS_3:
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
        return self.compute_metrics(x, y, y_pred, sample_weight=None)


with strategy_scope() as dist:
    inputs = keras.Input(shape=(32,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])

history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
results = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
print(f"final train loss {history.history['loss'][-1]:.4f}; evaluate {results}")
