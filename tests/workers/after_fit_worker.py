"""A short MWMS fit with tfdist's callbacks, then the script's last work, which waits for the
test (tests/test_slurm_jobs.py): a preemption signal sent then must not end the script.

``after_fit_worker.py GO MODEL_DIR``: after ``fit`` returns every rank prints ``after-fit: fit
returned``, waits until the file GO exists (at most 120 s), evaluates the model (a collective,
as a script's last work often is) and prints ``after-fit: done LOSS``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import tfdist


def main(go: str, model_dir: str) -> None:
    dist = tfdist.init()
    import tensorflow as tf

    keras = tf.keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=1, verbose=0,
              callbacks=dist.callbacks(model_dir=model_dir, tensorboard=False))
    print("after-fit: fit returned", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.1)
    loss = float(model.evaluate(dataset, verbose=0))
    print(f"after-fit: done {loss:.6f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
