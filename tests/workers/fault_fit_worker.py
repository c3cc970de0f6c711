"""An MWMS fit in which one rank fails on purpose (tests/test_slurm_failures.py).

``fault_fit_worker.py KIND RANK [MODEL_DIR]``: at step 20 of the first epoch, rank RANK prints
``fault-fit: rank R KIND at T`` (T: the wall clock, seconds since the epoch) and then sends
itself SIGKILL (``kill``: a crash, an out-of-memory kill) or SIGSTOP (``stop``: a hang: the
process lives, holds its sockets and answers nothing). The other ranks train on until
TensorFlow's heartbeats, and tfdist's line, tell them. With MODEL_DIR the fit also has
tfdist's preemption callbacks, which must not mistake the fault for a preemption.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import tfdist

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def main() -> None:
    kind, faulty = sys.argv[1], int(sys.argv[2])
    model_dir = sys.argv[3] if len(sys.argv) > 3 else None
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

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            time.sleep(0.01)
            if batch == 20 and dist.rank == faulty and self.params is not None:
                print(f"fault-fit: rank {dist.rank} {kind} at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), SIGNALS[kind])

    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=200, verbose=0,
              callbacks=dist.callbacks(Fault(), tensorboard=False, sync_check=False,
                                       model_dir=model_dir))


if __name__ == "__main__":
    main()
