"""Mirrors keras-io "Convolutional autoencoder for image denoising"
(examples/vision/autoencoder.py) and the classic "Building Autoencoders in Keras" blog post,
with the noise added inside the model by a GaussianNoise layer.

Keras mechanisms: a functional convolutional autoencoder whose first layer is
GaussianNoise (active only in training), Conv2D/Conv2DTranspose, binary crossentropy; fit(x, x)
on numpy arrays (the input is also the target) with validation_split=0.2 (the last 20% of
rows, taken before shuffling); evaluate and predict on held-out images.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(77)

GLOBAL_BATCH = 64

# Stand-in for MNIST digits in [0, 1]: a bright cross at a random position.
rng = np.random.RandomState(6)


def make_images(n):
    x = np.zeros((n, 28, 28, 1), dtype="float32")
    for i in range(n):
        r, c = rng.randint(4, 24, size=2)
        x[i, r - 3:r + 3, c - 1:c + 1, 0] = 1.0
        x[i, r - 1:r + 1, c - 3:c + 3, 0] = 1.0
    return x


train_data = make_images(640)
test_data = make_images(128)

with strategy_scope() as dist:
    inputs = keras.Input(shape=(28, 28, 1))
    x = layers.GaussianNoise(0.3)(inputs)
    # Encoder
    x = layers.Conv2D(16, (3, 3), activation="relu", padding="same", strides=2)(x)
    x = layers.Conv2D(8, (3, 3), activation="relu", padding="same", strides=2)(x)
    # Decoder
    x = layers.Conv2DTranspose(8, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2DTranspose(16, (3, 3), strides=2, activation="relu", padding="same")(x)
    outputs = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    autoencoder = keras.Model(inputs, outputs, name="denoising_autoencoder")
    autoencoder.compile(optimizer="adam", loss="binary_crossentropy")

history = autoencoder.fit(
    x=train_data,
    y=train_data,
    epochs=2,
    batch_size=GLOBAL_BATCH,
    shuffle=True,
    validation_split=0.2,
    verbose=2,
)
test_loss = autoencoder.evaluate(test_data, test_data, batch_size=GLOBAL_BATCH, verbose=0)
reconstructed = autoencoder.predict(test_data, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f} val_loss {history.history['val_loss'][-1]:.4f}; "
      f"test loss {test_loss:.4f}; predict {reconstructed.shape}")
