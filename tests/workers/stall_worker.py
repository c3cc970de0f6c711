"""A 2-worker MWMS fit whose rank 1 stays alive but stops entering the collectives
(tests/test_collective_timeout.py).

Every rank prints ``stall: rank R pid P`` at start. At step 20 rank 1 prints ``stall: rank 1
stops training`` and sleeps ``--sleep`` seconds in a callback: its heartbeat goes on, so only a
collective timeout (``TFDIST_COLLECTIVE_TIMEOUT``) ends rank 0's wait.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import tfdist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=300.0)
    args = parser.parse_args()
    dist = tfdist.init()
    print(f"stall: rank {dist.rank} pid {os.getpid()}", flush=True)
    import tensorflow as tf

    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Stall(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if batch == 20 and dist.rank == 1:
                print("stall: rank 1 stops training", flush=True)
                time.sleep(args.sleep)

    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=200, verbose=0,
              callbacks=dist.callbacks(Stall(), tensorboard=False))


if __name__ == "__main__":
    main()
