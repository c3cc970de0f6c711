"""2 workers whose input is slower than their step: the advice, once, naming no rank.

    python starved_worker.py OUT torch   # a torch loop (tfdist.torch, DDP)
    python starved_worker.py OUT fit     # Keras fit (tf.data), as many workers as launched

torch: each sample takes 3 ms to load (no loader processes), a step on 8 samples about 1 ms to
train: the ranks wait for their input most of the step, equally. ``StepMeter.batches`` times
the waits. fit: each batch takes 60 ms to make (a map that cannot run in parallel), a step a
few ms; fit's steps time their own reads (tfdist.keras.input_wait). The chief writes
``OUT/throughput.jsonl``; every rank writes ``OUT/waited-RANK.json``, the input wait its fit's
steps measured (fit only).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def torch_loop(out: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    import tfdist.torch
    from tfdist.throughput import StepMeter

    class Slow(Dataset):
        def __len__(self) -> int:
            return 192

        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            time.sleep(0.003)  # a decode that is too slow for the step
            return torch.full((8,), float(index)), index % 2

    with tfdist.torch.distributed() as dist:
        torch.manual_seed(1)
        model = dist.wrap(nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = dist.loader(Slow(), batch_size=16, seed=3)
        meter = StepMeter(dist, global_batch=16, path=os.path.join(out, "throughput.jsonl"))
        for epoch in range(3):
            for inputs, labels in meter.batches(loader):
                loss = nn.functional.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                meter.step()
            meter.epoch_end(epoch)


def keras_fit(out: str) -> None:
    import tfdist

    dist = tfdist.init()
    import numpy as np
    import tensorflow as tf

    from tfdist.keras import input_wait
    from tfdist.keras.callbacks import ThroughputMeter

    keras = tf.keras
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")

    def decode(rows: np.ndarray) -> np.ndarray:
        time.sleep(0.06)  # far too slow for the step
        return rows

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).map(  # stateful: not parallel
        lambda a, b: (tf.ensure_shape(tf.numpy_function(decode, [a], tf.float32, stateful=True),
                                      [None, 8]), b))
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    meter = ThroughputMeter(dist, path=os.path.join(out, "throughput.jsonl"))
    model.fit(dist.shard(ds), epochs=3, verbose=0, callbacks=[meter])
    with open(os.path.join(out, f"waited-{dist.rank}.json"), "w") as f:
        json.dump({"waited_s": input_wait.seconds(), "steps": 3 * 8, "fed": _fed(dist)}, f)


def _fed(dist: Any) -> dict[str, float]:
    """The control: a conv net fed from a cache, whose reads take no time to speak of. Its
    input wait and its fit's seconds (after a first fit that traces)."""
    import numpy as np
    import tensorflow as tf

    from tfdist.keras import input_wait

    keras = tf.keras
    x = np.random.default_rng(0).normal(size=(64 * 16, 32, 32, 3)).astype("float32")
    y = (x[:, 0, 0, 0] > 0).astype("int64")
    ds = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(64).cache())
    with dist.scope():  # the benchmarks' 18k conv net
        model = keras.Sequential([keras.Input((32, 32, 3)),
                                  keras.layers.Conv2D(32, 3, activation="relu"),
                                  keras.layers.MaxPooling2D(),
                                  keras.layers.Conv2D(48, 3, activation="relu"),
                                  keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=1, verbose=0)  # traces
    began, waited = time.perf_counter(), input_wait.seconds() or 0.0
    model.fit(ds, epochs=3, verbose=0)
    return {"waited_s": (input_wait.seconds() or 0.0) - waited,
            "fit_s": time.perf_counter() - began}


if __name__ == "__main__":
    {"torch": torch_loop, "fit": keras_fit}[sys.argv[2]](sys.argv[1])
