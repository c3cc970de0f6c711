"""What does each epoch cost beyond its steps, on 2 MWMS workers against one process?

    .venv/bin/python benchmarks/epoch_start.py [--rounds 3] [--epochs 6]

One small net (an MLP on 32 features, as a short-step job has them) trained with Keras 3 ``fit``
on an in-memory dataset shuffled every epoch, ``--steps`` batches of the global batch an epoch,
the same seed and global batch in every variant:

- ``one``: one plain process (tfdist's one-process handle), the baseline;
- ``mwms``: 2 workers under ``tfdist launch -n 2`` (MultiWorkerMirroredStrategy), the dataset
  through ``dist.shard``: a new distributed iterator every epoch, as Keras makes it, each
  worker reading a plain tf.data iterator (tfdist's ``host-input-iterator``);
- ``mwms-free-tensorflow``: the same with each dropped iterator freed where TensorFlow frees
  it, on the training thread (``TFDIST_SKIP_PATCHES=iterator-free-thread``): there the free can
  wait for tf.data's autotuning to wake (a race in TensorFlow, up to as long as the epoch;
  tfdist frees it on a thread of its own, ``tfdist.keras.iterators``);
- ``mwms-tf-iterator``: ``mwms`` with TensorFlow's multi-device iterator on each worker
  (``TFDIST_SKIP_PATCHES=host-input-iterator``), the control;
- ``mwms-tf-no-autotune``: the control with tf.data's autotuning off
  (``options.autotune.enabled = False``): freeing a multi-device iterator then waits less
  (part of its cost, measured; not a recommendation: autotuning sizes parallel maps and
  prefetches);
- ``mwms-keras``: ``mwms`` with every iterator Keras 3 asks for made (tfdist's stand-in for
  the one Keras makes at an epoch's end and drops unread taken out: ``input_position.seeds_only``);
- ``mwms-repeat``: the same as ``mwms``, the dataset repeated with ``steps_per_epoch``: one
  iterator for every epoch.

Per epoch (the first, which traces, left out): ``start``, from ``on_epoch_begin`` to the first
step's ``on_train_batch_begin`` (Keras makes the epoch's iterator there); ``first``, the first
step (its batch is read then: the shuffle buffer fills); ``step``, the median of the other steps;
``end``, from the last step's ``on_train_batch_end`` to ``on_epoch_end``;
``overhead``, the epoch's time from ``on_epoch_begin`` to ``on_epoch_end`` less ``--steps``
median steps: what the epoch costs beyond its steps, wherever the work moved. The variants take
turns, in a rotated order each round (``--variants`` picks some, ``one`` always among them).
The race's cost grows with the epoch: ``--steps 520`` makes epochs of about 3 s on 2 workers.
Prints each round, then per variant the median over the rounds (min..max) and the MWMS
variants' overhead less one process's. The issue's target: within 0.1 s of one process's.
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
from typing import Any

from _common import run_workers, spread

VARIANTS = ("one", "mwms", "mwms-free-tensorflow", "mwms-tf-iterator", "mwms-tf-no-autotune",
            "mwms-keras", "mwms-repeat")
FEATURES = 32


def worker(variant: str, args: argparse.Namespace) -> None:
    """One process of ``variant``: trains and writes its epochs' figures."""
    import tfdist
    from tfdist.sync import digest, model_variables

    dist = tfdist.init()
    if variant == "mwms-keras":
        from tfdist.keras import input_position

        input_position.seeds_only = lambda data: None  # Keras's own two iterators an epoch
    import numpy as np
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(0)
    rows = args.steps * args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, "relu"),
                                  keras.layers.Dense(64, "relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(rows, seed=0).batch(args.batch)
    fit_args: dict[str, Any] = {}
    if variant == "mwms-repeat":
        ds, fit_args = ds.repeat(), {"steps_per_epoch": args.steps}
    if variant == "mwms-tf-no-autotune":
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    epochs: list[dict[str, Any]] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.began, self.ends, self.first_begin = time.perf_counter(), [], None

        def on_train_batch_begin(self, batch, logs=None):  # type: ignore[no-untyped-def]
            if self.first_begin is None:
                self.first_begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.ends.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            ended = time.perf_counter()
            steps = [b - a for a, b in itertools.pairwise(self.ends)]
            step = statistics.median(steps)
            epochs.append({"start": self.first_begin - self.began,
                           "first": self.ends[0] - self.first_begin, "step": step,
                           "end": ended - self.ends[-1],
                           "overhead": ended - self.began - len(self.ends) * step,
                           "steps": len(self.ends)})

    model.fit(dist.shard(ds), epochs=args.epochs, verbose=0,
              callbacks=[*dist.callbacks(), Clock()], **fit_args)
    with open(os.path.join(args.out, f"result-{dist.rank}.json"), "w") as f:
        json.dump({"epochs": epochs[1:], "workers": dist.world_size,
                   "weights": digest(model_variables(model))}, f)


def run(variant: str, args: argparse.Namespace) -> dict[str, float]:
    """One run of ``variant``: rank 0's medians over the steady epochs."""
    with tempfile.TemporaryDirectory() as out:
        me = [__file__, "--worker", variant, "--out", out, "--steps", str(args.steps),
              "--batch", str(args.batch), "--epochs", str(args.epochs)]
        workers = 1 if variant == "one" else 2
        launch = ["-m", "tfdist", "launch", "-n", "2"] if workers == 2 else []
        skipped = [key for key, skip in (("host-input-iterator", "-tf-" in variant),
                                         ("iterator-free-thread", "free-tensorflow" in variant))
                   if skip]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "0",
               "TFDIST_SKIP_PATCHES": ",".join(skipped)}
        results = run_workers([sys.executable, *launch, *me], env, out, workers, variant)
    if workers == 2 and results[0]["weights"] != results[1]["weights"]:
        raise SystemExit(f"{variant}: the two workers ended with different weights")
    epochs = results[0]["epochs"]
    return {key: statistics.median(e[key] for e in epochs)
            for key in ("start", "first", "step", "end", "overhead")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=32, help="batches an epoch")
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args)
    variants = ("one", *(v for v in VARIANTS[1:] if v in args.variants))
    found: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            found[variant].append(run(variant, args))
            f = found[variant][-1]
            print(f"round {r + 1} {variant:16s} start {f['start'] * 1e3:6.1f} ms  first "
                  f"{f['first'] * 1e3:6.1f} ms  step {f['step'] * 1e3:5.2f} ms  end "
                  f"{f['end'] * 1e3:6.1f} ms  overhead "
                  f"{f['overhead'] * 1e3:6.1f} ms", flush=True)
    print(f"\nmedians over {args.rounds} round(s) of the steady epochs' medians, ms "
          f"({args.steps} steps of {args.batch} an epoch):")
    for variant in variants:
        rows = found[variant]
        cells = "  ".join(f"{key} {spread([f[key] * 1e3 for f in rows], '.1f')}"
                          for key in ("start", "first", "step", "end", "overhead"))
        print(f"  {variant:16s} {cells}")
    for variant in variants[1:]:
        extra = [f["overhead"] - o["overhead"] for f, o in zip(found[variant], found["one"],
                                                                  strict=True)]
        print(f"  {variant} overhead less one process's, same round: "
              f"{spread([e * 1e3 for e in extra], '.1f')} ms (target: at most 100 ms)")


if __name__ == "__main__":
    main()
