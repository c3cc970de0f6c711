"""Mirrors keras-io "Simple MNIST convnet" (examples/vision/mnist_convnet.py).

Keras mechanisms: a Sequential Conv2D/MaxPooling2D/Flatten/Dropout/Dense model on 28x28x1
images, categorical crossentropy with accuracy, a tf.data pipeline shuffled with a seed
(shuffle(seed=...)) and batched with the global batch, fit, evaluate, and predict on a single
image (x[:1], one row: fewer rows than workers).
"""
# corpus: mwms-k3 hvd-k3 jax
import numpy as np
import tensorflow as tf
import keras
from keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(1337)

NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
GLOBAL_BATCH = 64

# Stand-in for keras.datasets.mnist: 768 train / 256 test images whose label is the image
# quadrant/stripe with the brightest block, so the convnet can learn it.
rng = np.random.RandomState(7)


def make_digits(n):
    x = rng.uniform(0.0, 0.3, size=(n, 28, 28, 1)).astype("float32")
    y = rng.randint(0, NUM_CLASSES, size=n)
    for i, label in enumerate(y):
        r, c = divmod(int(label), 5)
        x[i, 2 + r * 12:2 + r * 12 + 10, 1 + c * 5:1 + c * 5 + 5, 0] += 0.7
    return x, y


x_train, y_train = make_digits(768)
x_test, y_test = make_digits(256)
y_train = keras.utils.to_categorical(y_train, NUM_CLASSES)
y_test = keras.utils.to_categorical(y_test, NUM_CLASSES)
print("x_train shape:", x_train.shape)

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=INPUT_SHAPE),
            layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(NUM_CLASSES, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
model.summary()

train_ds = tf.data.Dataset.from_tensor_slices((x_train, y_train))
train_ds = train_ds.shuffle(len(x_train), seed=42).batch(GLOBAL_BATCH)
test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(GLOBAL_BATCH)

model.fit(dist.shard(train_ds), epochs=2, verbose=2)

score = model.evaluate(dist.shard(test_ds), verbose=0)
print("Test loss:", score[0])
print("Test accuracy:", score[1])

probs = model.predict(x_test[:1], verbose=0)
print(f"predict on one image: shape {probs.shape}, class {int(np.argmax(probs[0]))}, "
      f"label {int(np.argmax(y_test[0]))}")
print(f"final test loss {score[0]:.4f} accuracy {score[1]:.4f}")
