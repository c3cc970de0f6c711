"""The Horovod backend with real Horovod 0.28.1 and 2 real processes on loopback.

Workers run in .venv-horovod/ (TensorFlow 2.18.1, the newest Horovod builds against; built by
`make test` through tools/horovod-env.sh); pytest itself runs in .venv/ (TensorFlow 2.21).

Every training run compares both ranks' final weights bit for bit; the control runs without
averaging must end different. Covering set (4 runs instead of the 16 of the full product): every
loop x Keras pair occurs, and every launcher once (a launcher sets the ranks' environment and
the controller, Gloo or MPI, which fit and the custom loop use alike; the loop and the Keras
choose the patches). The Horovod jobs on the Slurm test cluster (tests/test_slurm_horovod.py)
run `fit` with Keras 3 under srun with Gloo and with MPI, mpirun and horovodrun besides.

| launcher | run |
|---|---|
| horovodrun --gloo | custom loop, tf_keras |
| mpirun (Open MPI) | custom loop, Keras 3 |
| tfdist launch --backend horovod | `fit`, Keras 3 |
| srun's variables, Gloo rendezvous by tfdist | `fit`, tf_keras |

"srun's variables" starts the 2 processes with the SLURM_* variables srun sets for a 2-task
step on one node (no Slurm here): it tests tfdist's own Gloo rendezvous exactly as under srun.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_NEEDS,
    HOROVOD_PYTHON,
    ROOT,
    WORKERS,
    clean_env,
    full_matrix_only,
    horovod_facts,
    load_weights,
    needs,
    port_block,
)
from patch_plan import assert_installed_as_planned

HVD_PY = HOROVOD_PYTHON
HVD_BIN = HVD_PY.parent
WORKER = str(WORKERS / "train_worker.py")  # with a 4th argument: the backend
DATA_DIR = str(ROOT / ".cache" / "tensorflow_datasets")
TIMEOUT = 240
KERAS = {"keras3": {}, "tf_keras": {"TF_USE_LEGACY_KERAS": "1"}}
COVERING = [("horovodrun", "custom", "tf_keras"), ("mpirun", "custom", "keras3"),
            ("tfdist-launch", "fit", "keras3"), ("srun-variables", "fit", "tf_keras")]


def _horovod_state() -> tuple[str | None, bool, bool]:
    """Why the Horovod tests cannot run (or None), whether Horovod has MPI, and whether
    .venv-horovod's `keras` is Keras 3 (TensorFlow 2.15's is Keras 2)."""
    facts = horovod_facts()
    if facts["missing"]:
        return str(facts["missing"]), False, False
    if facts["tensorflow"]:
        return f"horovod.tensorflow does not import in .venv-horovod: {facts['tensorflow']}", \
            False, False
    return None, bool(facts["mpi"]), facts["keras_major"] == 3


_SKIP, _MPI_BUILT, _KERAS3 = _horovod_state()
needs_horovod = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def _env(**extra: str) -> dict[str, str]:
    env = clean_env()  # inherited launcher variables would make a worker think it was launched
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    return env


def _command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "horovodrun":
        return [str(HVD_BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                str(HVD_PY), *args]
    if launcher == "mpirun":
        # vader's single-copy mechanism needs ptrace rights containers often lack.
        return ["mpirun", "-np", "2", "--bind-to", "none", "--mca",
                "btl_vader_single_copy_mechanism", "none", "-x", "TF_CPP_MIN_LOG_LEVEL",
                "-x", "TF_USE_LEGACY_KERAS", str(HVD_PY), *args]
    if launcher == "tfdist-launch":
        return [str(HVD_PY), "-m", "tfdist", "launch", "--backend", "horovod", "-n", "2",
                *args]
    raise ValueError(launcher)


def _srun_variables(rank: int, port: int) -> dict[str, str]:
    """What srun exports to task `rank` of `srun -N1 -n2` (job 4242, step 0) on node localhost."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_GTIDS": "0,1", "SLURM_JOB_NUM_NODES": "1",
            "TFDIST_PORT_BASE": str(port)}


def run(launcher: str, args: list[str], env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """Runs a 2-process job; returns the merged output (both ranks for srun-variables)."""
    env = _env(**(env or {}))
    env.setdefault("TF_USE_LEGACY_KERAS", "0")
    if launcher != "srun-variables":
        return subprocess.run(_command(launcher, args), cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT, check=False)
    port = port_block()
    procs = [subprocess.Popen([str(HVD_PY), *args], cwd=ROOT, text=True,
                              env={**env, **_srun_variables(rank, port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, code, "".join(outputs))


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in (0, 1)]


def _train(tmp_path: Path, launcher: str, loop: str, mode: str, keras: str):
    job = run(launcher, [WORKER, str(tmp_path), loop, mode, "horovod"], KERAS[keras])
    return job, _results(tmp_path) if (tmp_path / "result-1.json").exists() else []


pytestmark = [pytest.mark.multiprocess, needs_horovod]


@pytest.mark.parametrize(("launcher", "loop", "keras"), COVERING,
                         ids=["-".join(c) for c in COVERING])
def test_two_ranks_end_bit_identical(tmp_path, launcher, loop, keras):
    if launcher == "mpirun" and (shutil.which("mpirun") is None or not _MPI_BUILT):
        pytest.skip("mpirun or Horovod's MPI is missing: Open MPI comes from `make system` (as "
                    "root), then `make venv-horovod` builds Horovod with it")
    job, results = _train(tmp_path, launcher, loop, "dist", keras)
    assert job.returncode == 0, job.stdout[-6000:]
    assert [(r["size"], r["backend"], r["keras3"]) for r in results] == [
        (2, "horovod", keras == "keras3" and _KERAS3)] * 2
    expected = {"horovodrun": "horovodrun", "mpirun": "mpirun", "tfdist-launch": "local",
                "srun-variables": "slurm"}[launcher]
    assert {r["launcher"] for r in results} == {expected}
    assert {r["collective"] for r in results} == {"mpi" if launcher == "mpirun" else "gloo"}
    weights = [load_weights(tmp_path, rank) for rank in (0, 1)]
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)
    # Losses are averaged over the ranks: both log the same numbers, and training learns.
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    for result in results:  # the patches of the inventory's plan, in its order
        assert_installed_as_planned(result["patches"], not_reached=["arrays-shuffle-seed"])
        assert {"horovod-fit", "compile-without-xla", "epoch-results", "failure-line"} <= set(
            result["patches"]["planned"]["start"]), result["patches"]


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_control_without_averaging_diverges(tmp_path, loop):
    job, results = _train(tmp_path, "tfdist-launch", loop, "control", "keras3")
    assert job.returncode == 0, job.stdout[-6000:]
    assert {r["backend"] for r in results} == {"single"}
    weights = [load_weights(tmp_path, rank) for rank in (0, 1)]
    differing = [not np.array_equal(a, b) for a, b in zip(*weights, strict=True)]
    assert all(differing), "without averaging the ranks must end with different weights"


def test_sync_check_catches_stock_horovod_optimizer_on_keras3(tmp_path):
    """hvd.DistributedOptimizer around a Keras 3 optimizer never averages, silently; tfdist's
    replica sync check stops the job after the first step and names the rank."""
    if not _KERAS3:
        pytest.skip("no Keras 3 here (TensorFlow 2.15): Horovod's own optimizer averages")
    job, results = _train(tmp_path, "tfdist-launch", "fit", "stock", "keras3")
    assert job.returncode != 0
    assert "does NOT average gradients" in job.stdout  # tfdist's warning at compile
    for result in results:  # every rank stops, with the same message
        assert result["error"].startswith("ReplicaMismatchError: Replica sync check failed "
                                          "after step 1: rank 1 holds different weights"), result
        assert "rank 0" in result["error"]


def _example(launcher: str, script: str, *flags: str, env: dict[str, str] | None = None):
    args = [str(ROOT / "examples" / script), f"--data_dir={DATA_DIR}", *flags]
    job = run(launcher, args, env)
    assert job.returncode == 0, job.stdout[-6000:]
    return job.stdout


@needs(*EXAMPLE_NEEDS["keras_train.py"], python=HVD_PY)
def test_keras_train_example_with_horovod_backend():
    out = _example("tfdist-launch", "keras_train.py", "--backend=horovod", "--epochs=6",
                   "--scale_lr")
    assert "backend horovod, collective gloo" in out
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", out).group(1))
    assert accuracy > 0.9, out[-3000:]
    # Each rank prints a digest of its final weights: equal digests, bit-identical weights.
    digests = dict(re.findall(r"tfdist: rank (\d) of 2: final weights (\S+)", out))
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"], out[-3000:]


@needs(*EXAMPLE_NEEDS["custom_loop.py"], python=HVD_PY)
@needs(*EXAMPLE_NEEDS["custom_loop.py"])
@full_matrix_only("the example trains and resumes under MWMS in test_examples.py, and custom "
                  "loops train bit-identical under Horovod in this module's covering runs")
def test_custom_loop_example_same_loop_under_mwms_and_horovod():
    """The same script: MWMS in .venv (TF 2.21), Horovod in .venv-horovod (TF 2.18)."""
    flags = ["--epochs=5", "--learning_rate=0.002"]
    horovod = _example("horovodrun", "custom_loop.py", *flags)
    mwms = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2",
                           str(ROOT / "examples" / "custom_loop.py"), f"--data_dir={DATA_DIR}",
                           *flags], cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=TIMEOUT, check=False)
    assert mwms.returncode == 0, mwms.stdout[-6000:]
    assert "backend horovod" in horovod and "backend mwms" in mwms.stdout
    # auto chose Horovod under horovodrun and logged why
    assert "tfdist: backend horovod: auto: horovodrun started the processes" in horovod
    curves = []
    for out in (horovod, mwms.stdout):
        curves.append([float(x) for x in re.findall(r"epoch \d+/\d+  loss (\d+\.\d+)", out)])
        assert float(re.search(r"test accuracy (\d\.\d+) on 360", out).group(1)) > 0.9
    # Same data, seed and arithmetic: the loss curves agree (to rounding across TF versions).
    assert len(curves[0]) == 5
    np.testing.assert_allclose(curves[0], curves[1], atol=0.01)


# Errors for a missing or mis-built Horovod. They run in .venv (TensorFlow 2.21), with a copy of
# the Horovod that .venv-horovod built against TensorFlow 2.18.1 put on PYTHONPATH: a real
# build against another TensorFlow, not a stand-in.
_PROBE = ("import tfdist\n"
          "try:\n    tfdist.init(backend='horovod')\n"
          "except tfdist.ConfigError as e:\n    print('ConfigError:', e)\n")


def _probe(pythonpath: Path | None) -> str:
    env = _env(**({"PYTHONPATH": str(pythonpath)} if pythonpath else {}))
    job = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=120, check=False)
    assert job.returncode == 0, job.stderr[-3000:]
    return job.stdout


def _horovod_copy(tmp_path: Path) -> Path:
    source = subprocess.run(
        [str(HVD_PY), "-c", "import importlib.util as u; print(u.find_spec('horovod').origin)"],
        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    shutil.copytree(Path(source).parent, tmp_path / "horovod")
    return tmp_path


def _another_tensorflow(copy: Path) -> str:
    """The TensorFlow the copied Horovod was built against; skips the test when that is the
    installed one (a lane whose .venv-horovod is the test environment: nothing mismatches)."""
    built = json.loads((copy / "horovod" / "metadata.json").read_text())["tensorflow"]
    if built == importlib.metadata.version("tensorflow-cpu"):
        pytest.skip(f".venv-horovod's Horovod was built against this TensorFlow ({built})")
    return str(built)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None,
                    reason="horovod is installed in the test environment")
def test_error_when_horovod_is_not_installed():
    out = _probe(None)
    assert "backend 'horovod' needs the horovod package, which is not installed" in out
    assert "HOROVOD_WITH_TENSORFLOW=1" in out and "--no-build-isolation" in out
    # What a user who installed tfdist with pip can run: no path of tfdist's own checkout.
    assert "make venv-horovod" not in out and ".venv-horovod" not in out


def test_error_when_horovod_was_built_against_another_tensorflow(tmp_path):
    installed = importlib.metadata.version("tensorflow-cpu")
    built = _another_tensorflow(_horovod_copy(tmp_path))
    out = _probe(tmp_path)
    assert (f"was compiled against TensorFlow {built}, but TensorFlow {installed} is "
            "installed") in out
    assert "--no-build-isolation" in out


def test_error_when_horovods_library_does_not_load(tmp_path):
    # Horovod's record claims the installed TensorFlow, so only loading its library can tell.
    installed = importlib.metadata.version("tensorflow-cpu")
    path = _horovod_copy(tmp_path)
    _another_tensorflow(path)
    (path / "horovod" / "metadata.json").write_text(json.dumps({"tensorflow": installed}))
    out = _probe(path)
    assert f"does not load with TensorFlow {installed}: it was compiled against another" in out
    assert "undefined symbol" in out


def test_error_when_horovod_has_no_tensorflow_extension(tmp_path):
    path = _horovod_copy(tmp_path)
    # What a build that found no TensorFlow leaves: no library, no TensorFlow in the record.
    for library in (path / "horovod" / "tensorflow").glob("mpi_lib*.so"):
        library.unlink()
    (path / "horovod" / "metadata.json").write_text(json.dumps({"dummy": "none"}))
    out = _probe(path)
    assert "installed without its TensorFlow extension" in out
    assert "Extension horovod.tensorflow has not been built" in out
