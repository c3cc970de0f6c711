"""tfdist's SlurmClusterResolver against TensorFlow's stock one, one test per defect.

Each ``test_defect_N_*`` feeds both resolvers the Slurm variables of defect N from
``tfdist/backends/resolver.py``'s docstring. The stock resolver runs on the real ``os.environ``
(patched, cleared, with an empty PATH so that ``nvidia-smi`` is missing as on these machines)
and must fail the way that docstring describes: that proves the input
exercises the defect. tfdist's resolver must then give the corrected result.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import tensorflow as tf

from tfdist.backends.resolver import SlurmClusterResolver
from tfdist.devices import select_gpus
from tfdist.env import detect, slurm
from tfdist.errors import ConfigError, LaunchError

StockResolver = tf.distribute.cluster_resolver.SlurmClusterResolver

JOB = "4242"
P = slurm.port_base({"SLURM_JOB_ID": JOB, "SLURM_STEP_ID": "0"}, 2)


def srun_task(rank: int, *, nodes: str = "n[1-2]", tasks_per_node: str = "2(x2)",
              ntasks: int = 4, job: str = JOB, gpus: str | None = "0,1",
              **extra: str) -> dict[str, str]:
    """The variables of one task of an srun step (block layout unless told otherwise)."""
    environ = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
               "SLURM_STEP_NODELIST": nodes, "SLURM_JOB_NODELIST": nodes,
               "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_STEP_NUM_TASKS": str(ntasks),
               "SLURM_NTASKS": str(ntasks), **extra}
    if gpus is not None:
        environ["CUDA_VISIBLE_DEVICES"] = gpus
    return environ


@pytest.fixture
def no_gpu_tools(tmp_path: Path) -> str:
    """An empty PATH: no nvidia-smi, as on the project's machines."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    return str(empty)


@pytest.fixture
def stock_env(no_gpu_tools: str) -> Iterator[Any]:
    """Runs code under exactly the given variables; os.environ is restored afterwards, so the
    stock resolver's rewrite of CUDA_VISIBLE_DEVICES cannot leak into other tests."""

    def patched(environ: dict[str, str]) -> Any:
        return mock.patch.dict(os.environ, {**environ, "PATH": no_gpu_tools}, clear=True)

    before = _outside_pytest(os.environ)
    yield patched
    assert _outside_pytest(os.environ) == before


def _outside_pytest(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name != "PYTEST_CURRENT_TEST"}


def stock_cluster(environ: dict[str, str], stock_env: Any, **kwargs: Any) -> dict[str, Any]:
    """What the stock resolver makes of ``environ``: its cluster, task and GPU choice."""
    with stock_env(environ):
        resolver = StockResolver(**kwargs)
        spec = resolver.cluster_spec().as_dict()
        return {"spec": spec, "task": (resolver.task_type, resolver.task_id),
                "master": resolver.master(),
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


def workers(resolver: SlurmClusterResolver) -> list[str]:
    spec: dict[str, list[str]] = resolver.cluster_spec().as_dict()
    return spec["worker"]


# --- the nine defects --------------------------------------------------------------------

def test_defect_1_no_cuda_visible_devices_and_no_nvidia_smi(stock_env: Any) -> None:
    environ = srun_task(1, gpus=None)
    with stock_env(environ), pytest.raises(FileNotFoundError, match="nvidia-smi"):
        StockResolver()

    # tfdist runs no subprocess at all; TensorFlow counts the GPUs later (tfdist.init).
    with stock_env(environ), mock.patch("subprocess.Popen", side_effect=AssertionError):
        resolver = SlurmClusterResolver()
        assert workers(resolver) == [f"n1:{P}", f"n1:{P + 1}", f"n2:{P}", f"n2:{P + 1}"]
        assert resolver.num_accelerators() == {}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert select_gpus(None, 1, 2, False) is None


@pytest.mark.parametrize("how", ["CUDA_VISIBLE_DEVICES=''", "gpus_per_node=0"])
def test_defect_2_cpu_only_step(stock_env: Any, how: str) -> None:
    environ = srun_task(0, gpus="" if how.startswith("CUDA") else "0,1")
    kwargs = {"gpus_per_node": 0} if how == "gpus_per_node=0" else {}
    with pytest.raises(ValueError, match="range\\(\\) arg 3 must not be zero"):
        stock_cluster(environ, stock_env, **kwargs)

    resolver = SlurmClusterResolver(environ=srun_task(0, gpus=""))
    assert resolver.num_accelerators() == {}
    assert workers(resolver)[0] == f"n1:{P}"
    assert resolver.master() == f"grpc://n1:{P}"
    assert select_gpus("", 0, 2, False) == ""
    assert select_gpus("NoDevFiles", 1, 2, False) == ""


def test_defect_3_gpus_bound_per_task(stock_env: Any) -> None:
    # srun --ntasks-per-node=2 --gpus-per-task=1: each task sees only its own GPU.
    environ = srun_task(1, gpus="1", SLURM_GPUS_PER_TASK="1")
    with pytest.raises(ValueError, match="range\\(\\) arg 3 must not be zero"):
        stock_cluster(environ, stock_env)
    with stock_env(environ), pytest.raises(RuntimeError, match="more GPUs per node than"):
        StockResolver(gpus_per_task=1)

    resolver = SlurmClusterResolver(environ=environ)
    assert resolver.num_accelerators() == {"GPU": 1}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert select_gpus("1", 1, 2, True) == "1"
    assert select_gpus("1", 0, 2, True) == "1"
    assert select_gpus("4,5", 0, 2, True) == "4,5"  # --gpus-per-task=2


def test_defect_4_hosts_in_slurm_order_not_string_sorted(stock_env: Any) -> None:
    environ = srun_task(0, nodes="n[9-10]", tasks_per_node="1(x2)", ntasks=2, gpus="0",
                        SLURM_NODEID="0")
    stock = stock_cluster(environ, stock_env)
    # Rank 0 runs on n9 (SLURM_NODEID=0) but the stock resolver tells it it is n10.
    assert stock["spec"] == {"worker": ["n10:8888", "n9:8888"]}
    assert stock["master"] == "grpc://n10:8888"

    resolver = SlurmClusterResolver(environ=environ)
    assert resolver.cluster_spec().as_dict() == {"worker": [f"n9:{P}", f"n10:{P}"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    assert resolver.master() == f"grpc://n9:{P}"
    assert resolver.master(task_id=1, rpc_layer="grpc+verbs") == f"grpc+verbs://n10:{P}"


@pytest.mark.parametrize(("rank", "stock_gpu", "tfdist_gpu"), [(0, "0", "2"), (1, "1", "3")])
def test_defect_5_physical_gpu_ids_kept(stock_env: Any, rank: int, stock_gpu: str,
                                        tfdist_gpu: str) -> None:
    environ = srun_task(rank, gpus="2,3")
    assert stock_cluster(environ, stock_env)["CUDA_VISIBLE_DEVICES"] == stock_gpu

    env = detect(environ)
    assert select_gpus(env.visible_devices, env.local_rank, env.local_world_size,
                       False) == tfdist_gpu
    with stock_env(environ):
        resolver = SlurmClusterResolver()
        resolver.cluster_spec()
        assert resolver.num_accelerators() == {"GPU": 1}
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.parametrize(("nodes", "hosts"), [
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
])
def test_defect_6_every_slurm_hostlist_form(stock_env: Any, nodes: str,
                                            hosts: list[str]) -> None:
    environ = srun_task(0, nodes=nodes, tasks_per_node=f"1(x{len(hosts)})", ntasks=len(hosts),
                        gpus="0")
    with stock_env(environ), pytest.raises(ValueError, match="Invalid hostlist format"):
        StockResolver()

    resolver = SlurmClusterResolver(environ=environ)
    assert workers(resolver) == [f"{host}:{P}" for host in hosts]
    assert resolver.environment_info.hosts == tuple(hosts)


def test_defect_7_batch_shell_says_use_srun(stock_env: Any) -> None:
    # sbatch -N2 --ntasks-per-node=2: the batch script has the job's variables, no step's.
    environ = {"SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
               "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0",
               "CUDA_VISIBLE_DEVICES": "0,1"}
    with stock_env(environ), pytest.raises(RuntimeError, match="Not running inside a SLURM step"):
        StockResolver()

    with pytest.raises(LaunchError, match="srun") as raised:
        SlurmClusterResolver(environ=environ)
    assert "only this one process would train" in str(raised.value)
    # A one-task job's batch shell, or no Slurm at all, is not an srun step either.
    for outside in ({"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "1"}, {}):
        with pytest.raises(LaunchError, match="srun python"):
            SlurmClusterResolver(environ=outside)
    # The message names what is missing: here the job itself, not the step's rank.
    with pytest.raises(LaunchError, match=r"\(SLURM_JOB_ID is not set\)"):
        SlurmClusterResolver(environ={"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})


def test_defect_8_two_jobs_on_one_node_get_different_ports(stock_env: Any) -> None:
    # Two 2-task jobs share node n1.
    jobs = [srun_task(0, nodes="n1", tasks_per_node="2", ntasks=2, job=job)
            for job in ("1000", "1001")]
    stock = [stock_cluster(environ, stock_env)["spec"] for environ in jobs]
    assert stock[0] == stock[1] == {"worker": ["n1:8888", "n1:8889"]}  # they collide

    first, second = (set(workers(SlurmClusterResolver(environ=environ))) for environ in jobs)
    assert len(first) == len(second) == 2
    assert not first & second
    assert all(20000 <= int(address.split(":")[1]) < 32768 for address in first | second)
    pinned = SlurmClusterResolver(environ={**jobs[0], "TFDIST_PORT_BASE": "45000"})
    assert workers(pinned) == ["n1:45000", "n1:45001"]


def test_defect_9_cyclic_distribution_and_interface_names(stock_env: Any) -> None:
    # srun -N2 -n4 --distribution=cyclic: rank 1 runs on n2 (SLURM_NODEID=1).
    environ = srun_task(1, SLURM_DISTRIBUTION="cyclic", SLURM_NODEID="1", SLURM_LOCALID="0",
                        SLURM_GTIDS="1,3", TFDIST_HOST_TEMPLATE="{host}-ib0")
    stock = stock_cluster(environ, stock_env)
    assert stock["spec"]["worker"][1] == "n1:8889"  # block layout: rank 1 sent to n1
    assert all("-ib0" not in address for address in stock["spec"]["worker"])

    resolver = SlurmClusterResolver(environ=environ)
    assert resolver.cluster_spec().as_dict() == {"worker": [
        f"n1-ib0:{P}", f"n2-ib0:{P}", f"n1-ib0:{P + 1}", f"n2-ib0:{P + 1}"]}
    assert resolver.master() == f"grpc://n2-ib0:{P}"
    assert resolver.environment_info.hosts == ("n1", "n2")
    assert resolver.num_accelerators() == {"GPU": 1}


# --- GPU selection and the resolver's contract ----------------------------------------------

SELECT_GPUS = {
    "unset: TensorFlow counts them": ((None, 0, 2, False), None),
    "CPU-only step": (("", 0, 2, False), ""),
    "Slurm without GPUs": (("NoDevFiles", 0, 1, False), ""),
    "one task takes all": (("0,1", 0, 1, False), "0,1"),
    "shared node, first task": (("0,1", 0, 2, False), "0"),
    "physical ids kept": (("2,3", 1, 2, False), "3"),
    "two GPUs per task": (("0,1,2,3", 1, 2, False), "2,3"),
    "bound per task by Slurm": (("1", 0, 2, True), "1"),
    "one visible GPU counts as bound": (("5", 1, 2, False), "5"),
    "spaces ignored": ((" 2, 3 ", 1, 2, False), "3"),
}


@pytest.mark.parametrize(("args", "chosen"), SELECT_GPUS.values(), ids=SELECT_GPUS.keys())
def test_select_gpus(args: tuple[Any, ...], chosen: str | None) -> None:
    assert select_gpus(*args) == chosen


@pytest.mark.parametrize("visible", ["0,1,2", "0,1,2,3,4"])
def test_select_gpus_rejects_uneven_shares(visible: str) -> None:
    with pytest.raises(ConfigError, match="--gpus-per-task=1"):
        select_gpus(visible, 0, 2, False)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        SlurmClusterResolver(environ=srun_task(0, gpus=visible))


def test_resolver_never_modifies_os_environ(stock_env: Any) -> None:
    environ = srun_task(3, gpus="2,3", SLURM_NODEID="1", SLURM_LOCALID="1")
    with stock_env(environ):
        before = dict(os.environ)
        resolver = SlurmClusterResolver()
        resolver.cluster_spec()
        resolver.master()
        resolver.num_accelerators()
        assert dict(os.environ) == before


def test_resolver_takes_a_detected_environment_and_explicit_gpu_count() -> None:
    env = detect(srun_task(2))
    resolver = SlurmClusterResolver(env, num_gpus=2, rpc_layer="")
    assert resolver.environment_info is env
    assert resolver.task_id == 2
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.master() == f"n2:{P}"
    assert resolver.environment == ""
    # As TensorFlow's resolvers: a job or task the cluster does not have is a ValueError.
    with pytest.raises(ValueError, match="ps"):
        resolver.master("ps")
    with pytest.raises(ValueError, match="9"):
        resolver.master(task_id=9)
    with pytest.raises(LaunchError):
        SlurmClusterResolver(detect({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
                                                  '"task": {"type": "worker", "index": 0}}'}))
