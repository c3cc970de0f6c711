"""fit on a Python generator (steps_per_epoch), then on tf.data.Dataset.from_generator.

Shape of the many tutorials and issue reports that stream data from Python: first
`model.fit(batch_generator(), steps_per_epoch=..., epochs=2)` on an endless generator that
yields global batches `(x, y)` drawn from its own seeded `np.random.RandomState`, then the
same rows through `tf.data.Dataset.from_generator(row_generator, output_signature=...)`
`.batch(GLOBAL_BATCH)` (the tf.data guide's "Consuming Python generators").  A small dense
regressor.  `from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(12)

GLOBAL_BATCH = 32
STEPS = 10
FEATURES = 6
TRUE_W = np.array([[1.5], [-2.0], [0.5], [0.0], [1.0], [-0.5]], dtype="float32")


def make_rows(rng, n):
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ TRUE_W + 0.3 * np.sin(3 * x[:, :1]) + 0.05 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def batch_generator(seed=12):
    rng = np.random.RandomState(seed)
    while True:
        yield make_rows(rng, GLOBAL_BATCH)


def row_generator():
    rng = np.random.RandomState(13)
    x, y = make_rows(rng, GLOBAL_BATCH * STEPS)
    for i in range(len(x)):
        yield x[i], y[i]


with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])

h1 = model.fit(batch_generator(), steps_per_epoch=STEPS, epochs=2, verbose=2)

dataset = tf.data.Dataset.from_generator(
    row_generator,
    output_signature=(
        tf.TensorSpec(shape=(FEATURES,), dtype=tf.float32),
        tf.TensorSpec(shape=(1,), dtype=tf.float32),
    ),
)
h2 = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=2, verbose=2)
print("final loss generator %.5f  from_generator %.5f" % (h1.history["loss"][-1], h2.history["loss"][-1]))
