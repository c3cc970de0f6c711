"""One worker of ``tfdist scaling``'s end-to-end tests: a small Keras model on random data.

    tfdist scaling -n 1,2 tests/workers/scaling_worker.py [--epochs 2] [--steps 48]

It trains as any tfdist script does: ``tfdist.init()``, the GLOBAL batch through
``dist.shard``, and ``dist.callbacks()``, whose throughput meter appends the chief's record of
each epoch to ``TFDIST_THROUGHPUT_FILE`` (set by ``tfdist scaling``, or by the job of
``tfdist job --kind scaling``). The global batch stays the same at every size (strong scaling).
"""

from __future__ import annotations

import argparse
import socket

import numpy as np

import tfdist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48, help="steps per epoch")
    parser.add_argument("--global_batch", type=int, default=64)
    flags = parser.parse_args()

    dist = tfdist.init()  # tfdist: before any TensorFlow op
    print(f"scaling_worker: rank {dist.rank} of {dist.world_size} on {socket.gethostname()}",
          flush=True)
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    examples = flags.steps * flags.global_batch
    x = rng.normal(size=(examples, 32)).astype("float32")
    y = rng.integers(0, 4, size=examples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(flags.global_batch,
                                                               drop_remainder=True)
    with dist.scope():  # tfdist: build and compile in the strategy's scope
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # tfdist: each worker trains on its share of every global batch; the callbacks time it.
    model.fit(dist.shard(dataset), epochs=flags.epochs, verbose=2, callbacks=dist.callbacks())


if __name__ == "__main__":
    main()
