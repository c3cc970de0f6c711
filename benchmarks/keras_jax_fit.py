"""Does Keras 3 on JAX train as fast through tfdist as a plain Keras-on-JAX script?

    python benchmarks/keras_jax_fit.py [--rounds 3]                  # ResNet-50 on a GPU
    python benchmarks/keras_jax_fit.py --model small --image-size 32 --batch 32 --steps 8 \\
        --epochs 3 --dtype-policy float32 --rounds 2                # a smoke test on any machine

A model from ``keras.applications`` with random weights (default ResNet50; ``small`` and
``large`` are the benchmarks' conv nets) trained with ``fit`` on in-memory random images
(``--steps`` batches of ``--batch`` a epoch, ``--epochs`` epochs), mixed bf16 by default, SGD with
momentum; each variant in its own process with ``KERAS_BACKEND=jax``:

- ``plain``: the script as Keras's guide writes it, the baseline;
- ``tfdist``: the same script through tfdist, as the README asks for it: ``tfdist.init()``
  first, the model built in ``dist.scope()``, ``fit(callbacks=dist.callbacks(model_dir=...))``
  (the epoch checkpoint, the exact state at each epoch's end, the preemption and walltime
  agreement, the throughput meter).

An epoch's speed is its images over the time from its first step's start to its last step's end
(the saves at the epoch's end are not in it). The first epoch compiles and is left out; the
others are the steady epochs. The variants take turns, in a rotated order each round. Prints
each round's steady img/s, each variant's ratio to ``plain`` in the same round and its slowest
steady epoch against its first steady one (a recompilation shows there); then per variant the
median over the rounds with min..max. Targets: ``tfdist`` at least 0.99 of ``plain``, and no
steady epoch slower than the first one.
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
from typing import Any

from _common import ROOT, WIDTHS, conv_net, spread

VARIANTS = ("plain", "tfdist")


def worker(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One process of ``variant``: trains and times every epoch."""
    dist = None
    if variant == "tfdist":
        import tfdist

        dist = tfdist.init()
    import jax
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    if args.dtype_policy != "float32":
        keras.mixed_precision.set_global_policy(args.dtype_policy)
    rows = args.batch * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.image_size, args.image_size, 3)).astype("float32")
    y = rng.integers(0, args.classes, size=rows).astype("int32")
    timer = _timer(keras)
    with dist.scope() if dist else _nothing():
        model = _model(keras, args)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with tempfile.TemporaryDirectory() as model_dir:
        callbacks = dist.callbacks(timer, model_dir=model_dir) if dist else [timer]
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
                            shuffle=False, callbacks=callbacks)
    speeds = [rows / seconds for seconds in timer.seconds]
    device = jax.devices()[0]
    return {"variant": variant, "epochs": speeds, "loss": history.history["loss"][-1],
            "device": f"{device.platform}: {getattr(device, 'device_kind', '')}",
            "jax": jax.__version__, "keras": keras.__version__}


class _nothing:  # noqa: N801 (a context manager, lower case as contextlib's)
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _model(keras: Any, args: argparse.Namespace) -> Any:
    if args.model in WIDTHS:
        body = conv_net(keras, args.model)
        if args.image_size != 32 or args.classes != 10:
            raise SystemExit(f"--model {args.model} takes --image-size 32 and --classes 10")
        return body
    build = getattr(keras.applications, args.model)
    return build(weights=None, input_shape=(args.image_size, args.image_size, 3),
                 classes=args.classes, classifier_activation=None)


def _timer(keras: Any) -> Any:
    class EpochTimer(keras.callbacks.Callback):
        """Each epoch's seconds from its first step's start to its last step's end (the
        step's results are read, so the device has finished it)."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0
            self._end = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if not self._start:
                self._start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            float((logs or {}).get("loss", 0.0))  # waits for the step
            self._end = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seconds.append(self._end - self._start)

    return EpochTimer()


def run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One process of ``variant``; its result."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("model", "image_size", "classes", "batch", "steps", "epochs",
                          "dtype_policy")]
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONWARNINGS": "ignore",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, __file__, "--worker", variant, *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    steady = result["epochs"][1:]
    result["steady"] = statistics.median(steady)
    result["slowest"] = min(steady) / steady[0]  # the slowest steady epoch against the first
    return result


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="ResNet50",
                        help=f"a keras.applications name, or one of {sorted(WIDTHS)}")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="batches an epoch")
    parser.add_argument("--epochs", type=int, default=4, help="the first compiles: at least 3")
    parser.add_argument("--dtype-policy", default="mixed_bfloat16")
    parser.add_argument("--json", help="also write every round's results to this file")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be at least 3: one compiles, two are compared")
    return args


def main() -> None:
    args = _arguments()
    if args.worker:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return
    print(f"{args.model}, random {args.image_size}x{args.image_size} images, batch "
          f"{args.batch}, {args.steps} steps an epoch, {args.epochs} epochs (the first "
          f"compiles), {args.dtype_policy}, fit on arrays; {args.rounds} rounds, the variants in "
          "turn", flush=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        shift = number % len(VARIANTS)
        found = {name: run(name, args) for name in VARIANTS[shift:] + VARIANTS[:shift]}
        rounds.append(found)
        if number == 0:
            first = found["plain"]
            print(f"on {first['device']}, JAX {first['jax']}, Keras {first['keras']}",
                  flush=True)
        base = found["plain"]["steady"]
        print(f"round {number + 1}: " + " | ".join(
            f"{name} {found[name]['steady']:.0f} img/s ({found[name]['steady'] / base:.3f}), "
            f"slowest epoch {found[name]['slowest']:.2f} of the first steady"
            for name in VARIANTS), flush=True)
    print(f"median (min..max) over {args.rounds} rounds; ratio to plain in the same round:")
    for name in VARIANTS:
        speeds = [found[name]["steady"] for found in rounds]
        ratios = [found[name]["steady"] / found["plain"]["steady"] for found in rounds]
        slowest = [found[name]["slowest"] for found in rounds]
        print(f"  {name:>6}: {spread(speeds, '.0f')} img/s, ratio {spread(ratios, '.3f')}, "
              f"slowest steady epoch {spread(slowest, '.2f')} of the first")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
