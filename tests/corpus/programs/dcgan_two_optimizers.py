"""Mirrors keras-io "DCGAN to generate face images" (examples/generative/dcgan_overriding_train_step.py).

Keras mechanisms: a GAN(keras.Model) holding a generator and a discriminator; an overridden
compile(d_optimizer, g_optimizer, loss_fn) that calls super().compile() with no arguments;
a train_step that draws latent noise with tf.random.normal, adds noise to the labels, and calls
a keras.losses.BinaryCrossentropy object (default reduction) on the per-replica batch inside
two GradientTapes, one per network, each applied by its own Adam optimizer; Mean trackers for
d_loss and g_loss exposed through `metrics`. Images 16x16x1 from a seeded, shuffled tf.data
pipeline built before the strategy scope.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(42)

LATENT_DIM = 16
GLOBAL_BATCH = 32

# Stand-in for the CelebA faces folder (image_dataset_from_directory, then / 255): 512 small
# grey images with a soft blob, in [0, 1].
rng = np.random.RandomState(3)
yy, xx = np.mgrid[0:16, 0:16]
images = np.empty((512, 16, 16, 1), dtype="float32")
for i in range(len(images)):
    cy, cx = rng.uniform(4, 12, size=2)
    blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 8.0)
    images[i, :, :, 0] = np.clip(blob + rng.normal(0, 0.05, size=(16, 16)), 0, 1)
dataset = tf.data.Dataset.from_tensor_slices(images).shuffle(512, seed=7).batch(GLOBAL_BATCH)


def build_discriminator():
    return keras.Sequential(
        [
            keras.Input(shape=(16, 16, 1)),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Flatten(),
            layers.Dropout(0.2),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )


def build_generator():
    return keras.Sequential(
        [
            keras.Input(shape=(LATENT_DIM,)),
            layers.Dense(4 * 4 * 32),
            layers.Reshape((4, 4, 32)),
            layers.Conv2DTranspose(32, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(1, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        # The trick from the example: noise on the labels.
        labels += 0.05 * tf.random.uniform(tf.shape(labels))

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


with strategy_scope() as dist:
    gan = GAN(discriminator=build_discriminator(), generator=build_generator(),
              latent_dim=LATENT_DIM)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0002),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0002),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )

history = gan.fit(dist.shard(dataset), epochs=2, verbose=2)

samples = gan.generator(tf.random.normal((4, LATENT_DIM)))
print(f"final d_loss {history.history['d_loss'][-1]:.4f} "
      f"g_loss {history.history['g_loss'][-1]:.4f}; sample mean {float(tf.reduce_mean(samples)):.4f}")
