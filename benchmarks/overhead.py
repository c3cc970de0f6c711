"""What does tfdist cost per training step? The example's training, with and without tfdist.

    .venv/bin/python benchmarks/overhead.py [--rounds 5] [--epochs 6]

Both variants train examples/keras_train.py's CNN on the digits data with the same seed and
global batch, as 2 workers started by `tfdist launch` (so both get the same TF_CONFIG and core
pinning):

- ``tfdist``: ``tfdist.init()``, ``dist.shard``, ``dist.callbacks()`` (no model_dir, so no I/O).
- ``plain``: hand-written tf.distribute: MultiWorkerMirroredStrategy from TF_CONFIG with ring
  collectives, thread counts set by hand to the pinned cores, DATA sharding set by hand.
  Keras 3's multi-worker ``fit`` is broken upstream (keras#20585), so the hand-written variant
  also installs tfdist.keras_compat's fix: without it there is nothing to compare against.

Runs alternate (tfdist, plain, tfdist, ...) so that machine noise hits both alike; per-step
times skip the first epoch (tracing). Prints each round, the median step-time ratio
tfdist/plain (target <= 1.02) and whether the final weights are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 64


def worker(variant: str, out_dir: str, epochs: int, data_dir: str) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import tfdist.datasets

    if variant == "tfdist":
        import tfdist

        dist = tfdist.init()
        strategy, rank = dist.strategy, dist.rank
    else:
        strategy, rank = _plain_strategy()
    import tensorflow as tf
    from keras_train import build_model

    keras = tf.keras
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(keras)
        model.compile(optimizer=keras.optimizers.Adam(1e-3 * strategy.num_replicas_in_sync),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tfdist.datasets.load("digits", "train", data_dir).map(tfdist.datasets.normalize)
    ds = ds.shuffle(2048, seed=0).batch(GLOBAL_BATCH)
    if variant == "tfdist":
        ds, callbacks = dist.shard(ds), dist.callbacks()
    else:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        ds, callbacks = ds.with_options(options), []
    stamps: list[tuple[int, float]] = []

    class StepTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.epoch = epoch
            self.last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            stamps.append((self.epoch, now - self.last))
            self.last = now

    model.fit(ds, epochs=epochs, verbose=0, callbacks=[*callbacks, StepTimer()])
    steps = [t for epoch, t in stamps if epoch > 0]
    np.savez(os.path.join(out_dir, f"weights-{rank}.npz"),
             *[v.numpy() for v in model.weights])
    with open(os.path.join(out_dir, f"steps-{rank}.json"), "w") as f:
        json.dump(steps, f)


def _plain_strategy():  # type: ignore[no-untyped-def]
    import tensorflow as tf

    threads = len(os.sched_getaffinity(0))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    from tfdist.keras import keras3

    keras3.apply()  # Keras 3 multi-worker fit does not run without it (keras#20585)
    return strategy, json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def run_once(variant: str, epochs: int, data_dir: str) -> tuple[float, list]:
    import numpy as np

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2", __file__, "--worker",
               variant, "--out", out, "--epochs", str(epochs), "--data_dir", data_dir]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{variant} run failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        steps = json.loads(Path(out, "steps-0.json").read_text())
        weights, other = (_load_weights(Path(out, f"weights-{rank}.npz")) for rank in (0, 1))
        assert all(np.array_equal(a, b) for a, b in zip(weights, other, strict=True)), (
            f"{variant}: the two workers ended with different weights")
        return statistics.median(steps), weights


def _load_weights(path: Path) -> list:
    import numpy as np

    with np.load(path) as f:  # np.savez names positional arrays arr_0, arr_1, ...
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--data_dir", default=str(ROOT / ".cache" / "tensorflow_datasets"))
    parser.add_argument("--worker", choices=["tfdist", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.epochs, args.data_dir)
    import numpy as np

    import tfdist.datasets

    tfdist.datasets.prepare("digits", args.data_dir)
    print(f"2 workers, global batch {GLOBAL_BATCH}, {args.epochs} epochs, median step time "
          "over epochs 2..N, runs alternating")
    print(f"{'round':>5} {'tfdist ms':>10} {'plain ms':>10} {'ratio':>7}")
    ratios, identical = [], True
    for round_ in range(1, args.rounds + 1):
        ours, our_weights = run_once("tfdist", args.epochs, args.data_dir)
        plain, plain_weights = run_once("plain", args.epochs, args.data_dir)
        identical &= all(np.array_equal(a, b) for a, b in zip(our_weights, plain_weights,
                                                              strict=True))
        ratios.append(ours / plain)
        print(f"{round_:>5} {ours * 1e3:>10.2f} {plain * 1e3:>10.2f} {ours / plain:>7.3f}")
    print(f"median step-time ratio tfdist/plain: {statistics.median(ratios):.3f} "
          "(target <= 1.02)")
    print(f"final weights identical (tfdist vs plain, every round): {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
