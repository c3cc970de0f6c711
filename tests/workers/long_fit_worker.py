"""A 2-worker fit long enough to stop or kill one rank in the middle (tests/test_failures.py):
MWMS, or Horovod with ``TFDIST_BACKEND=horovod``.

Prints ``long-fit: pid PID training`` once its fit has run 20 steps.
"""

from __future__ import annotations

import os
import time

import numpy as np

import tfdist


def main() -> None:
    dist = tfdist.init()
    import tensorflow as tf

    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            time.sleep(0.01)
            if batch == 20:
                print(f"long-fit: pid {os.getpid()} training", flush=True)

    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=200, verbose=0,
              callbacks=dist.callbacks(Announce(), tensorboard=False))


if __name__ == "__main__":
    main()
