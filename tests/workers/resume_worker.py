"""2-worker fit with tfdist's callbacks; optionally crashed after an epoch, then resumed.

    python resume_worker.py OUT_DIR MODEL_DIR EPOCHS CRASH_AFTER_EPOCH(-1: never)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import tfdist


def main(out_dir: str, model_dir: str, epochs: int, crash_after: int) -> None:
    dist = tfdist.init()
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    epochs_seen: list[int] = []

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            if crash_after >= 0 and epoch == crash_after + 1:
                raise SystemExit(17)  # a crash once every callback has ended that epoch
            epochs_seen.append(epoch)

    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=epochs, verbose=0,
              callbacks=dist.callbacks(Record(), model_dir=model_dir, tensorboard=True))
    np.savez(os.path.join(out_dir, f"weights-{dist.rank}.npz"),
             **{f"w{i}": v.numpy() for i, v in enumerate(model.weights)})
    with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
        json.dump({"epochs_seen": epochs_seen}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
