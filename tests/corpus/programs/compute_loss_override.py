"""Mirrors the Keras 3 API docs for `Model.compute_loss` (keras.io/api/models/model_training_apis)
and the "Customizing what happens in fit()" guides' advice to override compute_loss instead of
train_step.

Keras mechanisms: a functional model built by a subclass of keras.Model that overrides
compute_loss(x, y, y_pred, sample_weight, training) to add an extra penalty term (the mean
squared size of the predictions, in keras.ops) to super().compute_loss(...) (the compiled
MeanSquaredError); Keras's own train_step, loss tracker and compiled metric ("mae"); plain fit
and evaluate on numpy arrays. Backend-agnostic.
"""
# corpus: mwms-k3 hvd-k3 jax
import numpy as np
import keras
from keras import layers, ops

from tfdist import strategy_scope

keras.utils.set_random_seed(5)

GLOBAL_BATCH = 32
PENALTY = 0.1

rng = np.random.RandomState(9)
x_train = rng.normal(size=(640, 20)).astype("float32")
true_w = rng.normal(size=(20, 1)).astype("float32")
y_train = (np.tanh(x_train @ true_w / 3.0) * 2.0 + 0.05 * rng.normal(size=(640, 1))).astype("float32")
x_test = rng.normal(size=(128, 20)).astype("float32")
y_test = (np.tanh(x_test @ true_w / 3.0) * 2.0).astype("float32")


class PenalizedModel(keras.Model):
    """MSE plus a penalty on large outputs."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        return loss + PENALTY * ops.mean(ops.square(y_pred))


with strategy_scope() as dist:
    inputs = keras.Input(shape=(20,))
    h = layers.Dense(32, activation="relu")(inputs)
    h = layers.Dense(16, activation="relu")(h)
    outputs = layers.Dense(1)(h)
    model = PenalizedModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.MeanSquaredError(),
                  metrics=["mae"])

history = model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
test_loss, test_mae = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f}; test loss {test_loss:.4f} mae {test_mae:.4f}")
