"""Mirrors keras-io "Variational AutoEncoder" (examples/generative/vae.py).

Keras mechanisms: a convolutional encoder and a decoder built as functional models and passed
to a VAE(keras.Model) constructor; a Sampling layer drawing normal noise with
keras.random.normal and a SeedGenerator; a custom train_step with tf.GradientTape that sums a
per-image reconstruction loss and a KL term and applies the gradients itself; three
keras.metrics.Mean loss trackers exposed through the `metrics` property; no call() method;
fit on a numpy array with no targets.
"""
# corpus: mwms-k3 hvd-k3
import numpy as np
import tensorflow as tf
import keras
from keras import layers, ops

from tfdist import strategy_scope

keras.utils.set_random_seed(1337)

LATENT_DIM = 2
GLOBAL_BATCH = 64

# Stand-in for the MNIST digits (train and test concatenated, scaled to [0, 1]): 640 images of
# a bright bar at one of a few positions, so the VAE has something to encode.
rng = np.random.RandomState(11)
digits = rng.uniform(0.0, 0.15, size=(640, 28, 28, 1)).astype("float32")
for i in range(len(digits)):
    r = rng.randint(2, 22)
    c = rng.randint(2, 22)
    digits[i, r:r + 5, c:c + 5, 0] = 0.9
mnist_digits = digits


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def build_encoder():
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT_DIM, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT_DIM, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    return keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")


def build_decoder():
    latent_inputs = keras.Input(shape=(LATENT_DIM,))
    x = layers.Dense(7 * 7 * 32, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 32))(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(latent_inputs, decoder_outputs, name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


with strategy_scope() as dist:
    encoder = build_encoder()
    decoder = build_decoder()
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())

history = vae.fit(mnist_digits, epochs=2, batch_size=GLOBAL_BATCH, verbose=2)

z_mean, _, _ = vae.encoder.predict(mnist_digits[:128], verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f} "
      f"kl {history.history['kl_loss'][-1]:.4f}; z_mean spread {float(np.std(z_mean)):.4f}")
