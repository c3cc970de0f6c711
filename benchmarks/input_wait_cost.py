"""What does timing fit's input reads cost a step? The same fit with and without it.

    .venv/bin/python benchmarks/input_wait_cost.py [--rounds 5]

One process (the clock's ops are the same on every backend; one process has the shortest steps
and so shows the cost most): an MLP on in-memory rows, ``--steps`` steps of ``--batch`` an
epoch, ``--epochs`` epochs, Keras 3 ``fit`` through ``tfdist.init()``:

- ``timed``: as tfdist runs it (patch ``fit-input-wait``: two clock reads and one add a step);
- ``untimed``: the same with that patch left out (``TFDIST_SKIP_PATCHES=fit-input-wait``).

The median step time of the epochs after the first (which traces) is each run's figure; the
variants alternate, in a rotated order each round. Prints each round, then the median ratio
timed/untimed with min..max. Target: at most 1.01.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

from _common import run_workers, spread

VARIANTS = ("timed", "untimed")


def worker(variant: str, args: argparse.Namespace) -> None:
    from tfdist.keras import input_wait

    if variant == "untimed":
        os.environ["TFDIST_SKIP_PATCHES"] = "fit-input-wait"
    import tfdist

    dist = tfdist.init()
    import numpy as np
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(0)
    rows = args.steps * args.batch
    x = np.random.default_rng(0).normal(size=(rows, 32)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).prefetch(2)
    ends: list[tuple[int, float]] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            ends.append((self.epoch, time.perf_counter()))

    model.fit(ds, epochs=args.epochs, verbose=0, callbacks=[Clock()])
    steps = [b - a for (e, a), (f, b) in itertools.pairwise(ends) if e == f and e > 0]
    with open(os.path.join(args.out, "result-0.json"), "w") as f:
        json.dump({"step": statistics.median(steps), "waited": input_wait.seconds()}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="batches an epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)
    found: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios = []
    for r in range(args.rounds):
        for variant in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
            with tempfile.TemporaryDirectory() as out:
                me = [sys.executable, __file__, "--worker", variant, "--out", out, "--epochs",
                      str(args.epochs), "--steps", str(args.steps), "--batch", str(args.batch)]
                env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "0"}
                result = run_workers(me, env, out, 1, variant)[0]
            if (result["waited"] is None) != (variant == "untimed"):
                raise SystemExit(f"{variant}: the clock was {result['waited']}")
            found[variant].append(result["step"])
        ratios.append(found["timed"][-1] / found["untimed"][-1])
        print(f"round {r + 1}: timed {found['timed'][-1] * 1e3:.3f} ms, untimed "
              f"{found['untimed'][-1] * 1e3:.3f} ms a step, ratio {ratios[-1]:.3f}", flush=True)
    print(f"\nstep time: timed {spread([s * 1e3 for s in found['timed']], '.3f')} ms, untimed "
          f"{spread([s * 1e3 for s in found['untimed']], '.3f')} ms; ratio timed/untimed "
          f"{spread(ratios, '.3f')} (target: at most 1.01)")


if __name__ == "__main__":
    main()
