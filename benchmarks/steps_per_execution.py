"""Does ``compile(steps_per_execution=N)`` speed up short steps on 2 workers as on one process?

    .venv/bin/python benchmarks/steps_per_execution.py [--spe 8] [--rounds 7] [--backend mwms]
    .venv-horovod/bin/python benchmarks/steps_per_execution.py --backend horovod

A small conv net (about 18k parameters, a few milliseconds a step on a CPU core) on random
32x32x3 images, 32 images per replica, is trained twice in the same processes: once compiled
with ``steps_per_execution=1`` and once with ``--spe``. Each round times one epoch of each,
alternating (1, N, 1, N, ...) so that machine noise hits both alike; the first epoch of each
(tracing) is not counted, nor ``fit``'s own start and end: a step's time is measured from the
end of step N to the end of the epoch's last step. This runs twice:

- ``1 process``: a plain ``python`` process (tfdist's single backend): Keras's own speed-up;
- ``2 workers``: ``tfdist launch -n 2`` (one core each) with ``--backend``: on Keras 3 the
  multi-worker ``steps_per_execution`` path is tfdist's (keras_compat), on tf_keras Keras's.

Prints, for each, the step time of both settings per round, the median speed-up (time at 1 /
time at N) and its spread (min..max over rounds), and checks that both workers ended with
bit-identical weights. ``TF_USE_LEGACY_KERAS=1`` measures tf_keras instead of Keras 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from _common import conv_net, random_images, run_workers

PER_REPLICA_BATCH = 32
STEPS = 64  # per epoch


def worker(out_dir: str, spe: int, rounds: int, backend: str) -> None:
    import tfdist

    dist = tfdist.init(backend=backend)
    import tensorflow as tf

    from tfdist.sync import digest, model_variables

    keras = tf.keras
    global_batch = PER_REPLICA_BATCH * dist.num_replicas
    x, y = random_images(STEPS * global_batch)
    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
                         .cache())
    models = {}
    for setting in (1, spe):
        keras.utils.set_random_seed(0)
        with dist.scope():
            model = conv_net(keras, "small")
            model.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          steps_per_execution=setting)
        models[setting] = model
    stamps: list[tuple[int, float]] = []

    class Stamps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            stamps.append((batch, time.perf_counter()))  # once per execution: batch is its last

    times: dict[int, list[float]] = {1: [], spe: []}
    for round_ in range(rounds + 1):  # round 0 traces
        for setting, model in models.items():
            stamps.clear()
            model.fit(dataset, epochs=1, verbose=0, callbacks=[*dist.callbacks(), Stamps()])
            # From the end of the first execution of N steps to the epoch's last step: the
            # same steps for both settings, without fit's own start and end.
            (first, start), (last, end) = next(s for s in stamps if s[0] >= spe - 1), stamps[-1]
            if round_:
                times[setting].append((end - start) / (last - first))
    result = {"times": {str(k): v for k, v in times.items()},
              "digests": {str(k): digest(model_variables(m)) for k, m in models.items()},
              "params": models[1].count_params()}
    with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
        json.dump(result, f)


def run(workers: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        own = [__file__, "--worker", "--out", out, "--spe", str(args.spe), "--rounds",
               str(args.rounds), "--backend", args.backend if workers > 1 else "single"]
        if workers > 1:
            launch = ["--backend", "horovod"] if args.backend == "horovod" else []
            cmd = [sys.executable, "-m", "tfdist", "launch", *launch, "-n", str(workers), *own]
        else:
            cmd = [sys.executable, *own]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        if workers == 1:
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")
            env["OMP_NUM_THREADS"] = "1"  # one core, as each of the launched workers has
            cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *cmd]
        results = run_workers(cmd, env, out, workers, f"{workers} worker(s)")
    for setting in ("1", str(args.spe)):
        found = {r["digests"][setting] for r in results}
        if len(found) != 1:
            raise SystemExit(f"{workers} workers, steps_per_execution={setting}: the workers "
                             "ended with different weights")
    return results[0]


def report(label: str, result: dict, spe: int) -> float:
    one, many = result["times"]["1"], result["times"][str(spe)]
    ratios = [a / b for a, b in zip(one, many, strict=True)]
    print(f"\n{label}: ms per step, steps_per_execution=1 | ={spe} | speed-up")
    for round_, (a, b, r) in enumerate(zip(one, many, ratios, strict=True), 1):
        print(f"  round {round_}: {a * 1e3:7.2f} | {b * 1e3:7.2f} | {r:5.2f}x")
    median = statistics.median(ratios)
    print(f"  median speed-up {median:.2f}x (spread {min(ratios):.2f}..{max(ratios):.2f}); "
          f"median step {statistics.median(one) * 1e3:.2f} ms -> "
          f"{statistics.median(many) * 1e3:.2f} ms")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spe", type=int, default=8, help="steps_per_execution to compare")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backend", choices=["mwms", "horovod", "single"], default="mwms",
                        help="the 2 workers' backend (the one process uses single)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.out, args.spe, args.rounds, args.backend)
    keras = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "Keras 3"
    print(f"{keras}, {args.backend} for 2 workers, {PER_REPLICA_BATCH} images per replica, "
          f"{STEPS} steps an epoch, one epoch per setting per round, settings alternating")
    single = run(1, args)
    print(f"model: {single['params']} parameters")
    one = report("1 process (one core)", single, args.spe)
    two = report("2 workers (one core each)", run(2, args), args.spe)
    print(f"\nspeed-up on 2 workers / speed-up on 1 process: {two / one:.2f} "
          "(1.00: steps_per_execution helps as much as on one process)")
    print("final weights identical on both workers, for both settings: yes")


if __name__ == "__main__":
    main()
