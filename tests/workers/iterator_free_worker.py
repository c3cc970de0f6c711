"""One process, tfdist's one-process backend: which tf.data iterators are freed on tfdist's
thread (tfdist.keras.iterators). Prints one JSON line: the count of iterators freed there after each
case, then, from an exit handler that runs after tfdist's, how many were still pending.

    python iterator_free_worker.py
"""

from __future__ import annotations

import atexit
import json
import sys
import time

import tfdist
from tfdist.keras import iterators

# Registered before tfdist's own exit handler, so it runs after it: what was left to free.
atexit.register(lambda: print(json.dumps({"pending_at_exit": iterators.pending()}), flush=True))


def settled() -> int:
    """Iterators freed on tfdist's thread once nothing handed over is pending (10 s at most)."""
    return iterators.freed(wait_s=10)


def main() -> None:
    dist = tfdist.init()
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops

    autotuned = tf.data.Dataset.range(10**9).map(lambda x: x * 2,
                                                num_parallel_calls=tf.data.AUTOTUNE)
    autotuned = autotuned.batch(8).prefetch(tf.data.AUTOTUNE)
    found: dict = {"backend": dist.backend, "start": settled()}

    iterator = iter(autotuned)  # an epoch's iterator, read a while, then dropped here
    started = time.monotonic()
    while time.monotonic() - started < 0.3:
        next(iterator)
    del iterator
    found["dropped"] = settled()

    for _ in autotuned.take(3):  # a custom loop's iterator
        pass
    found["loop"] = settled()

    @tf.function
    def first() -> tf.Tensor:  # an iterator made while tracing: TensorFlow's to free
        return next(iter(autotuned))

    first()
    found["traced"] = settled()

    devices = multi_device_iterator_ops.OwnedMultiDeviceIterator(autotuned, ["/cpu:0"])
    next(devices)
    del devices  # its per-device iterators: TensorFlow's to free
    found["multi_device"] = settled()

    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(optimizer="sgd",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=0).batch(32)
    model.fit(data, epochs=3, verbose=0)
    found["fit"] = settled()

    last = iter(autotuned)  # handed over just before exit: waited for at exit
    next(last)
    del last
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    sys.exit(main())
