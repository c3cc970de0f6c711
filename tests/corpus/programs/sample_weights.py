"""Per-sample weights in fit: a numpy `sample_weight` array, then a tf.data of (x, y, w).

Mirrors the keras-io guide "Training & evaluation with the built-in methods", sections
"Using sample weighting and class weighting" (numpy: `fit(x, y, sample_weight=...)`) and
"passing sample weights through a tf.data Dataset" (`Dataset.from_tensor_slices((x, y, w))`),
on its MNIST-like dense classifier with `SparseCategoricalAccuracy`, and a weighted metric
(`weighted_metrics`).  Class 5 rows get weight 2.  `from tensorflow import keras`, valid for
Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(5)

GLOBAL_BATCH = 64
N = 640

rng = np.random.RandomState(5)
prototypes = rng.normal(size=(10, 64)).astype("float32")
y_train = rng.randint(0, 10, size=N).astype("int32")
x_train = prototypes[y_train] + rng.normal(scale=1.5, size=(N, 64)).astype("float32")

sample_weight = np.ones(shape=(len(y_train),), dtype="float32")
sample_weight[y_train == 5] = 2.0

with strategy_scope() as dist:
    inputs = keras.Input(shape=(64,), name="digits")
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="wacc")],
    )

print("Fit with sample weight (numpy)")
h1 = model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)

print("Fit with sample weight (tf.data)")
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train, sample_weight))
train_dataset = dist.shard(train_dataset.batch(GLOBAL_BATCH))
h2 = model.fit(train_dataset, epochs=2, verbose=2)

print(
    "final loss numpy %.5f  tf.data %.5f  wacc %.4f"
    % (h1.history["loss"][-1], h2.history["loss"][-1], h2.history["wacc"][-1])
)
