"""Keras 3 on JAX (``KERAS_BACKEND=jax``): the choice, the meeting place, and real training.

The tables are pure. The runs are real: 2 processes under ``tfdist launch`` meet through JAX's
own runtime with Gloo's CPU collectives and train with Keras's ``DataParallel``; their ranks are
seeded differently and must end bit-identical, equal to one process with the same global batch
within rounding, while a control of the same two processes without tfdist ends apart. The
same run's throughput records hold every rank's input wait, and its starved epoch the advice.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, WORKERS, clean_env, require
from patch_plan import assert_installed_as_planned

from tfdist import health
from tfdist.backends import choose, keras_backend
from tfdist.backends.keras_jax import coordinator
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError, LaunchError

KERAS_BACKEND = {
    # name: (environment, keras.json's text or None when absent, Keras's backend)
    "the variable": ({"KERAS_BACKEND": "jax"}, '{"backend": "tensorflow"}', "jax"),
    "the variable, any case": ({"KERAS_BACKEND": " JAX"}, None, "jax"),
    "keras.json": ({"HOME": "/home/u"}, '{"backend": "jax", "floatx": "float32"}', "jax"),
    "keras.json in KERAS_HOME": ({"KERAS_HOME": "/k"}, '{"backend": "torch"}', "torch"),
    "neither": ({"HOME": "/home/u"}, None, "tensorflow"),
    "a broken keras.json": ({"HOME": "/home/u"}, "{not json", "tensorflow"),
    "keras.json without a backend": ({"HOME": "/home/u"}, '{"floatx": "float16"}',
                                     "tensorflow"),
}


@pytest.mark.parametrize("case", sorted(KERAS_BACKEND))
def test_kerass_backend_is_read_as_keras_reads_it(case):
    environ, text, expected = KERAS_BACKEND[case]
    read_paths = []

    def read(path):
        read_paths.append(path)
        if text is None:
            raise FileNotFoundError(path)
        return text

    assert keras_backend(environ, read) == expected
    if "KERAS_BACKEND" not in environ:
        home = environ.get("KERAS_HOME") or f"{environ['HOME']}/.keras"
        assert read_paths == [f"{home}/keras.json"]


LOCAL = ClusterEnvironment("local", rank=1, world_size=2,
                           worker_addresses=("127.0.0.1:4000", "127.0.0.1:4001"))
CHOICE = {
    # name: (TFDIST_BACKEND, Keras's backend, tfdist's backend or the error's words)
    "jax, auto": ("auto", "jax", "jax"),
    "jax, asked for": ("jax", "jax", "jax"),
    "jax with a TensorFlow backend": ("mwms", "jax", ConfigError("leave TFDIST_BACKEND unset")),
    "jax asked for on TensorFlow": ("jax", "tensorflow", ConfigError("set KERAS_BACKEND=jax")),
    "tensorflow, auto": ("auto", "tensorflow", "mwms"),
    "torch": ("auto", "torch", ConfigError("keras-team/keras#23316")),
    "numpy": ("auto", "numpy", ConfigError("KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow")),
}


@pytest.mark.parametrize("case", sorted(CHOICE))
def test_the_backend_follows_kerass_and_a_backend_tfdist_cannot_drive_is_refused(case):
    requested, keras, expected = CHOICE[case]
    if isinstance(expected, Exception):
        with pytest.raises(ConfigError, match=str(expected).replace("#", r"\#")):
            choose(requested, LOCAL, keras)
        return
    assert choose(requested, LOCAL, keras)[0] == expected


COORDINATOR = {
    # name: (environment, the address or the error's words)
    "tfdist launch": (LOCAL, "127.0.0.1:4000"),
    "srun step": (ClusterEnvironment("slurm", rank=2, world_size=4,
                                     worker_addresses=("n9:20000", "n9:20001", "n10:20000",
                                                       "n10:20001")), "n9:20000"),
    "srun step, MASTER_ADDR": (ClusterEnvironment("slurm", rank=0, world_size=2,
                                                  worker_addresses=("n9:20000", "n10:20000"),
                                                  master_addr="login1"), "login1:20000"),
    "torchrun: above its store": (ClusterEnvironment("torchrun", rank=0, world_size=2,
                                                     master_addr="n9", master_port=29500),
                                  "n9:29501"),
    "mpirun without MASTER_ADDR": (ClusterEnvironment("mpirun", rank=0, world_size=2),
                                   LaunchError("export MASTER_ADDR")),
}


@pytest.mark.parametrize("case", sorted(COORDINATOR))
def test_jax_processes_meet_where_the_launch_says(case):
    environment, expected = COORDINATOR[case]
    if isinstance(expected, Exception):
        with pytest.raises(LaunchError, match=str(expected)):
            coordinator(environment)
        return
    assert coordinator(environment)[0] == expected


def _run(out: Path, mode: str, workers: int) -> dict[int, dict]:
    """The worker in ``mode`` on ``workers`` processes (1: a plain process); each rank's
    record, with its weights (``"weights"``), the run's output and its folder."""
    out.mkdir()
    launch = ["-m", "tfdist", "launch", "-n", str(workers)] if workers > 1 else []
    run = subprocess.run([sys.executable, *launch, str(WORKERS / "keras_jax_worker.py"),
                          str(out), mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, check=False,
                         env=clean_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    records = {}
    for rank in range(workers):
        record = json.loads((out / f"rank-{rank}.json").read_text())
        with np.load(out / f"rank-{rank}.npz") as weights:
            record["weights"] = [weights[f"arr_{i}"] for i in range(len(weights.files))]
        record["output"], record["out"] = run.stdout + run.stderr, out
        records[rank] = record
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    require("jax")
    base = tmp_path_factory.mktemp("keras-jax")
    return {"dist": _run(base / "dist", "dist", 2), "one": _run(base / "one", "one", 1),
            "control": _run(base / "control", "control", 2)}


@pytest.mark.multiprocess
def test_two_ranks_seeded_apart_end_bit_identical_and_as_one_process(runs):
    dist, one = runs["dist"], runs["one"][0]
    assert dist[0]["replicas"] == 2 and one["replicas"] == 1
    for a, b in zip(dist[0]["weights"], dist[1]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # every rank the same bits
    for a, b in zip(dist[0]["weights"], one["weights"], strict=True):  # BatchNormalization's
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # moving statistics among them
    for rank in (0, 1):
        for key, values in one["history"].items():  # fit on arrays (with validation arrays)
            np.testing.assert_allclose(dist[rank]["history"][key], values, rtol=1e-5,
                                       err_msg=key)  # and on a dataset through dist.shard
        np.testing.assert_allclose(dist[rank]["evaluate"], one["evaluate"], rtol=1e-5)
        shape, total = dist[rank]["predicted"]
        assert shape == one["predicted"][0] == [256, 2]  # every row on every rank
        np.testing.assert_allclose(total, one["predicted"][1], rtol=1e-5)
        for (shape, total), (one_shape, one_total) in zip(dist[rank]["few"], one["few"],
                                                          strict=True):
            assert shape == one_shape  # 1 row, 33 rows: every row
            np.testing.assert_allclose(total, one_total, rtol=1e-5)
        # The custom train_step's values are the global batch's, as on one process, on arrays
        # and on a PyDataset, whose batches each rank splits (the step sees 32 rows, not 64).
        assert dist[rank]["custom"]["rows"] == one["custom"]["rows"] == [32.0, 32.0]
        assert dist[rank]["custom"]["spread"] == one["custom"]["spread"], dist[rank]["custom"]
        np.testing.assert_allclose(dist[rank]["custom"]["loss"], one["custom"]["loss"],
                                   rtol=1e-5)
    last = one["custom"]["spread"][0]  # the last step's batch: rows 224-255 of the worker's
    y = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")[224:, :2] * 3 + 1
    assert last == pytest.approx(float(y.max() - y.min()), rel=1e-6)
    assert last > float(y[:16].max() - y[:16].min())  # a rank's half alone would differ
    # The patches of the inventory's plan, in its order (tests/patch_plan.py); the tf.data
    # dataset's epoch installed iterator-free-thread lazily; fit's arrays are not shuffled here
    for rank in (0, 1):
        assert_installed_as_planned(dist[rank]["patches"], reached=["iterator-free-thread"],
                                    not_reached=["arrays-shuffle-seed"])
    assert dist[0]["patches"]["installed"] == [
        "own-error-line", "sequence-one-order", "jax-input-position", "jax-rank0-values",
        "jax-inputs-by-rank", "jax-predict-every-row", "iterator-free-thread"]
    assert_installed_as_planned(one["patches"], reached=["iterator-free-thread"])
    assert one["patches"]["installed"] == ["own-error-line", "jax-input-position",
                                           "iterator-free-thread"]
    # The tf.data dataset's epoch iterators were freed off the training thread
    # (tfdist.keras.iterators)
    assert min(dist[0]["freed_elsewhere"], dist[1]["freed_elsewhere"], one["freed_elsewhere"]) >= 1


@pytest.mark.multiprocess
def test_control_without_tfdist_the_two_processes_end_apart(runs):
    control = runs["control"]
    moved = max(float(np.abs(a - b).max())
                for a, b in zip(control[0]["weights"], control[1]["weights"], strict=True))
    assert moved > 0.1, moved


@pytest.mark.multiprocess
def test_the_chief_says_how_the_processes_met_and_writes_each_file_once(runs):
    output = runs["dist"][0]["output"]
    assert "[0] tfdist: backend jax: Keras 3 on JAX (KERAS_BACKEND=jax)" in output
    assert "[0] tfdist: JAX's processes met at 127.0.0.1:" in output
    assert "2 process(es), 2 CPU device(s), DataParallel over all; gloo collectives" in output
    assert "[1] tfdist:" not in output  # the chief alone speaks
    model_dir = runs["dist"][0]["out"] / "model"
    written = {p.name for p in model_dir.iterdir()}  # logs/: TensorBoard's, where installed
    # Each epoch's exact state (preempted/) is removed once the fit ends well.
    assert written - {"logs"} == {"checkpoint.keras", "throughput.jsonl"}, written


@pytest.mark.multiprocess
def test_every_ranks_input_wait_is_timed_and_the_starved_epoch_gets_the_advice(runs):
    # The arrays' epoch is fed in time (the control); each batch of the dataset's epoch takes
    # DECODE_S to make, far longer than the step: both ranks wait for it, and the chief advises
    # once, naming no rank (every rank's input is slow, not one's).
    output = runs["dist"][0]["output"]
    records = [json.loads(line) for line in (runs["dist"][0]["out"] / "model" /
                                             "throughput.jsonl").read_text().splitlines()]
    assert [r["backend"] for r in records] == ["jax", "jax"], records
    fed, starved = ([p["input_s"] for p in r["ranks"]] for r in records)
    assert [p["rank"] for p in records[1]["ranks"]] == [0, 1], records
    assert all(w is not None and w >= 0 for w in fed + starved), records
    step = [r["step_time_s"]["median"] for r in records]
    assert statistics.median(fed) < health.INPUT_SHARE * step[0], records
    assert statistics.median(starved) > health.INPUT_SHARE * step[1], records
    assert output.count("[0] tfdist: waiting for input takes") == 1, output[-3000:]
    assert " is slow " not in output, output[-3000:]


@pytest.mark.multiprocess
def test_the_sync_check_names_a_rank_whose_copy_differs(runs, tmp_path):
    output = runs["dist"][0]["output"]  # the check ran in the good run, and passed
    # with epoch 1's line, one tfdist line an epoch
    assert re.search(r"^\[0\] tfdist: epoch 1: .*; replica sync check passed at step 1:", output,
                     re.M), output[-3000:]
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2",
                          str(WORKERS / "keras_jax_worker.py"), str(tmp_path), "desync"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
                         env=clean_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2"))
    output = run.stdout + run.stderr
    assert run.returncode != 0 and "trained on" not in output, output[-3000:]
    assert "ReplicaMismatchError" in output and "after step 1" in output, output[-3000:]
    assert re.search(r"rank 1\b.*differ|differ.*rank 1\b", output), output[-3000:]


@pytest.mark.multiprocess
def test_jax_started_before_tfdist_is_refused_with_the_fix(tmp_path):
    require("jax")
    script = tmp_path / "early.py"
    script.write_text("import jax.numpy as jnp\nimport tfdist\n\n"
                      "jnp.ones(2).block_until_ready()  # JAX's runtime starts here\n"
                      "tfdist.init()\n")
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", str(script)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                         env=clean_env(KERAS_BACKEND="jax"))
    output = run.stdout + run.stderr
    assert run.returncode == 78, output  # tfdist's own error: one line, once (tfdist.uncaught)
    said = re.findall(r"^\[\d\] tfdist: JAX's runtime had already started", run.stdout, re.M)
    assert len(said) == 1 and "Traceback" not in output, output[-3000:]
    assert "the first JAX work in main()" in output, output[-3000:]
