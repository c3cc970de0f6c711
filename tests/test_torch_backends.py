"""tfdist.torch's backends, DDP, Horovod and DeepSpeed, behind one training loop.

Real processes on loopback, the same worker (tests/workers/torch_backends_worker.py) under each
backend and launcher: every rank starts from different weights, and both must end with the same
ones, equal to DDP's up to the order of float sums; a control without the backend's averaging
must differ. DeepSpeed runs on the CPU over gloo, under `tfdist launch` and torchrun (ZeRO
stage 2 by default, stage 1 through TFDIST_DEEPSPEED_CONFIG). Horovod for torch runs in
.venv-horovod (Horovod compiled with PyTorch there, tools/horovod-env.sh), under `tfdist launch
--backend horovod`, horovodrun --gloo and mpirun (Open MPI, Horovod's MPI controller); those
tests skip without it. Under srun: tests/test_slurm_horovod.py and tests/test_slurm_torch.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    EXAMPLE_NEEDS,
    FULL_MATRIX,
    HOROVOD_PYTHON,
    ROOT,
    WORKERS,
    clean_env,
    horovod_facts,
    require,
)

pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (requirements/deepspeed.txt)")

WORKER = str(WORKERS / "torch_backends_worker.py")
HVD_PY = HOROVOD_PYTHON


def _horovod_torch() -> str | None:
    """Why Horovod's torch runs are skipped, or None."""
    facts = horovod_facts()
    if facts["missing"]:
        return "needs .venv-horovod (make venv-horovod)"
    return f"horovod.torch does not import: {facts['torch']}" if facts["torch"] else None


_NO_HOROVOD = _horovod_torch()
_MPIRUN = shutil.which("mpirun") is not None and _NO_HOROVOD is None and bool(
    horovod_facts()["torch_mpi"])


def _command(launcher: str, python: str, mode: str, out: Path) -> list[str]:
    args = [WORKER, str(out), mode]
    if launcher == "tfdist-launch":
        return [python, "-m", "tfdist", "launch", "-n", "2", *args]
    if launcher == "tfdist-launch-horovod":
        return [python, "-m", "tfdist", "launch", "--backend", "horovod", "-n", "2", *args]
    if launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                *args]
    if launcher == "horovodrun":
        return [str(Path(python).parent / "horovodrun"), "-np", "2", "-H", "localhost:2",
                "--gloo", python, *args]
    if launcher == "mpirun":
        # vader's single-copy mechanism needs ptrace rights containers often lack.
        return ["mpirun", "-np", "2", "--bind-to", "none", "--mca",
                "btl_vader_single_copy_mechanism", "none", "-x", "TFDIST_BACKEND", python, *args]
    raise ValueError(launcher)


def _run(out: Path, launcher: str, mode: str = "dist", python: str = sys.executable,
         **env: str) -> list[dict]:
    out.mkdir(parents=True)
    run = subprocess.run(_command(launcher, python, mode, out), cwd=ROOT,
                         env=clean_env(PYTHONUNBUFFERED="1", **env), capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = []
    for rank in range(2):
        result = json.loads((out / f"result-{rank}.json").read_text())
        with np.load(out / f"weights-{rank}.npz") as weights:
            result["weights"] = [weights[f"w{i}"] for i in range(len(weights.files))]
        result["output"] = run.stdout + run.stderr
        results.append(result)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch-backends")
    found = {
        "ddp": _run(tmp / "ddp", "tfdist-launch", TFDIST_BACKEND="ddp"),
        "deepspeed": _run(tmp / "deepspeed", "tfdist-launch", TFDIST_BACKEND="deepspeed"),
        "deepspeed stage 3": _run(
            tmp / "deepspeed-stage3", "tfdist-launch", TFDIST_BACKEND="deepspeed",
            TFDIST_DEEPSPEED_CONFIG=json.dumps({"zero_optimization": {
                "stage": 3, "stage3_param_persistence_threshold": 0}}),  # even small layers
            LOADER_AFTER_WRAP="1"),
        "control": _run(tmp / "control", "tfdist-launch", "control"),
    }
    if FULL_MATRIX:
        found["deepspeed torchrun stage 1"] = _run(
            tmp / "deepspeed-torchrun", "torchrun", TFDIST_BACKEND="deepspeed",
            TFDIST_DEEPSPEED_CONFIG='{"zero_optimization": {"stage": 1}}')
    if _NO_HOROVOD is None:
        found["horovod"] = _run(tmp / "horovod", "tfdist-launch-horovod", python=str(HVD_PY))
    if _NO_HOROVOD is None and FULL_MATRIX:
        found["horovodrun"] = _run(tmp / "horovodrun", "horovodrun", python=str(HVD_PY),
                                   TFDIST_BACKEND="horovod")
    if _MPIRUN and FULL_MATRIX:  # auto: Horovod under mpirun without MASTER_ADDR
        found["mpirun"] = _run(tmp / "mpirun", "mpirun", python=str(HVD_PY),
                               TFDIST_BACKEND="auto", OMPI_ALLOW_RUN_AS_ROOT="1",
                               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return found


def _largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second, strict=True))


CASES = {  # run: (backend, launcher, collective)
    "ddp": ("ddp", "local", "gloo"),
    "deepspeed": ("deepspeed", "local", "gloo"),
    "deepspeed torchrun stage 1": ("deepspeed", "torchrun", "gloo"),
    "deepspeed stage 3": ("deepspeed", "local", "gloo"),
    "horovod": ("horovod", "local", "gloo"),
    "horovodrun": ("horovod", "horovodrun", "gloo"),
    "mpirun": ("horovod", "mpirun", "mpi"),
}


# In the full matrix only (tests/helpers.py), with what runs their mechanism in make test.
FULL_ONLY = {
    "horovodrun": "Horovod's torch backend under tfdist launch here, horovodrun with TensorFlow "
                  "in test_horovod.py",
    "mpirun": "Horovod's torch backend under tfdist launch here, mpirun with TensorFlow in "
              "test_horovod.py",
    "deepspeed torchrun stage 1": "DeepSpeed at stage 2 and 3 under tfdist launch here, DDP "
                                  "under torchrun in test_torch.py, the stage merged from "
                                  "TFDIST_DEEPSPEED_CONFIG below",
}


def _case(runs: dict, name: str) -> list[dict]:
    if name in FULL_ONLY and not FULL_MATRIX:
        pytest.skip(f"in the full matrix only (make test-full); in make test, {FULL_ONLY[name]}")
    if name not in runs:
        pytest.skip(_NO_HOROVOD or "mpirun or Horovod's MPI is missing: Open MPI comes from "
                    "`make system` (as root), then `make venv-horovod` builds Horovod with it")
    return runs[name]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_ends_with_the_same_weights(runs, name):
    first, second = _case(runs, name)
    assert (first["backend"], first["launcher"], first["collective"]) == CASES[name]
    for a, b in zip(first["weights"], second["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert first["losses"] == second["losses"]  # dist.average: the same on every rank
    assert [r["summed"] for r in (first, second)] == [[3.0], [3.0]]  # sum_over_ranks
    assert [r["saved"] for r in (first, second)] == [True, False]  # dist.save: the chief only


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name in CASES if name != "ddp"])
def test_each_backend_trains_what_ddp_trains(runs, name):
    # Different starting weights on every rank, then the same gradient steps: the backend
    # broadcast rank 0's weights and averaged every gradient, as DDP does. Equal up to the
    # order of float sums (DeepSpeed divides before it sums).
    ours, ddp = _case(runs, name)[0], runs["ddp"][0]
    assert _largest_difference(ours["weights"], ddp["weights"]) < 1e-5
    assert np.allclose(ours["losses"], ddp["losses"], rtol=1e-5)


@pytest.mark.multiprocess
def test_the_control_without_averaging_differs(runs):
    first, second = runs["control"]
    assert first["backend"] == "ddp" and first["steps"] == runs["ddp"][0]["steps"]
    assert _largest_difference(first["weights"], second["weights"]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "folder"), [("deepspeed", "deepspeed"),
                                              ("deepspeed stage 3", "deepspeed-stage3")])
def test_the_chief_saves_the_model_not_the_engine(runs, tmp_path_factory, name, folder):
    # Stage 3: no rank holds the whole model; save gathers it on the chief, which writes a
    # plain model's state_dict as under the other stages.
    import torch

    final = tmp_path_factory.getbasetemp() / "torch-backends0" / folder / "final.pt"
    state = torch.load(final, weights_only=True)
    saved = [tensor.numpy() for tensor in state.values()]  # parameters() order: no buffers
    assert [tensor.shape for tensor in saved] == [(16, 8), (16,), (3, 16), (3,)]
    assert _largest_difference(saved, runs[name][0]["weights"]) == 0.0


@pytest.mark.multiprocess
def test_zero_stage_3_partitions_what_the_other_stages_keep_whole(runs):
    # The control for the stage 3 case: its ranks really held only their halves of the
    # parameters (stage 2 keeps them whole), so equal whole weights there come from gathering.
    # Both engines train with the loader's micro batch (32 over 2 ranks), whether the loader
    # came before wrap (the stage 2 run) or after it (stage 3, the example's order).
    whole = 16 * 8 + 16 + 3 * 16 + 3
    assert [r["partition"] for r in runs["deepspeed"]] == [
        {"stage": 2, "micro_batch": 16, "seen": whole, "partition": 0}] * 2
    stage3 = [r["partition"] for r in runs["deepspeed stage 3"]]
    assert [p["micro_batch"] for p in stage3] == [16, 16]
    assert [(p["stage"], p["seen"]) for p in stage3] == [(3, 0), (3, 0)]
    assert all(0 < p["partition"] < whole for p in stage3)
    assert sum(p["partition"] for p in stage3) >= whole


@pytest.mark.multiprocess
def test_deepspeed_is_quiet_and_compiles_nothing(runs):
    output = runs["deepspeed"][0]["output"]
    assert "deepspeed_shm_comm" not in output and "Building extension" not in output, output
    assert "all_gather_into_tensor` is deprecated" not in output


def test_deepspeed_config_merges_key_by_key(tmp_path):
    from tfdist.errors import ConfigError
    from tfdist.torch.deepspeed import DEFAULT_CONFIG, config_from_setting, merge_config

    merged = merge_config(DEFAULT_CONFIG, {"train_micro_batch_size_per_gpu": 16},
                          {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert merged["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert merged["train_micro_batch_size_per_gpu"] == 16
    assert DEFAULT_CONFIG["zero_optimization"] == {"stage": 2}  # the defaults stay
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    assert config_from_setting(str(path)) == {"zero_optimization": {"stage": 3}}
    assert config_from_setting(' {"gradient_clipping": 1.0}') == {"gradient_clipping": 1.0}
    assert config_from_setting(None) == {}
    for text, message in ((str(tmp_path / "missing.json"), "no such file"),
                          ("{not json", "is not valid JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(ConfigError, match=message):
            config_from_setting(text if text != "[1]" else str(_write(tmp_path, text)))


def _write(folder: Path, text: str) -> Path:
    path = folder / "list.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("backend", ["horovod", "deepspeed"])
def test_a_backend_that_owns_the_step_needs_the_optimizer(backend):
    code = ("import torch, tfdist.torch\n"
            "with tfdist.torch.distributed() as dist:\n"
            "    dist.wrap(torch.nn.Linear(2, 2))\n")
    python = str(HVD_PY) if backend == "horovod" else sys.executable
    if backend == "horovod" and _NO_HOROVOD:
        pytest.skip(_NO_HOROVOD)
    run = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=clean_env(TFDIST_BACKEND=backend), timeout=120, check=False)
    assert run.returncode == 78  # tfdist's own error: one line (tfdist.uncaught)
    assert "give it the optimizer: `model, optimizer = dist.wrap(model, optimizer)`" in run.stderr
    assert "Traceback" not in run.stderr


EXAMPLE = str(ROOT / "examples" / "torch_train.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["deepspeed", "horovod"])
def test_the_example_trains_under_each_backend(backend):
    from helpers import final_weights

    if backend == "horovod" and _NO_HOROVOD:
        pytest.skip(_NO_HOROVOD)
    python = str(HVD_PY) if backend == "horovod" else sys.executable
    require(*EXAMPLE_NEEDS["torch_train.py"], python=python)
    launch = ["--backend", "horovod"] if backend == "horovod" else []
    run = subprocess.run([python, "-m", "tfdist", "launch", *launch, "-n", "2", EXAMPLE,
                          "--epochs=2", f"--backend={backend}"], cwd=ROOT,
                         env=clean_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    weights = final_weights([run.stdout])
    assert weights.keys() == {0, 1} and len({d for _, d in weights.values()}) == 1, run.stdout
    assert f"backend {backend}, collective gloo" in run.stdout
    accuracy = float(run.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.5, run.stdout  # 10 classes: chance is 0.1
