"""A fit whose ``model_dir`` is node-local scratch: each rank mounts a tmpfs at the same path in
a mount namespace of its own, so the path is the same on every rank and the folder is not (as
``$TMPDIR`` on most clusters, one per node). Needs root and mounts.

    python scratch_dir_worker.py MODEL_DIR
    python scratch_dir_worker.py --doctor MODEL_DIR     (tfdist doctor --model-dir instead)

Prints ``tfdist-test: rank R step S`` after each training step; exits 3 where this machine
cannot give a rank its own mount.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

CLONE_NEWNS = 0x00020000


def own_scratch(path: str) -> bool:
    """Mounts a tmpfs of this process's own at ``path``; whether it could."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    private = subprocess.run(["mount", "--make-rprivate", "/"], capture_output=True, check=False)
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path],
                             capture_output=True, check=False)
    return private.returncode == 0 and mounted.returncode == 0


def main(*args: str) -> None:
    model_dir = args[-1]
    if not own_scratch(model_dir):  # before TensorFlow starts its threads
        print("tfdist-test: cannot mount a scratch folder of this rank's own", flush=True)
        sys.exit(3)
    if args[0] == "--doctor":
        from tfdist.cli import main as tfdist

        sys.exit(tfdist(["doctor", "--model-dir", model_dir]))
    import numpy as np

    import tfdist

    dist = tfdist.init()
    import tensorflow as tf

    keras = tf.keras

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            print(f"tfdist-test: rank {dist.rank} step {batch + 1}", flush=True)

    callbacks = dist.callbacks(Announce(), model_dir=model_dir, tensorboard=False)
    with dist.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((64, 4), "float32")
    model.fit(dist.shard(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)),
              epochs=1, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main(*sys.argv[1:])
