"""Several devices per process: MirroredStrategy in one process, and MultiWorkerMirroredStrategy
with several replicas per worker (``srun --gpus-per-task=4``, ``tfdist launch --gpus-per-worker``).

No GPUs here: ``TFDIST_CPU_REPLICAS=2`` splits the CPU into 2 logical devices, the stand-in
that runs the same code paths (a strategy over a device list, its all-reduce, per-device
copies of every variable) as 2 GPUs would, except NCCL. Each run is real processes: one, or 2
workers started by ``tfdist launch``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FULL_MATRIX, ROOT, WORKERS, clean_env, full_matrix_only

from tfdist.keras.versions import keras2_package

WORKER = WORKERS / "mirrored_worker.py"


def _load(path: Path) -> list[np.ndarray]:
    with np.load(path) as arrays:
        return [arrays[f"w{i}"] for i in range(len(arrays.files))]


def _result(out: Path) -> dict:
    result: dict = json.loads((out / "result.json").read_text())
    for name in ("weights", "initial", "batch_norm", "control"):
        if name != "control" or (out / "control.npz").exists():
            result[name] = _load(out / f"{name}.npz")
    return result


def _run(out: Path, global_batch: int, **env: str) -> dict:
    out.mkdir()
    run = subprocess.run([sys.executable, str(WORKER), str(out), str(global_batch)], cwd=ROOT,
                         env=clean_env(**env), capture_output=True, text=True, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return _result(out)


def _launch(out: Path, global_batch: int, **env: str) -> list[dict]:
    """2 workers of the worker script under ``tfdist launch``; each rank's result."""
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", str(WORKER),
                          str(out), str(global_batch)], cwd=ROOT, env=clean_env(**env),
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [_result(out / f"rank-{rank}") for rank in range(2)]


def _largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second, strict=True))


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
    moved = _largest_difference(two["weights"], two["initial"])
    apart = _largest_difference(two["weights"], one["weights"])
    control = _largest_difference(half["weights"], one["weights"])
    assert moved > 1e-2, moved  # the weights trained
    # The gradient is the mean over the global batch, not over each device's half: equal up to
    # the order of float sums.
    assert apart < 1e-5, apart
    assert control > 1e-3, control  # the control: another global batch trains another model


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """2 workers x 2 logical CPUs each under MWMS, on both Kerases; the Keras 3 launch also
    trains the control, its BatchNormalization net again with the averaging of the statistics
    turned off (TFDIST_AVERAGE_BATCH_STATISTICS=0, in the same processes: one launch fewer)."""
    tmp = tmp_path_factory.mktemp("workers")
    found = {"keras 3": _launch(tmp / "keras3", 32, TFDIST_CPU_REPLICAS="2",
                                MIRRORED_TEST_CONTROL="1")}
    if FULL_MATRIX:
        found["tf_keras"] = _launch(tmp / "tf_keras", 32, TFDIST_CPU_REPLICAS="2",
                                    TF_USE_LEGACY_KERAS="1")
    return found


# tf_keras's launch: in the full matrix only (tests/helpers.py).
KERASES = ["keras 3", pytest.param("tf_keras", marks=full_matrix_only(
    "Keras 3 drives two replicas on each of 2 workers here, and Keras 2 two replicas in one "
    "process in the TensorFlow 2.15 lane"))]


@pytest.mark.multiprocess
@pytest.mark.parametrize("keras", KERASES)
def test_two_workers_drive_two_replicas_each(workers, keras):
    for rank in workers[keras]:
        assert (rank["backend"], rank["world_size"]) == ("mwms", 2)
        assert (rank["num_replicas"], rank["local_replicas"]) == (4, 2)
        assert rank["lr_scaled"] == 4.0  # scale_lr counts every replica of every worker
        assert rank["copies_equal"] == {"dense": True, "batch_norm": True}


@pytest.mark.multiprocess
@pytest.mark.parametrize("keras", KERASES)
def test_every_rank_ends_with_the_same_weights(workers, keras):
    first, second = workers[keras]
    for name in ("weights", "batch_norm"):  # the moving statistics included
        for a, b in zip(first[name], second[name], strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("keras", KERASES)
def test_four_replicas_train_as_one_with_the_same_global_batch(workers, runs, keras):
    four, one = workers[keras][0], runs["1 replica"]
    assert _largest_difference(four["weights"], four["initial"]) > 1e-2  # it trained
    # Global batch 32 as 4 replicas of 8 over 2 workers, against one replica of 32: equal up
    # to the order of float sums. The control of another global batch is in the test above.
    assert _largest_difference(four["weights"], one["weights"]) < 1e-5


@pytest.mark.multiprocess
def test_the_control_without_averaging_differs(workers):
    # Each replica updates its moving statistics from its own 8 examples: without tfdist's
    # average, the devices and the ranks hold different ones (the dense net stays equal).
    if keras2_package():
        pytest.skip("tf.keras is Keras 2 here (TensorFlow 2.15): under MWMS its moving "
                    "statistics are sync-on-read means, averaged without tfdist")
    first, second = workers["keras 3"]
    assert first["copies_equal"] == {"dense": True, "batch_norm": True}  # with the average
    assert first["control_copies_equal"] is False
    assert _largest_difference(first["control"], second["control"]) > 1e-3
    assert _largest_difference(first["weights"], second["weights"]) == 0.0
