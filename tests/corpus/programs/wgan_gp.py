"""Mirrors keras-io "WGAN-GP overriding `Model.train_step`" (examples/generative/wgan_gp.py).

Keras mechanisms: a WGAN(keras.Model) with an overridden compile(d_optimizer, g_optimizer,
d_loss_fn, g_loss_fn) taking plain Python loss functions; a train_step that runs d_steps=3
discriminator updates per generator update, each drawing latent noise with tf.random.normal;
a gradient penalty computed with a GradientTape nested inside the discriminator's tape
(random interpolation between real and fake images, gradient norm w.r.t. the inputs); two
Adam optimizers; a generator with BatchNormalization and UpSampling2D, a discriminator with
Dropout; train_step returns the raw loss tensors (no metric objects); fit on a numpy array
of 16x16x1 images with no targets.
"""
# corpus: mwms-k3 hvd-k3
import numpy as np
import tensorflow as tf
import keras
from keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(1234)

IMG_SHAPE = (16, 16, 1)
NOISE_DIM = 16
GLOBAL_BATCH = 32

# Stand-in for Fashion-MNIST scaled to [-1, 1]: 512 images of a bright square at a random spot.
rng = np.random.RandomState(12)
train_images = -np.ones((512,) + IMG_SHAPE, dtype="float32")
for i in range(len(train_images)):
    r, c = rng.randint(0, 10, size=2)
    train_images[i, r:r + 6, c:c + 6, 0] = 1.0
train_images += rng.normal(0.0, 0.1, size=train_images.shape).astype("float32")


def get_discriminator_model():
    img_input = layers.Input(shape=IMG_SHAPE)
    x = layers.Conv2D(16, (5, 5), strides=(2, 2), padding="same")(img_input)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Conv2D(32, (5, 5), strides=(2, 2), padding="same")(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Dropout(0.3)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(1)(x)
    return keras.models.Model(img_input, x, name="discriminator")


def upsample_block(x, filters):
    x = layers.UpSampling2D((2, 2))(x)
    x = layers.Conv2D(filters, (3, 3), padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return layers.LeakyReLU(0.2)(x)


def get_generator_model():
    noise = layers.Input(shape=(NOISE_DIM,))
    x = layers.Dense(4 * 4 * 32, use_bias=False)(noise)
    x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Reshape((4, 4, 32))(x)
    x = upsample_block(x, 32)
    x = upsample_block(x, 16)
    x = layers.Conv2D(1, (3, 3), padding="same", activation="tanh")(x)
    return keras.models.Model(noise, x, name="generator")


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3,
                 gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        """Penalty on the discriminator's gradient norm at interpolated images."""
        alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]

        for _ in range(self.d_steps):
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )

        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


with strategy_scope() as dist:
    g_model = get_generator_model()
    d_model = get_discriminator_model()
    generator_optimizer = keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9)
    discriminator_optimizer = keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9)
    wgan = WGAN(discriminator=d_model, generator=g_model, latent_dim=NOISE_DIM,
                discriminator_extra_steps=3)
    wgan.compile(
        d_optimizer=discriminator_optimizer,
        g_optimizer=generator_optimizer,
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )

history = wgan.fit(train_images, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
print(f"final d_loss {history.history['d_loss'][-1]:.4f} g_loss {history.history['g_loss'][-1]:.4f}")
