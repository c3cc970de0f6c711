"""What the benchmarks share: the issue's conv net, its random images, and running a variant."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Conv widths (first, second, third or None, dense): "small" is about 18k parameters (short
# steps), "large" about 323k.
WIDTHS = {"small": (32, 48, None, 64), "large": (64, 128, 192, 128)}


def conv_net(keras: Any, name: str = "small") -> Any:
    """The conv net ``name`` of :data:`WIDTHS`, on 32x32x3 images, 10 classes (logits)."""
    first, second, third, dense = WIDTHS[name]
    layers = [keras.Input((32, 32, 3)), keras.layers.Conv2D(first, 3, activation="relu"),
              keras.layers.MaxPooling2D(), keras.layers.Conv2D(second, 3, activation="relu")]
    if third:
        layers += [keras.layers.MaxPooling2D(), keras.layers.Conv2D(third, 3, activation="relu")]
    return keras.Sequential([*layers, keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(dense, activation="relu"),
                             keras.layers.Dense(10)])


def random_images(rows: int) -> tuple[Any, Any]:
    """``rows`` random 32x32x3 images and labels, the same for every process (seed 0)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 10, size=rows).astype("int64")


def run_workers(cmd: list[str], env: dict[str, str], out: str, workers: int,
                label: str) -> list[dict[str, Any]]:
    """Runs ``cmd`` and returns each rank's ``out/result-RANK.json``; exits with its output if
    it failed."""
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{label} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.loads(Path(out, f"result-{rank}.json").read_text()) for rank in range(workers)]


def spread(values: list[float], fmt: str) -> str:
    """``median (min..max)`` of ``values``, each formatted with ``fmt``."""
    import statistics

    return (f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}.."
            f"{format(max(values), fmt)})")


def disk_mb_per_s(size: int) -> float:
    """The write bandwidth of the folder the benchmarks save to (the checkout): ``size`` bytes
    written and fsynced."""
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=ROOT, prefix=".tfdist-disk-") as f:
        started = time.monotonic()
        for _ in range(max(1, size >> 20)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return (size / 1e6) / (time.monotonic() - started)
