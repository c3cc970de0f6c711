"""What does a save of a big state cost training? Synchronous against background writes.

    .venv/bin/python benchmarks/big_saves.py [--rounds 3] [--mb 1100] [--steps 30] [--every 4s]

A Keras 3 model of wide Dense layers whose weights plus Adam's state come to about ``--mb``
MB trains ``--steps`` steps on 2 workers under `tfdist launch` with a model_dir, in three
variants, alternating each round (the machine's noise hits all alike):

- ``none``: no safety saves (the baseline step time);
- ``sync``: ``TFDIST_CHECKPOINT_EVERY`` (every rank stops until the files are written);
- ``background``: the same with ``TFDIST_BACKGROUND_SAVES=1`` (the step waits for a copy of
  the state in host memory; the write goes on beside training).

Per run: the wall time of the steps after the first (it traces), each step's time and the
saves made (the chief's lines). The stall per save is a variant's extra time over ``none``'s in
the same round, divided by its saves; and, apart from the noise between two runs, within the
run: the steps' time beyond the run's median step, divided by its saves. Prints each round,
then the medians with their spread: the stall per save of each both ways, their ratios
background/sync (the target: under 0.05), the step time with background saves against none,
and a synchronous save's time against the disk's own write bandwidth (a file of the state's
size written and fsynced in the model_dir's folder).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import disk_mb_per_s, spread

_spread = functools.partial(spread, fmt=".3f")  # median (min..max), in seconds

ROOT = Path(__file__).resolve().parent.parent
SAVE_LINE = re.compile(r"tfdist: safety save after step \d+ of epoch \d+.* \((\d+\.\d+) s;")
VARIANTS = ("none", "sync", "background")
WIDTH = 2048  # each hidden layer WIDTH x WIDTH: 4.2 M weights, 50 MB with Adam's two slots


def worker(out: str, model_dir: str, layers: int, steps: int) -> None:
    """One rank's training: ``layers`` Dense layers, ``steps`` steps; writes the seconds of
    steps 2.. and the state's size to ``out`` (the chief)."""
    import numpy as np

    import tfdist

    with tfdist.strategy_scope() as dist:
        import keras

        model = keras.Sequential([keras.Input((WIDTH,)),
                                  *[keras.layers.Dense(WIDTH) for _ in range(layers)],
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-5), loss="mse")
    rows = 8 * dist.num_replicas
    x = np.random.default_rng(0).normal(size=(rows * steps, WIDTH)).astype("float32")
    y = np.zeros((rows * steps, 1), "float32")
    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            times.append(time.monotonic())

    model.fit(x, y, batch_size=rows, epochs=1, verbose=0, shuffle=False,
              callbacks=dist.callbacks(Clock(), model_dir=model_dir, tensorboard=False))
    if dist.is_chief:
        size = sum(int(np.prod(v.shape)) * 4 for v in model.weights) * 3  # weights + 2 slots
        Path(out).write_text(json.dumps({"seconds": times[-1] - times[0], "bytes": size,
                                         "steps": [b - a for a, b in itertools.pairwise(times)]}))


def run_once(variant: str, layers: int, steps: int, every: str
             ) -> tuple[float, list[float], int, list[float]]:
    """One run: the seconds of steps 2.., each safety save's seconds, the state's bytes, each
    step's seconds."""
    with tempfile.TemporaryDirectory(prefix="tfdist-big-saves-", dir=ROOT) as folder:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TFDIST_VERBOSE": "1"}
        for name in ("TFDIST_CHECKPOINT_EVERY", "TFDIST_BACKGROUND_SAVES"):
            env.pop(name, None)
        if variant != "none":
            env["TFDIST_CHECKPOINT_EVERY"] = every
        if variant == "background":
            env["TFDIST_BACKGROUND_SAVES"] = "1"
        out = os.path.join(folder, "result.json")
        cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2", __file__, "--worker", out,
               os.path.join(folder, "model"), str(layers), str(steps)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise SystemExit(f"the {variant} run failed:\n{done.stdout[-3000:]}"
                             f"{done.stderr[-3000:]}")
        result = json.loads(Path(out).read_text())
    saves = [float(s) for s in SAVE_LINE.findall(done.stdout + done.stderr)]
    return result["seconds"], saves, result["bytes"], result["steps"]


def excess(step_s: list[float]) -> float:
    """The seconds the steps took beyond the run's median step (pure): what saves added inside
    the run, apart from the run-to-run noise a comparison with another run carries."""
    middle = statistics.median(step_s)
    return sum(max(0.0, s - middle) for s in step_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=1100, help="weights + Adam's state, in MB")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", default="4s", help="sync and background runs' interval")
    args = parser.parse_args()
    layers = max(1, round(args.mb * 1e6 / (WIDTH * WIDTH * 4 * 3)))
    stalls: dict[str, list[float]] = {"sync": [], "background": []}
    within: dict[str, list[float]] = {"sync": [], "background": []}
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    blocked: dict[str, list[float]] = {"sync": [], "background": []}  # the chief's lines
    size = 0
    for round_ in range(1, args.rounds + 1):
        seconds: dict[str, float] = {}
        for variant in VARIANTS:
            seconds[variant], saves, size, each = run_once(variant, layers, args.steps,
                                                           args.every)
            steps[variant].append(seconds[variant] / (args.steps - 1))
            if variant != "none" and saves:
                stalls[variant].append((seconds[variant] - seconds["none"]) / len(saves))
                within[variant].append(excess(each) / len(saves))
            if variant != "none":
                blocked[variant] += saves
            print(f"round {round_} {variant:10} {seconds[variant]:7.2f} s for "
                  f"{args.steps - 1} steps, {len(saves)} saves", flush=True)
    bandwidth = disk_mb_per_s(size)
    print(f"state: {size / 1e6:.0f} MB (weights and Adam's slots, {layers} layers of {WIDTH}x"
          f"{WIDTH}), 2 workers, TFDIST_CHECKPOINT_EVERY={args.every}")
    for variant in VARIANTS:
        print(f"step time {variant:10} {_spread(steps[variant])} s (median, range)")
    for variant, values in blocked.items():
        print(f"training blocked per save {variant:10} {_spread(values)} s (the chief's lines: "
              "the step's wait for the save, or for the state's copy)")
    if blocked["sync"] and blocked["background"]:
        print(f"blocked ratio background/sync: "
              f"{statistics.median(blocked['background']) / statistics.median(blocked['sync']):.3f}"
              " (target: under 0.05)")
    for variant, values in stalls.items():
        print(f"stall per save {variant:10} {_spread(values)} s (the run's time over none's)")
    for variant, values in within.items():
        print(f"stall per save {variant:10} {_spread(values)} s within the run (each step's "
              "time over the run's median step)")
    for name, found in (("", stalls), (" within the run", within)):
        if found["sync"] and found["background"]:
            ratios = [b / s for b, s in zip(found["background"], found["sync"], strict=False)
                      if s > 0]
            print(f"stall ratio background/sync{name}: {_spread(ratios)} (target: under 0.05)")
    if blocked["sync"]:
        took = statistics.median(blocked["sync"])
        print(f"a synchronous save: {took:.2f} s for {size / 1e6:.0f} MB "
              f"({size / 1e6 / took:.0f} MB/s); the disk alone: {bandwidth:.0f} MB/s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
