"""Mirrors the Keras guide "Making new layers and models via subclassing", sections "The
add_loss() method" (ActivityRegularizationLayer) and the VAE's KL term written as a layer,
used inside a functional model trained by plain fit.

Keras mechanisms: a subclassed layer whose call() does self.add_loss(rate * tf.reduce_sum(x))
(the guide's activity regulariser: a SUM over the rows the layer sees, so its size depends on
the batch each replica holds); a second subclassed layer whose call() adds a KL-divergence
regulariser, averaged over the rows, with self.add_loss and returns its inputs unchanged; both
inside a functional classifier compiled with a plain loss; Keras adds model.losses to the
compiled loss; fit on numpy arrays with validation_split; evaluate.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(808)

GLOBAL_BATCH = 32
NUM_CLASSES = 3

rng = np.random.RandomState(16)
x_all = rng.normal(size=(800, 20)).astype("float32")
proj = rng.normal(size=(20, NUM_CLASSES)).astype("float32")
y_all = np.argmax(x_all @ proj, axis=1)
x_train, y_train = x_all[:640], y_all[:640]
x_test, y_test = x_all[640:], y_all[640:]


class ActivityRegularizationLayer(layers.Layer):
    def __init__(self, rate=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * tf.reduce_sum(inputs))
        return inputs


class KLDivergenceLayer(layers.Layer):
    """Identity on (z_mean, z_log_var); adds the KL divergence to N(0, 1) as a loss."""

    def __init__(self, weight=0.1, **kwargs):
        super().__init__(**kwargs)
        self.weight = weight

    def call(self, inputs):
        z_mean, z_log_var = inputs
        kl = -0.5 * tf.reduce_sum(1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var), axis=-1)
        self.add_loss(self.weight * tf.reduce_mean(kl))
        return inputs


with strategy_scope() as dist:
    inputs = keras.Input(shape=(20,))
    h = layers.Dense(32, activation="relu")(inputs)
    h = ActivityRegularizationLayer(1e-3)(h)
    z_mean = layers.Dense(8, name="z_mean")(h)
    z_log_var = layers.Dense(8, name="z_log_var")(h)
    z_mean, z_log_var = KLDivergenceLayer(0.1)([z_mean, z_log_var])
    features = layers.Concatenate()([z_mean, z_log_var])
    outputs = layers.Dense(NUM_CLASSES, activation="softmax")(features)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2,
                    validation_split=0.2, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f} val_loss {history.history['val_loss'][-1]:.4f}; "
      f"test loss {loss:.4f} acc {accuracy:.4f}; {len(model.losses)} added losses")
