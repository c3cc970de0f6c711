"""Mirrors keras-io "Image classification from scratch" (examples/vision/image_classification_from_scratch.py)
and the "Working with preprocessing layers" guide's augmentation-inside-the-model pattern.

Keras mechanisms: a data_augmentation Sequential of RandomFlip, RandomRotation and RandomZoom
placed inside a functional model (active only in training), Rescaling, Conv2D/MaxPooling2D,
GlobalAveragePooling2D, Dropout; binary crossentropy from logits with accuracy; fit on numpy
arrays (32x32x3) with validation_data; evaluate.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(123)

IMAGE_SIZE = (32, 32)
GLOBAL_BATCH = 32

# Stand-in for the cats-vs-dogs folder, uint8-range pixels: class 1 is redder than class 0.
rng = np.random.RandomState(17)


def make_data(n):
    y = rng.randint(0, 2, size=(n, 1)).astype("float32")
    x = rng.uniform(0, 180, size=(n, 32, 32, 3)).astype("float32")
    x[:, :, :, 0] += 70.0 * y[:, :, None]
    return x, y


x_train, y_train = make_data(512)
x_val, y_val = make_data(128)


def make_model(input_shape):
    data_augmentation = keras.Sequential(
        [
            layers.RandomFlip("horizontal"),
            layers.RandomRotation(0.1),
            layers.RandomZoom(0.1),
        ],
        name="data_augmentation",
    )
    inputs = keras.Input(shape=input_shape)
    x = data_augmentation(inputs)
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(16, 3, strides=2, padding="same", activation="relu")(x)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1)(x)
    return keras.Model(inputs, outputs)


with strategy_scope() as dist:
    model = make_model(input_shape=IMAGE_SIZE + (3,))
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(name="acc")],
    )

history = model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2,
                    validation_data=(x_val, y_val), verbose=2)
val_loss, val_acc = model.evaluate(x_val, y_val, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f}; val loss {val_loss:.4f} acc {val_acc:.4f}")
