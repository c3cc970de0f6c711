"""A global batch of 33 (odd) with drop_remainder=True: every step's batch is odd-sized.

Shape of the tf.data + Keras examples that pick a batch size without thinking of the replica
count (the keras-io guide "Training & evaluation with the built-in methods", batched with
`drop_remainder=True` as the distributed-training guides recommend): 700 rows, a global batch
of 33 so each of the 21 steps holds 33 rows (7 rows dropped), a small dense classifier, then
`evaluate` on the same pipeline.  `from tensorflow import keras`, valid for Keras 3 and
tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(15)

GLOBAL_BATCH = 33
N = 700

rng = np.random.RandomState(15)
x = rng.uniform(-1, 1, size=(N, 8)).astype("float32")
y = (np.sin(3 * x[:, 0]) + x[:, 1] * x[:, 2] > 0).astype("float32")

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(8,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])

dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
train = dist.shard(dataset)
history = model.fit(train, epochs=2, verbose=2)
loss, acc = model.evaluate(train, verbose=0)
weight_sum = float(sum(np.asarray(w).sum() for w in model.get_weights()))
print("final loss %.5f  evaluate %.5f/%.4f  weight sum %.6f" % (history.history["loss"][-1], loss, acc, weight_sum))
