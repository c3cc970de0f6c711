"""Backend choice, Horovod's controller, rendezvous variables and input sharding, as tables.

Pure: no worker processes, no Horovod needed (the sharding tests run TensorFlow in this process).
The errors for a missing or mis-built Horovod are in tests/test_horovod.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from tfdist.backends import choose as choose_backend
from tfdist.backends import choose_torch
from tfdist.env import ClusterEnvironment, detect
from tfdist.errors import ConfigError
from tfdist.horovod.join import choose_controller
from tfdist.horovod.rendezvous import Slot, gloo_env, slots
from tfdist.launch import build_horovod_workers, horovod_worker_env
from tfdist.settings import resolve
from tfdist.strategy import resolve_settings

ENV = {
    "one process": ClusterEnvironment("single"),
    "tfdist launch": ClusterEnvironment("local", rank=1, world_size=2),
    "tfdist launch --backend horovod": ClusterEnvironment("local", rank=1, world_size=2,
                                                          launched_for="horovod"),
    "TF_CONFIG": ClusterEnvironment("tf_config", rank=0, world_size=4),
    "srun step": ClusterEnvironment("slurm", rank=3, world_size=8),
    "torchrun": ClusterEnvironment("torchrun", rank=0, world_size=2),
    "horovodrun": ClusterEnvironment("horovodrun", rank=0, world_size=2),
    "mpirun": ClusterEnvironment("mpirun", rank=1, world_size=2),
    "horovodrun -np 1": ClusterEnvironment("horovodrun", rank=0, world_size=1),
}

AUTO = {
    # one process: MirroredStrategy when it sees several GPUs, decided when it starts
    # (tfdist.backends.mirrored), else the single-process backend
    "one process": "mirrored",
    "tfdist launch": "mwms",
    "tfdist launch --backend horovod": "horovod",
    "TF_CONFIG": "mwms",
    "srun step": "mwms",
    "torchrun": "mwms",
    "horovodrun": "horovod",
    "mpirun": "horovod",
    "horovodrun -np 1": "mirrored",
}


@pytest.mark.parametrize("launch", sorted(AUTO))
def test_auto_backend(launch):
    backend, why = choose_backend("auto", ENV[launch])
    assert backend == AUTO[launch]
    assert why.startswith("auto: ")


@pytest.mark.parametrize("requested", ["mwms", "horovod", "single"])
@pytest.mark.parametrize("launch", ["horovodrun", "srun step", "one process"])
def test_explicit_backend_wins(launch, requested):
    assert choose_backend(requested, ENV[launch]) == (
        requested, "requested (argument, flag or TFDIST_BACKEND)")


TORCH_AUTO = {
    "one process": "ddp",
    "tfdist launch": "ddp",
    "tfdist launch --backend horovod": "horovod",
    "TF_CONFIG": "ddp",
    "srun step": "ddp",
    "torchrun": "ddp",
    "horovodrun": "horovod",
    "mpirun": "horovod",
    "horovodrun -np 1": "ddp",
}


@pytest.mark.parametrize("launch", sorted(TORCH_AUTO))
def test_auto_torch_backend(launch):
    backend, why = choose_torch("auto", ENV[launch])
    assert backend == TORCH_AUTO[launch]
    assert why.startswith("auto: ")


def test_torch_under_mpirun_with_an_address_is_ddp():
    # The documented way to run DDP under mpirun: export MASTER_ADDR and MASTER_PORT.
    given = ClusterEnvironment("mpirun", rank=1, world_size=2, master_addr="n1", master_port=29500)
    assert choose_torch("auto", given)[0] == "ddp"


@pytest.mark.parametrize("requested", ["ddp", "horovod", "deepspeed"])
def test_explicit_torch_backend_wins(requested):
    assert choose_torch(requested, ENV["srun step"]) == (
        requested, "requested (argument, flag or TFDIST_BACKEND)")


@pytest.mark.parametrize(("chooser", "requested", "message"), [
    (choose_backend, "ddp", "'ddp' is a PyTorch backend .*TensorFlow's are auto, mwms"),
    (choose_backend, "deepspeed", "'deepspeed' is a PyTorch backend"),
    (choose_torch, "mwms", "'mwms' is a TensorFlow backend; tfdist.torch's are auto, ddp, "
                           "horovod, deepspeed"),
    (choose_torch, "mirrored", "'mirrored' is a TensorFlow backend"),
])
def test_each_framework_refuses_the_others_backends(chooser, requested, message):
    with pytest.raises(ConfigError, match=message):
        chooser(requested, ENV["srun step"])


def test_backend_setting_accepts_horovod_and_names_choices():
    assert resolve_settings(environ={"TFDIST_BACKEND": "Horovod"})["backend"] == "horovod"
    given = resolve_settings("horovod", environ={"TFDIST_BACKEND": "mwms"})
    assert given["backend"] == "horovod"
    with pytest.raises(ConfigError, match=r"'hvd' is not one of \('auto', 'mwms', 'horovod'"):
        resolve_settings("hvd", environ={})


def _srun_step(environ: dict[str, str]) -> ClusterEnvironment:
    """Task 0 of a 2-task srun step on one node, with ``environ`` added (PMIx, settings)."""
    return detect({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                   "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n1",
                   "SLURM_JOB_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", **environ})


CONTROLLER = {
    # name: (environ, mpi_built, gloo_built, expected)
    "srun, Gloo build": ({}, False, True, "gloo"),
    "srun, both built, no PMI": ({}, True, True, "gloo"),
    "srun --mpi=pmix, both built": ({"PMIX_RANK": "0"}, True, True, "mpi"),
    "srun --mpi=pmi2, both built": ({"PMI_RANK": "0"}, True, True, "mpi"),
    "srun --mpi=pmix, Gloo only": ({"PMIX_RANK": "0"}, False, True, "gloo"),
    "forced mpi": ({"TFDIST_HOROVOD_CONTROLLER": "MPI"}, True, True, "mpi"),
    "forced gloo under pmix": ({"PMIX_RANK": "0", "TFDIST_HOROVOD_CONTROLLER": "gloo"}, True,
                               True, "gloo"),
}


@pytest.mark.parametrize("case", sorted(CONTROLLER))
def test_srun_controller(case):
    environ, mpi, gloo, expected = CONTROLLER[case]
    requested = resolve("horovod_controller", environ=environ)
    assert choose_controller(_srun_step(environ), requested, mpi, gloo) == expected


@pytest.mark.parametrize(("environ", "mpi", "gloo", "message"), [
    ({"TFDIST_HOROVOD_CONTROLLER": "nccl"}, True, True, r"'nccl' is not one of"),
    ({"TFDIST_HOROVOD_CONTROLLER": "mpi"}, False, True, r"rebuild it with HOROVOD_WITH_MPI=1"),
    ({}, True, False, r"rebuild it with HOROVOD_WITH_GLOO=1"),
])
def test_srun_controller_errors(environ, mpi, gloo, message):
    with pytest.raises(ConfigError, match=message):
        requested = resolve("horovod_controller", environ=environ)
        choose_controller(_srun_step(environ), requested, mpi, gloo)


def test_slots_match_horovodrun_for_two_nodes():
    # 3 ranks on n1, 1 on n2: local rank 0 exists on both nodes, 1 and 2 only on n1.
    got = slots(["n1", "n1", "n1", "n2"])
    assert got == [Slot("n1", 0, 0, 0, 4, 3, 2), Slot("n1", 1, 1, 0, 4, 3, 1),
                   Slot("n1", 2, 2, 0, 4, 3, 1), Slot("n2", 3, 0, 1, 4, 1, 2)]


def test_slots_cyclic_order():
    got = slots(["a", "b", "a", "b"])
    assert [(s.local_rank, s.cross_rank, s.local_size, s.cross_size) for s in got] == [
        (0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]


def test_gloo_env_is_what_horovodrun_sets():
    env = gloo_env(Slot("n2", 3, 0, 1, 4, 1, 2), "n1-ib0", 20480, None)
    assert env == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "n1-ib0", "HOROVOD_GLOO_RENDEZVOUS_PORT": "20480",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": "n2", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2", "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}


def test_gloo_env_user_settings_win():
    env = horovod_worker_env({"HOROVOD_GLOO_IFACE": "ib0", "HOROVOD_GLOO_TIMEOUT_SECONDS": "600"},
                             4321, 0, 1)
    assert (env["HOROVOD_GLOO_IFACE"], env["HOROVOD_GLOO_TIMEOUT_SECONDS"]) == ("ib0", "600")
    assert gloo_env(Slot("n1", 0, 0, 0, 1, 1, 1), "n1", 1, "lo")["HOROVOD_GLOO_IFACE"] == "lo"
    with pytest.raises(ConfigError, match="HOROVOD_GLOO_TIMEOUT_SECONDS='soon'"):
        horovod_worker_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "soon"}, 4321, 0, 1)


def test_launch_horovod_worker_env():
    base = {"PATH": "/bin", "TF_CONFIG": "{}", "TFDIST_BACKEND": "mwms"}
    env = horovod_worker_env(base, 4321, 1, 2)
    assert "TF_CONFIG" not in env and env["PATH"] == "/bin"
    assert {k: env[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                "HOROVOD_LOCAL_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                                "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE",
                                "TFDIST_LAUNCHER", "TFDIST_BACKEND")} == {
        "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321", "HOROVOD_GLOO_IFACE": "lo",
        "TFDIST_LAUNCHER": "local", "TFDIST_BACKEND": "horovod"}
    # What the worker then detects: tfdist launch, not horovodrun.
    found = detect(env)
    assert (found.launcher, found.rank, found.world_size) == ("local", 1, 2)
    assert found.reason.startswith("tfdist launch --backend horovod")


def test_build_horovod_workers():
    workers = build_horovod_workers(2, ["python", "w.py"], 99, {}, [frozenset({0}),
                                                                    frozenset({1})])
    assert [(w.rank, w.argv, w.env["HOROVOD_RANK"], w.cpus) for w in workers] == [
        (0, ("python", "w.py"), "0", frozenset({0})), (1, ("python", "w.py"), "1", frozenset({1}))]
    with pytest.raises(ConfigError, match="at least 1"):
        build_horovod_workers(0, ["x"], 1, {})


def test_cli_launch_backend_flag():
    from tfdist.cli import build_parser

    args = build_parser().parse_args(["launch", "--backend", "horovod", "-n", "2", "x.py"])
    assert args.backend == "horovod"
    assert build_parser().parse_args(["launch", "-n", "2", "x.py"]).backend == "mwms"


def test_launch_horovod_without_horovod_says_where_to_get_it(tmp_path):
    if importlib.util.find_spec("horovod") is not None:
        pytest.skip("horovod is installed in this Python; the message is for when it is not")
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "--backend", "horovod",
                          "-n", "2", "x.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 2
    assert "needs horovod in the launcher's Python" in run.stderr
    assert "make venv-horovod" in run.stderr


def _batches(dataset) -> list[list[int]]:
    return [b.numpy().tolist() for b in dataset]


@pytest.mark.parametrize(("count", "batch", "expected"), [
    # 10 examples, global batch 4, 2 ranks: slices of every global batch; a short last batch
    # still gives both ranks one step.
    (10, 4, [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]]),
    (8, 4, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
])
def test_horovod_data_shard_slices_global_batches(count, batch, expected):
    import tensorflow as tf

    from tfdist.horovod.sharding import shard

    ds = tf.data.Dataset.range(count).batch(batch)
    assert [_batches(shard(ds, rank, 2)) for rank in (0, 1)] == expected


def test_horovod_data_shard_keeps_structure():
    import tensorflow as tf

    from tfdist.horovod.sharding import shard

    ds = tf.data.Dataset.from_tensor_slices(({"x": tf.range(4)}, tf.range(4) * 10)).batch(4)
    (features, labels), = list(shard(ds, 1, 2))
    assert (features["x"].numpy().tolist(), labels.numpy().tolist()) == ([2, 3], [20, 30])


def test_horovod_file_shard_and_off(tmp_path):
    import tensorflow as tf

    from tfdist.horovod.sharding import shard

    files = []
    for i in range(4):
        files.append(str(tmp_path / f"f{i}.txt"))
        (tmp_path / f"f{i}.txt").write_text("".join(f"{i * 100 + j}\n" for j in range(4)))

    def make():  # type: ignore[no-untyped-def]
        return tf.data.TextLineDataset(files).map(
            lambda s: tf.strings.to_number(s, tf.int64)).batch(4)

    ranks = [_batches(shard(make(), rank, 2, "file", num_files=4)) for rank in (0, 1)]
    assert ranks == [[[0, 1], [2, 3], [200, 201], [202, 203]],
                     [[100, 101], [102, 103], [300, 301], [302, 303]]]
    assert _batches(shard(make(), 0, 2, "off"))[:2] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(("policy", "kwargs", "message"), [
    ("rows", {}, "is not one of"),
    ("file", {}, "needs num_files="),
    ("file", {"num_files": 1}, "1 input file.s. for 2 workers"),
])
def test_horovod_shard_refusals(policy, kwargs, message):
    import tensorflow as tf

    from tfdist.horovod.sharding import shard

    with pytest.raises(ConfigError, match=message):
        shard(tf.data.Dataset.range(8).batch(4), 0, 2, policy, **kwargs)


def test_horovod_shard_needs_a_divisible_batch():
    import tensorflow as tf

    from tfdist.horovod.sharding import shard

    with pytest.raises(ConfigError, match="global batch size 5 does not divide over 2 ranks"):
        shard(tf.data.Dataset.range(10).batch(5), 0, 2, "off")


def test_import_tfdist_horovod_loads_nothing_heavy():
    code = ("import sys, tfdist, tfdist.horovod, tfdist.horovod.rendezvous, tfdist.launch; "
            "print(sorted(m for m in ('tensorflow', 'horovod', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize(("environ", "message"), [
    ({"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
                   '"task": {"type": "worker", "index": 0}}', "TFDIST_LAUNCHER": "local",
      "TFDIST_LOCAL_RANK": "0"},
     "started by `tfdist launch` without Horovod's rendezvous"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"},
     "Horovod cannot join this launch"),
])
def test_horovod_refuses_launches_it_cannot_join(monkeypatch, environ, message):
    # Refused before Horovod or TensorFlow is imported: rather than two jobs of one process.
    import tfdist
    from tfdist import strategy
    from tfdist.errors import LaunchError

    for name in list(os.environ):
        if name.startswith(("TF_CONFIG", "TFDIST_", "HOROVOD_", "OMPI_", "PMI", "SLURM_")):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    # tfdist.init quiets TensorFlow in this process's environment: undone after the test.
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    monkeypatch.setenv("TFDIST_VERBOSE", os.environ.get("TFDIST_VERBOSE", "0"))
    strategy.reset()
    with pytest.raises(LaunchError, match=message):
        tfdist.init(backend="horovod")
    assert tfdist.current() is None
