"""MultiWorkerMirroredStrategy or Horovod (Gloo)? The same 2-worker job on both, side by side.

    .venv-horovod/bin/python benchmarks/horovod_vs_mwms.py [--rounds 5] [--epochs 6]

Runs in .venv-horovod (TensorFlow 2.18.1), so both backends use the same TensorFlow. Both sides
train examples/keras_train.py's CNN on the digits data with the same seed, global batch and
steps, as 2 workers started by `tfdist launch` (one core each): ``mwms`` with a TF_CONFIG per
worker and ring collectives, ``horovod`` with `--backend horovod` (Gloo). Rounds alternate
(mwms, horovod, mwms, ...) so that machine noise hits both alike.

Reported per side (medians; rank 0's timings):

- step time: median time of one training step over epochs 2..N (the first epoch traces), and
  images/s = global batch / step time;
- sync time: the synchronisation alone: one all-reduce of tensors shaped like the model's
  gradients (the backend's own call: the replica context's ``all_reduce`` inside
  ``strategy.run`` for MWMS, ``hvd.grouped_allreduce`` for Horovod), in a ``tf.function``,
  timed over 50 calls after 5 warm-up calls, both workers calling in lockstep;
- whether the two workers ended bit-identical (they must, on both sides).
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
SYNC_CALLS, SYNC_WARMUP = 50, 5


def worker(backend: str, out_dir: str, epochs: int, data_dir: str) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import tfdist
    import tfdist.datasets

    dist = tfdist.init(backend=backend, collective="ring" if backend == "mwms" else None)
    import tensorflow as tf
    from keras_train import build_model

    keras = tf.keras
    keras.utils.set_random_seed(0)
    with dist.scope():
        model = build_model(keras)
        model.compile(optimizer=keras.optimizers.Adam(dist.scale_lr(1e-3)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tfdist.datasets.load("digits", "train", data_dir).map(tfdist.datasets.normalize)
    ds = dist.shard(ds.shuffle(2048, seed=0).batch(GLOBAL_BATCH))
    stamps: list[tuple[int, float]] = []

    class StepTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.epoch, self.last = epoch, time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            stamps.append((self.epoch, now - self.last))
            self.last = now

    model.fit(ds, epochs=epochs, verbose=0,
              callbacks=[*dist.callbacks(sync_check=False), StepTimer()])
    sync = _sync_times(dist, [v.shape for v in model.trainable_variables])
    np.savez(os.path.join(out_dir, f"weights-{dist.rank}.npz"),
             *[v.numpy() for v in model.trainable_variables])
    with open(os.path.join(out_dir, f"times-{dist.rank}.json"), "w") as f:
        json.dump({"steps": [t for epoch, t in stamps if epoch > 0], "sync": sync}, f)


def _sync_times(dist, shapes) -> list[float]:  # type: ignore[no-untyped-def]
    import tensorflow as tf

    def gradients():  # type: ignore[no-untyped-def]  # made on the replica's own device
        return [tf.ones(shape) for shape in shapes]

    if dist.backend == "horovod":
        import horovod.tensorflow as hvd

        @tf.function
        def sync():  # type: ignore[no-untyped-def]
            return hvd.grouped_allreduce(gradients(), op=hvd.Average)
    else:
        strategy = dist.strategy

        @tf.function
        def sync():  # type: ignore[no-untyped-def]
            return strategy.run(
                lambda: tf.distribute.get_replica_context().all_reduce("MEAN", gradients()))

    times = []
    for call in range(SYNC_WARMUP + SYNC_CALLS):
        start = time.perf_counter()
        result = sync()
        tf.nest.flatten(result)[0].numpy()
        if call >= SYNC_WARMUP:
            times.append(time.perf_counter() - start)
    return times


def run_once(backend: str, epochs: int, data_dir: str) -> dict:
    import numpy as np

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "tfdist", "launch", "--backend", backend, "-n", "2",
               __file__, "--worker", backend, "--out", out, "--epochs", str(epochs),
               "--data_dir", data_dir]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TFDIST_", "HOROVOD_"))}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        if done.returncode:
            raise SystemExit(f"{backend} run failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        times = json.loads(Path(out, "times-0.json").read_text())
        weights = [_load(Path(out, f"weights-{rank}.npz")) for rank in (0, 1)]
        identical = all(np.array_equal(a, b) for a, b in zip(*weights, strict=True))
        return {"step": statistics.median(times["steps"]), "sync": statistics.median(
            times["sync"]), "identical": identical}


def _load(path: Path) -> list:
    import numpy as np

    with np.load(path) as f:  # np.savez names positional arrays arr_0, arr_1, ...
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _row(label: str, mwms: dict, hvd: dict) -> str:
    def side(r: dict) -> str:
        return f"{r['step'] * 1e3:>8.2f} {GLOBAL_BATCH / r['step']:>7.0f} {r['sync'] * 1e3:>7.2f}"

    return (f"{label:>6} | {side(mwms)} | {side(hvd)} | {hvd['step'] / mwms['step']:>6.3f} "
            f"{hvd['sync'] / mwms['sync']:>6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--data_dir", default=str(ROOT / ".cache" / "tensorflow_datasets"))
    parser.add_argument("--worker", choices=["mwms", "horovod"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.out, args.epochs, args.data_dir)
    import tfdist.datasets
    from tfdist.horovod.install import import_horovod

    import_horovod()  # a clear error now rather than in the workers
    tfdist.datasets.prepare("digits", args.data_dir)
    print(f"2 workers x 1 core, global batch {GLOBAL_BATCH}, {args.epochs} epochs; step: median "
          f"over epochs 2..N; sync: median of {SYNC_CALLS} gradient-sized all-reduces")
    print(f"{'':>6} | {'MWMS (ring)':^24} | {'Horovod (Gloo)':^24} | {'Horovod/MWMS':^13}")
    print(f"{'round':>6} | {'ms/step':>8} {'img/s':>7} {'sync ms':>7} | {'ms/step':>8} "
          f"{'img/s':>7} {'sync ms':>7} | {'step':>6} {'sync':>6}")
    results: dict[str, list[dict]] = {"mwms": [], "horovod": []}
    for round_ in range(1, args.rounds + 1):
        for backend in ("mwms", "horovod"):
            results[backend].append(run_once(backend, args.epochs, args.data_dir))
        print(_row(str(round_), results["mwms"][-1], results["horovod"][-1]), flush=True)
    medians = {b: {k: statistics.median(r[k] for r in rs) for k in ("step", "sync")}
               for b, rs in results.items()}
    print(_row("median", medians["mwms"], medians["horovod"]))
    for backend, runs in results.items():
        same = all(r["identical"] for r in runs)
        print(f"{backend}: both workers bit-identical in every round: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
