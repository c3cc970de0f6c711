"""2-worker ``fit`` whose rank 1 gets noisy neighbours from an epoch on: the chief must name it.

    python straggler_worker.py OUT BACKEND NOISY_FROM EPOCHS

From epoch ``NOISY_FROM`` (0-based) rank 1 starts busy Python processes (one, or
``STRAGGLER_NEIGHBOURS``) that inherit its cores (``tfdist launch`` pins one core to each
worker), and lowers its own threads' priority to nice 10 (or ``STRAGGLER_NICE``), as beside a
neighbour the scheduler favours: its threads then wait for a CPU, the step slows for everyone,
and the throughput meter's per-rank profile must say who and why. Without the lower priority
Linux lets a thread that wakes from a collective's wait run ahead of the busy processes: on
CI's 2 cores, with other tests' workers on both cores, rank 1 then waited too little more
than rank 0 for a finding in any of 5 noisy epochs of one run; at nice 10 beside one busy
process it waited 2 steps' time more, with the step about 3.5 times longer.
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
                count = int(os.environ.get("STRAGGLER_NEIGHBOURS", "1"))
                nice = int(os.environ.get("STRAGGLER_NICE", "10"))
                self.busy = tuple(subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                  for _ in range(count))
                for task in os.listdir("/proc/self/task") * bool(nice):  # a thread's on Linux
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(task), nice)
                    except OSError:  # a thread that ended meanwhile
                        continue

        def on_train_end(self, logs: object = None) -> None:
            for process in self.busy:
                process.kill()
                process.wait()

    return Neighbours()


if __name__ == "__main__":
    main(*sys.argv[1:])
