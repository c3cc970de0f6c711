"""A script whose first TensorFlow work is its data, before ``strategy_scope()``, as public
Keras examples are written: on several workers tfdist starts at that first op
(tfdist.autostart). Prints each rank's final weights' digest, then tries to switch settings."""

import numpy as np
import tensorflow as tf

import tfdist
from tfdist import strategy_scope

keras = tf.keras
keras.utils.set_random_seed(0)
x = np.random.RandomState(0).normal(size=(128, 4)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)  # the runtime starts here
with strategy_scope() as dist:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(dist.shard(data), epochs=1, verbose=0)
from tfdist.sync import digest, model_variables  # noqa: E402

print(f"rank {dist.rank}: weights {digest(model_variables(model))}", flush=True)
try:
    tfdist.init(collective="ring")
except tfdist.ConfigError as error:
    print(f"rank {dist.rank}: refused: {error}", flush=True)
