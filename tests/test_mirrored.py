"""One process driving several devices: MirroredStrategy, one replica per device.

No GPUs here: ``TFDIST_CPU_REPLICAS=2`` splits the CPU into 2 logical devices, the stand-in
that runs the same code paths (MirroredStrategy over a device list, its all-reduce, per-device
copies of every variable) as 2 GPUs would, except NCCL. Each run is one real process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, WORKERS, clean_env

WORKER = WORKERS / "mirrored_worker.py"


def _run(out: Path, global_batch: int, **env: str) -> dict:
    out.mkdir()
    run = subprocess.run([sys.executable, str(WORKER), str(out), str(global_batch)], cwd=ROOT,
                         env=clean_env(**env), capture_output=True, text=True, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result: dict = json.loads((out / "result.json").read_text())
    with np.load(out / "weights.npz") as final, np.load(out / "initial.npz") as initial:
        result["weights"] = [final[f"w{i}"] for i in range(len(final.files))]
        result["initial"] = [initial[f"w{i}"] for i in range(len(initial.files))]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs every test reads: 2 replicas in one process, and one replica with the same
    global batch and with half of it."""
    tmp = tmp_path_factory.mktemp("mirrored")
    return {
        "2 replicas": _run(tmp / "two", 32, TFDIST_CPU_REPLICAS="2"),
        "1 replica": _run(tmp / "one", 32, TFDIST_CPU_REPLICAS="2", TFDIST_BACKEND="single"),
        "1 replica, half the batch": _run(tmp / "half", 16),
    }


@pytest.mark.multiprocess
def test_auto_mirrors_one_process_over_its_devices(runs):
    two = runs["2 replicas"]
    assert (two["backend"], two["num_replicas"], two["local_replicas"]) == ("mirrored", 2, 2)
    assert two["lr_scaled"] == 2.0  # scale_lr counts the replicas
    # backend="single" keeps TensorFlow's default strategy on request, and one device under
    # auto is the single-process backend too.
    assert runs["1 replica"]["backend"] == "single"
    assert runs["1 replica, half the batch"]["backend"] == "single"
    assert runs["1 replica"]["num_replicas"] == 1


@pytest.mark.multiprocess
def test_every_device_holds_the_same_variables(runs):
    # The dense net through the all-reduce, and BatchNormalization's moving statistics through
    # tfdist's average at each epoch's end (each device updates its own from its half batch).
    assert runs["2 replicas"]["copies_equal"] == {"dense": True, "batch_norm": True}


@pytest.mark.multiprocess
def test_two_replicas_train_as_one_with_the_same_global_batch(runs):
    two, one, half = runs["2 replicas"], runs["1 replica"], runs["1 replica, half the batch"]
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(two["weights"], two["initial"],
                                                               strict=True))
    apart = max(float(np.max(np.abs(a - b))) for a, b in zip(two["weights"], one["weights"],
                                                              strict=True))
    control = max(float(np.max(np.abs(a - b))) for a, b in zip(half["weights"], one["weights"],
                                                                strict=True))
    assert moved > 1e-2, moved  # the weights trained
    # The gradient is the mean over the global batch, not over each device's half: equal up to
    # the order of float sums.
    assert apart < 1e-5, apart
    assert control > 1e-3, control  # the control: another global batch trains another model
