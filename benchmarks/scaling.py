"""2-worker scaling efficiency: tfdist's defaults against hand-written MWMS, and Horovod.

    .venv/bin/python benchmarks/scaling.py [--rounds 3] [--models small,large]

The issue's setting: a conv net on random 32x32x3 images, 32 images per replica, one worker
per core (``tfdist launch``), ``fit`` with SGD. Two nets: ``small`` (about 18k parameters,
short steps) and ``large`` (about 290k parameters, longer steps). Per model and round, in turn:

- ``1 process``: the same script as one plain process on one core: the baseline throughput;
- ``tfdist``: 2 workers, ``tfdist.init()``, ``dist.shard``, ``dist.callbacks()``: the defaults;
- ``hand-written``: 2 workers, MultiWorkerMirroredStrategy from TF_CONFIG with TensorFlow's
  default collective options, the same threads per core, DATA sharding, Keras's own per-step
  log averaging (Keras 3's multi-worker ``fit`` does not run without tfdist's fix, so that fix
  is installed; nothing else of tfdist);
- ``2 apart``: the 1-process run twice at once, one per core, not talking to each other: what
  this machine gives two workers before any communication (memory and cache are shared), the
  ceiling of any 2-worker efficiency here;
- with ``.venv-horovod`` present (its TensorFlow is 2.18), under tf_keras, which Horovod's
  own Keras layer needs: ``horovod``, tfdist's defaults on 2 workers under ``tfdist launch
  --backend horovod``, and ``horovod-plain``, Horovod as its Keras examples use it
  (``hvd.DistributedOptimizer``, ``BroadcastGlobalVariablesCallback``, ``dataset.shard``), both
  against a 1-process run in that environment.

Step time is the median time of one training step over epochs 2..N (from one step's end to the
next, as tfdist's throughput meter measures it), so the first epoch's tracing and each
epoch's start are left out. Efficiency = 2-worker images/s / (2 x 1-process images/s).
Prints every run, then per model the median efficiency of each variant with its spread over
rounds, and the ratio of tfdist's step time to the hand-written one, with MWMS and with Horovod
(< 1: tfdist is faster).
Both workers must end with identical weights in every 2-worker run.
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

from _common import ROOT, conv_net, random_images, run_workers

HVD_PYTHON = ROOT / ".venv-horovod" / "bin" / "python"
PER_REPLICA = 32
STEPS = 48  # per epoch


def worker(variant: str, model_name: str, epochs: int, out: str) -> None:
    hvd = None
    if variant == "plain":
        strategy, rank, workers = _hand_written()
        import tensorflow as tf

        shard = _data_sharding
        callbacks: list = []
    elif variant == "horovod-plain":
        hvd, rank, workers = _hand_written_horovod()
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()

        def shard(dataset):  # type: ignore[no-untyped-def]  # Horovod's examples' way
            return dataset.unbatch().shard(workers, rank).batch(PER_REPLICA)

        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    else:
        import tfdist

        dist = tfdist.init()
        import tensorflow as tf

        strategy, rank, workers = dist.strategy, dist.rank, dist.world_size
        shard, callbacks = dist.shard, dist.callbacks()
    keras = tf.keras
    x, y = random_images(STEPS * PER_REPLICA * workers)
    dataset = shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(PER_REPLICA * workers)
                    .cache())
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = conv_net(keras, model_name)
        optimizer = keras.optimizers.SGD(0.01)
        if hvd is not None:
            optimizer = hvd.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stamps: list[tuple[int, int, float]] = []

    class Stamps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            stamps.append((self.epoch, batch, time.perf_counter()))

    if variant in ("plain", "horovod-plain"):
        callbacks.append(Stamps())
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=callbacks)
    from tfdist.sync import digest, model_variables
    from tfdist.throughput import summarise

    if stamps:
        summaries = [summarise([(b, t) for e, b, t in stamps if e == epoch],
                               global_batch=None, workers=1) for epoch in range(1, epochs)]
        step = statistics.median(s["step_time_s"]["median"] for s in summaries if s)
    else:  # tfdist's meter wrote them
        lines = Path(os.environ["TFDIST_THROUGHPUT_FILE"]).read_text().splitlines()
        step = statistics.median(json.loads(line)["step_time_s"]["median"]
                                 for line in lines[1:])
    result = {"step": step, "digest": digest(model_variables(model)),
              "params": model.count_params(), "batch": PER_REPLICA * workers}
    Path(out, f"result-{rank}.json").write_text(json.dumps(result))


def _hand_written():  # type: ignore[no-untyped-def]
    import tensorflow as tf

    threads = len(os.sched_getaffinity(0))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    from tfdist.keras import keras3

    keras3.apply()  # Keras 3 multi-worker fit does not run without it (keras#20585)
    config = json.loads(os.environ["TF_CONFIG"])
    return strategy, config["task"]["index"], len(config["cluster"]["worker"])


def _hand_written_horovod():  # type: ignore[no-untyped-def]
    """Horovod as its Keras examples use it (tf_keras: Horovod's Keras layer predates Keras
    3), with the same threads per core as the other variants."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    hvd.init()
    threads = len(os.sched_getaffinity(0))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return hvd, hvd.rank(), hvd.size()


def _data_sharding(dataset):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def run(variant: str, model: str, epochs: int) -> dict:
    """One run; returns rank 0's result (images/s added), after checking the ranks agree."""
    python = str(HVD_PYTHON) if variant.startswith("horovod") else sys.executable
    with tempfile.TemporaryDirectory() as out:
        own = [__file__, "--worker", variant, "--model", model, "--epochs", str(epochs),
               "--out", out]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
               "TFDIST_THROUGHPUT_FILE": os.path.join(out, "throughput.jsonl")}
        if variant == "plain":
            env["TFDIST_STEP_LOGS"] = "global"  # Keras's own behaviour, for the baseline
        if variant.startswith("horovod"):  # Horovod's own Keras layer needs tf_keras
            env["TF_USE_LEGACY_KERAS"] = "1"
        if variant == "apart":  # two 1-process runs at once, one per core
            own[2] = "single"
            cores = sorted(os.sched_getaffinity(0))[:2]
            procs = []
            for core in cores:
                folder = os.path.join(out, str(core))
                os.makedirs(folder)
                procs.append(subprocess.Popen(
                    ["taskset", "-c", str(core), python, *own[:-1], folder], cwd=ROOT,
                    env={**env, "TFDIST_THROUGHPUT_FILE": os.path.join(folder, "t.jsonl")},
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            if any(proc.wait() for proc in procs):
                raise SystemExit(f"apart ({model}) failed:\n"
                                 f"{procs[0].stdout.read().decode()[-3000:]}")  # type: ignore[union-attr]
            parts = [json.loads(Path(out, str(core), "result-0.json").read_text())
                     for core in cores]
            return {**parts[0], "step": statistics.mean(p["step"] for p in parts),
                    "batch": sum(p["batch"] for p in parts),
                    "images_per_s": sum(p["batch"] / p["step"] for p in parts)}
        if variant in ("single", "horovod-single"):
            own[2] = "single"
            cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0))), python, *own]
            workers = 1
        else:
            launch = ["--backend", "horovod"] if variant.startswith("horovod") else []
            cmd = [python, "-m", "tfdist", "launch", *launch, "-n", "2", *own]
            workers = 2
        results = run_workers(cmd, env, out, workers, f"{variant} ({model})")
    if len({r["digest"] for r in results}) != 1:
        raise SystemExit(f"{variant} ({model}): the workers ended with different weights")
    result = results[0]
    result["images_per_s"] = result["batch"] / result["step"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.epochs, args.out)
    variants = ["single", "apart", "tfdist", "plain"]
    if HVD_PYTHON.exists():
        variants += ["horovod-single", "horovod", "horovod-plain"]
    print(f"{PER_REPLICA} images per replica, {STEPS} steps an epoch, {args.epochs} epochs, "
          "median step over epochs 2..N; variants in turn every round")
    for model in args.models.split(","):
        efficiency: dict[str, list[float]] = {"apart": [], "tfdist": [], "plain": [],
                                              "horovod": [], "horovod-plain": []}
        ratios, horovod_ratios = [], []
        for round_ in range(1, args.rounds + 1):
            found = {variant: run(variant, model, args.epochs) for variant in variants}
            line = [f"{model} round {round_} ({found['single']['params']} parameters):"]
            for variant, result in found.items():
                line.append(f"{variant} {result['step'] * 1e3:.2f} ms "
                            f"{result['images_per_s']:.0f} img/s")
            print(line[0] + "\n  " + "; ".join(line[1:]), flush=True)
            for variant, base in (("apart", "single"), ("tfdist", "single"), ("plain", "single"),
                                  ("horovod", "horovod-single"),
                                  ("horovod-plain", "horovod-single")):
                if variant in found:
                    efficiency[variant].append(found[variant]["images_per_s"]
                                               / (2 * found[base]["images_per_s"]))
            ratios.append(found["tfdist"]["step"] / found["plain"]["step"])
            if "horovod" in found:
                horovod_ratios.append(found["horovod"]["step"] / found["horovod-plain"]["step"])
        print(f"{model}: 2-worker efficiency, median (min..max over {args.rounds} rounds)")
        for variant, values in efficiency.items():
            if values:
                print(f"  {variant:>8}: {statistics.median(values):.0%} "
                      f"({min(values):.0%}..{max(values):.0%})")
        print(f"  step time tfdist / hand-written: {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}..{max(ratios):.3f})")
        if horovod_ratios:
            print(f"  step time tfdist / hand-written under Horovod: "
                  f"{statistics.median(horovod_ratios):.3f} "
                  f"({min(horovod_ratios):.3f}..{max(horovod_ratios):.3f})")
    print("both workers ended with identical weights in every 2-worker run: yes")


if __name__ == "__main__":
    main()
