"""2-worker ``fit`` whose rank 1 gets noisy neighbours from an epoch on: the chief must name it.

    python straggler_worker.py OUT BACKEND NOISY_FROM EPOCHS

From epoch ``NOISY_FROM`` (0-based) rank 1 starts busy Python processes (two, or
``STRAGGLER_NEIGHBOURS``) that inherit its cores (``tfdist launch`` pins one core to each
worker): its threads then wait for a CPU, the step slows for everyone, and the throughput
meter's per-rank profile must say who and why.
``NOISY_FROM`` equal to ``EPOCHS``: a balanced run. Each rank writes ``cores-RANK.json`` (the
cores it runs on); the chief's records are in ``OUT/model/throughput.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

import tfdist


def main(out: str, backend: str, noisy_from: str, epochs: str) -> None:
    dist = tfdist.init(backend=backend)
    import tensorflow as tf

    keras = tf.keras
    with open(os.path.join(out, f"cores-{dist.rank}.json"), "w") as f:
        json.dump(sorted(os.sched_getaffinity(0)), f)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 64)).astype("float32")
    y = rng.integers(0, 10, size=2048)
    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(64))
    keras.utils.set_random_seed(1)
    with dist.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    noise = _neighbours(keras, int(noisy_from) if dist.rank == 1 else -1)
    model.fit(dataset, epochs=int(epochs), verbose=0,
              callbacks=[*dist.callbacks(model_dir=os.path.join(out, "model")), noise])


def _neighbours(keras: Any, first: int) -> Any:
    """A callback that starts busy processes on this rank's cores from epoch ``first`` to the
    end of fit."""

    class Neighbours(keras.callbacks.Callback):
        busy: tuple[subprocess.Popen[bytes], ...] = ()

        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            if epoch == first:
                count = int(os.environ.get("STRAGGLER_NEIGHBOURS", "2"))
                self.busy = tuple(subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                  for _ in range(count))

        def on_train_end(self, logs: object = None) -> None:
            for process in self.busy:
                process.kill()
                process.wait()

    return Neighbours()


if __name__ == "__main__":
    main(*sys.argv[1:])
