"""Launcher detection: environment variables in, a ClusterEnvironment out.

Every table row is what a launcher really puts in a process's environment (Slurm's as measured
on the test cluster of tests/slurm/, whose jobs in test_slurm_cluster.py check it) and what
tfdist must make of it. Rows run twice: with the dict passed to ``detect`` and with
``os.environ`` patched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any
from unittest import mock

import pytest

from tfdist.env import ClusterEnvironment, detect, slurm
from tfdist.errors import ConfigError, LaunchError

JOB = "4242"
# The first port of job 4242's step 0 block; the port tests below pin down its properties.
P = slurm.port_base({"SLURM_JOB_ID": JOB, "SLURM_STEP_ID": "0"}, 2)


def srun_task(procid: int, localid: int, nodeid: int, gtids: str, *,
              nodelist: str = "n[1-2]", tasks_per_node: str = "2(x2)", ntasks: int = 4,
              **extra: str) -> dict[str, str]:
    """One task of `srun -N2 --ntasks-per-node=2 --gpus-per-node=2`, as the facts list it."""
    return {
        "SLURM_JOB_ID": JOB, "SLURM_JOBID": JOB, "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid), "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks), "SLURM_GTIDS": gtids,
        "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2", "SLURM_STEP_GPUS": "0,1",
        **extra,
    }


def slurm_rank(rank: int, local_rank: int, node_rank: int, addresses: tuple[str, ...], *,
               hosts: tuple[str, ...] = ("n1", "n2"), local_world_size: int = 2,
               world_size: int = 4) -> dict[str, Any]:
    return {"launcher": "slurm", "rank": rank, "local_rank": local_rank, "node_rank": node_rank,
            "world_size": world_size, "local_world_size": local_world_size,
            "num_nodes": len(hosts), "hosts": hosts, "worker_addresses": addresses,
            "coordinator": addresses[0], "job_id": JOB}


BLOCK = (f"n1:{P}", f"n1:{P + 1}", f"n2:{P}", f"n2:{P + 1}")
CYCLIC = (f"n1:{P}", f"n2:{P}", f"n1:{P + 1}", f"n2:{P + 1}")
# plane=2 on 2 nodes with 4 tasks each: ranks 0,1 -> n1; 2,3 -> n2; 4,5 -> n1; 6,7 -> n2.
PLANE = (f"n1:{P}", f"n1:{P + 1}", f"n2:{P}", f"n2:{P + 1}",
         f"n1:{P + 2}", f"n1:{P + 3}", f"n2:{P + 2}", f"n2:{P + 3}")


def tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


TORCHRUN = {"TORCHELASTIC_RUN_ID": "run1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "n1",
            "MASTER_PORT": "29500"}
HOROVOD_GLOO = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0",
                "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000",
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "1"}
MPICH_HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
               "PMI_FD": "5"}
# mpirun inside an allocation starts its daemons (orted) with one srun task per node: that
# step's SLURM_PROCID counts nodes, not the MPI processes.
ORTED_STEP = {"SLURM_JOB_ID": JOB, "SLURM_STEP_ID": "1", "SLURM_PROCID": "1",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}

DETECTED: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    # srun -N2 --ntasks-per-node=2 --gpus-per-node=2: each of the four tasks.
    "srun rank 0": (srun_task(0, 0, 0, "0,1"), slurm_rank(0, 0, 0, BLOCK)),
    "srun rank 1": (srun_task(1, 1, 0, "0,1"), slurm_rank(1, 1, 0, BLOCK)),
    "srun rank 2": (srun_task(2, 0, 1, "2,3"), slurm_rank(2, 0, 1, BLOCK)),
    "srun rank 3": (srun_task(3, 1, 1, "2,3"), {**slurm_rank(3, 1, 1, BLOCK),
                                                "visible_devices": "0,1"}),
    # Node order is Slurm's, never string-sorted: rank 0 is on n9, whichever way it is written.
    "nodes n9,n10": (
        srun_task(0, 0, 0, "0", nodelist="n9,n10", tasks_per_node="1(x2)", ntasks=2),
        slurm_rank(0, 0, 0, (f"n9:{P}", f"n10:{P}"), hosts=("n9", "n10"), local_world_size=1,
                   world_size=2)),
    "nodes n[9-10]": (
        srun_task(1, 0, 1, "1", nodelist="n[9-10]", tasks_per_node="1(x2)", ntasks=2),
        slurm_rank(1, 0, 1, (f"n9:{P}", f"n10:{P}"), hosts=("n9", "n10"), local_world_size=1,
                   world_size=2)),
    # Distributions across nodes.
    "cyclic rank 1 is on the second node": (
        srun_task(1, 0, 1, "1,3", SLURM_DISTRIBUTION="cyclic"), slurm_rank(1, 0, 1, CYCLIC)),
    "cyclic rank 2 is back on the first node": (
        srun_task(2, 1, 0, "0,2", SLURM_DISTRIBUTION="cyclic"), slurm_rank(2, 1, 0, CYCLIC)),
    "block:cyclic is block across nodes": (
        srun_task(1, 1, 0, "0,1", SLURM_DISTRIBUTION="block:cyclic"),
        slurm_rank(1, 1, 0, BLOCK)),
    "cyclic with the nopack flag": (
        srun_task(3, 1, 1, "1,3", SLURM_DISTRIBUTION="cyclic,nopack"),
        slurm_rank(3, 1, 1, CYCLIC)),
    # srun -m pack / nopack (and CR_Pack_Nodes clusters) export the flag alone: block order.
    "pack alone is block across nodes": (
        srun_task(2, 0, 1, "2,3", SLURM_DISTRIBUTION="pack"), slurm_rank(2, 0, 1, BLOCK)),
    "nopack alone is block across nodes": (
        srun_task(1, 1, 0, "0,1", SLURM_DISTRIBUTION="nopack"), slurm_rank(1, 1, 0, BLOCK)),
    "a single-node step needs no tasks-per-node variable": (
        {k: v for k, v in srun_task(0, 0, 0, "0,1", nodelist="n1", tasks_per_node="2",
                                    ntasks=2).items() if k != "SLURM_STEP_TASKS_PER_NODE"},
        slurm_rank(0, 0, 0, (f"n1:{P}", f"n1:{P + 1}"), hosts=("n1",), world_size=2)),
    # srun -m plane=2 exports SLURM_DISTRIBUTION=plane and SLURM_DIST_PLANESIZE=2.
    "plane as srun exports it": (
        srun_task(4, 2, 0, "0,1,4,5", tasks_per_node="4(x2)", ntasks=8,
                  SLURM_DISTRIBUTION="plane", SLURM_DIST_PLANESIZE="2"),
        slurm_rank(4, 2, 0, PLANE, local_world_size=4, world_size=8)),
    "plane=2 written in one variable": (
        srun_task(2, 0, 1, "2,3,6,7", tasks_per_node="4(x2)", ntasks=8,
                  SLURM_DISTRIBUTION="plane=2"),
        slurm_rank(2, 0, 1, PLANE, local_world_size=4, world_size=8)),
    # Uneven tasks per node: 2 on n1, 1 on n2.
    "uneven 2,1 rank 1": (
        srun_task(1, 1, 0, "0,1", tasks_per_node="2,1", ntasks=3),
        slurm_rank(1, 1, 0, BLOCK[:3], world_size=3)),
    "uneven 2,1 rank 2": (
        srun_task(2, 0, 1, "2", tasks_per_node="2,1", ntasks=3),
        slurm_rank(2, 0, 1, BLOCK[:3], local_world_size=1, world_size=3)),
    "InfiniBand names through TFDIST_HOST_TEMPLATE": (
        srun_task(2, 0, 1, "2,3", TFDIST_HOST_TEMPLATE="{host}-ib0"),
        slurm_rank(2, 0, 1, tuple(a.replace(":", "-ib0:") for a in BLOCK))),
    "TFDIST_PORT_BASE overrides the derived ports": (
        srun_task(3, 1, 1, "2,3", TFDIST_PORT_BASE="30000"),
        slurm_rank(3, 1, 1, ("n1:30000", "n1:30001", "n2:30000", "n2:30001"))),
    # srun --mpi=pmix adds PMIX_* variables but none of mpirun's: still a Slurm step.
    "srun --mpi=pmix": (srun_task(1, 1, 0, "0,1", PMIX_RANK="1", PMIX_NAMESPACE="slurm.pmix"),
                        slurm_rank(1, 1, 0, BLOCK)),
    "srun --mpi=pmi2 (PMI_RANK without hydra's MPI_LOCALRANKID)": (
        srun_task(2, 0, 1, "2,3", PMI_RANK="2", PMI_SIZE="4", PMI_FD="7"),
        slurm_rank(2, 0, 1, BLOCK)),
    "batch shell of a one-task job": (
        {"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1",
         "SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "0", "CUDA_VISIBLE_DEVICES": "0"},
        {"launcher": "single", "rank": 0, "world_size": 1, "job_id": JOB,
         "visible_devices": "0"}),
    "batch shell of a job that gave no task count": (
        {"SLURM_JOB_ID": JOB, "SLURM_JOB_NODELIST": "n1"},
        {"launcher": "single", "world_size": 1, "job_id": JOB}),
    # TF_CONFIG.
    "TF_CONFIG worker-only": (
        {"TF_CONFIG": tf_config({"worker": ["a:1000", "b:1001"]}, "worker", 1)},
        {"launcher": "tf_config", "rank": 1, "world_size": 2, "local_rank": 0,
         "local_world_size": 1, "node_rank": 1, "num_nodes": 2, "hosts": ("a", "b"),
         "worker_addresses": ("a:1000", "b:1001"), "coordinator": "a:1000", "job_id": None}),
    "TF_CONFIG chief is rank 0": (
        {"TF_CONFIG": tf_config({"chief": ["c:1"], "worker": ["w:2", "w:3"]}, "chief", 0)},
        {"launcher": "tf_config", "rank": 0, "world_size": 3,
         "worker_addresses": ("c:1", "w:2", "w:3"), "coordinator": "c:1"}),
    "TF_CONFIG workers are numbered after the chief": (
        {"TF_CONFIG": tf_config({"worker": ["w:2", "w:3"], "chief": ["c:1"]}, "worker", 1)},
        {"launcher": "tf_config", "rank": 2, "world_size": 3, "hosts": ("c", "w"),
         "node_rank": 1, "local_rank": 1, "local_world_size": 2}),
    "TF_CONFIG two workers on h1, first": (
        {"TF_CONFIG": tf_config({"worker": ["h1:1", "h1:2", "h2:1"]}, "worker", 0)},
        {"rank": 0, "local_rank": 0, "local_world_size": 2, "node_rank": 0, "num_nodes": 2}),
    "TF_CONFIG two workers on h1, second": (
        {"TF_CONFIG": tf_config({"worker": ["h1:1", "h1:2", "h2:1"]}, "worker", 1)},
        {"rank": 1, "local_rank": 1, "local_world_size": 2, "node_rank": 0, "num_nodes": 2}),
    "TF_CONFIG the worker alone on h2": (
        {"TF_CONFIG": tf_config({"worker": ["h1:1", "h1:2", "h2:1"]}, "worker", 2)},
        {"rank": 2, "local_rank": 0, "local_world_size": 1, "node_rank": 1,
         "hosts": ("h1", "h2")}),
    "tfdist launch (TFDIST_LAUNCHER=local)": (
        {"TF_CONFIG": tf_config({"worker": ["localhost:5000", "localhost:5001"]}, "worker", 1),
         "TFDIST_LAUNCHER": "local", "TFDIST_LOCAL_RANK": "1", "TFDIST_LOCAL_WORLD_SIZE": "2"},
        {"launcher": "local", "rank": 1, "world_size": 2, "local_rank": 1,
         "local_world_size": 2, "hosts": ("localhost",)}),
    # torchrun, horovodrun, mpirun.
    "torchrun": (
        TORCHRUN,
        {"launcher": "torchrun", "rank": 3, "world_size": 4, "local_rank": 1,
         "local_world_size": 2, "node_rank": 1, "num_nodes": 2, "coordinator": "n1:29500",
         "worker_addresses": ()}),
    "horovodrun (gloo)": (
        HOROVOD_GLOO,
        {"launcher": "horovodrun", "rank": 2, "world_size": 4, "local_rank": 0,
         "local_world_size": 2, "node_rank": 1, "num_nodes": 2,
         "coordinator": "10.0.0.1:4000"}),
    "mpirun (Open MPI)": (
        OPEN_MPI,
        {"launcher": "mpirun", "rank": 3, "world_size": 4, "local_rank": 1,
         "local_world_size": 2, "node_rank": 1, "num_nodes": 2, "coordinator": None}),
    "mpirun (MPICH hydra)": (
        MPICH_HYDRA,
        {"launcher": "mpirun", "rank": 3, "world_size": 4, "local_rank": 1,
         "local_world_size": 2, "node_rank": 1, "num_nodes": 2}),
    # The order (tfdist/env/__init__.py): inner launchers describe the process better.
    "TF_CONFIG inside an srun step wins": (
        {**srun_task(3, 1, 1, "2,3"),
         "TF_CONFIG": tf_config({"worker": ["n1:7000", "n2:7000"]}, "worker", 0)},
        {"launcher": "tf_config", "rank": 0, "world_size": 2, "job_id": JOB}),
    "TF_CONFIG per srun task, its index following SLURM_PROCID": (
        {**srun_task(3, 1, 1, "2,3"),
         "TF_CONFIG": tf_config({"worker": ["n1:7000", "n1:7001", "n2:7000", "n2:7001"]},
                                "worker", 3)},
        {"launcher": "tf_config", "rank": 3, "world_size": 4, "local_rank": 1}),
    "tfdist launch inside a one-task srun step": (
        {**srun_task(0, 0, 0, "0", tasks_per_node="1", ntasks=1, nodelist="n1"),
         "TFDIST_LAUNCHER": "local", "TFDIST_LOCAL_RANK": "1",
         "TF_CONFIG": tf_config({"worker": ["127.0.0.1:7000", "127.0.0.1:7001"]}, "worker", 1)},
        {"launcher": "local", "rank": 1, "world_size": 2, "local_rank": 1}),
    "torchrun inside srun wins over slurm": (
        {**srun_task(1, 0, 1, "1", tasks_per_node="1(x2)", ntasks=2), **TORCHRUN},
        {"launcher": "torchrun", "rank": 3, "world_size": 4, "job_id": JOB}),
    "mpirun inside an allocation, under orted's srun step, wins over slurm": (
        {**ORTED_STEP, **OPEN_MPI},
        {"launcher": "mpirun", "rank": 3, "world_size": 4, "node_rank": 1, "job_id": JOB}),
    "horovodrun over mpirun is horovodrun": (
        {**OPEN_MPI, **HOROVOD_GLOO}, {"launcher": "horovodrun", "rank": 2}),
    "nothing set": (
        {}, {"launcher": "single", "rank": 0, "world_size": 1, "local_rank": 0, "node_rank": 0,
             "hosts": (), "worker_addresses": (), "coordinator": None, "job_id": None,
             "visible_devices": None}),
    "nothing but CUDA_VISIBLE_DEVICES": (
        {"CUDA_VISIBLE_DEVICES": "1"}, {"launcher": "single", "visible_devices": "1"}),
    # What the backends need from the launch, carried so that nothing reads it again.
    "srun step: its id, no GPU binding, no MPI plugin": (
        srun_task(0, 0, 0, "0,1"),
        {"step_id": "0", "gpus_per_task": None, "mpi_plugin": None, "launched_for": None,
         "master_addr": None, "master_port": None}),
    "srun --gpus-per-task=1": (
        srun_task(1, 1, 0, "0,1", SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="1"),
        {"gpus_per_task": 1, "visible_devices": "1"}),
    "srun --gpus-per-task=a100:2": (
        srun_task(1, 1, 0, "0,1", SLURM_GPUS_PER_TASK="a100:2"), {"gpus_per_task": 2}),
    "the job around the step, for tfdist doctor's shape checks": (
        srun_task(0, 0, 0, "0,1", SLURM_JOB_NUM_NODES="4", SLURM_NTASKS_PER_NODE="2",
                  SLURM_STEP_GPUS="2,3"),
        {"job_nodes": 4, "job_tasks_per_node": 2, "slurm_gpus": "2,3"}),
    "a per-node count Slurm writes as 2(x2) is not read as one; the step's GPUs win": (
        srun_task(0, 0, 0, "0,1", SLURM_NTASKS_PER_NODE="2(x2)", SLURM_JOB_GPUS="0-3"),
        {"job_tasks_per_node": None, "slurm_gpus": "0,1"}),
    "srun --mpi=pmix: the plugin": (
        srun_task(0, 0, 0, "0,1", PMIX_RANK="0"), {"mpi_plugin": "pmix"}),
    "srun --mpi=pmi2": (srun_task(0, 0, 0, "0,1", PMI_RANK="0"), {"mpi_plugin": "pmi2"}),
    "a requeued array task": (
        srun_task(0, 0, 0, "0,1", SLURM_RESTART_COUNT="2", SLURM_ARRAY_JOB_ID="4240",
                  SLURM_ARRAY_TASK_ID="2"),
        {"restart_count": 2, "array_job_id": "4240", "array_task_id": "2", "job_id": JOB}),
    "a job script's MASTER_ADDR and MASTER_PORT": (
        srun_task(2, 0, 1, "2,3", MASTER_ADDR="head", MASTER_PORT="29400"),
        {"master_addr": "head", "master_port": 29400, "coordinator": f"n1:{P}"}),
    "mpirun with MASTER_ADDR only": (
        {**OPEN_MPI, "MASTER_ADDR": "n1"}, {"master_addr": "n1", "master_port": None}),
    "tfdist launch (MWMS workers)": (
        {"TF_CONFIG": tf_config({"worker": ["localhost:5000", "localhost:5001"]}, "worker", 0),
         "TFDIST_LAUNCHER": "local"}, {"launcher": "local", "launched_for": "mwms"}),
    "tfdist launch --backend horovod": (
        {**HOROVOD_GLOO, "TFDIST_LAUNCHER": "local"},
        {"launcher": "local", "launched_for": "horovod", "rank": 2}),
}


def _fields(found: ClusterEnvironment, expected: Mapping[str, Any]) -> dict[str, Any]:
    return {name: getattr(found, name) for name in expected}


@pytest.mark.parametrize(("environ", "expected"), DETECTED.values(), ids=DETECTED.keys())
def test_detect_from_argument(environ: dict[str, str], expected: dict[str, Any]) -> None:
    assert _fields(detect(environ), expected) == expected


@pytest.mark.parametrize(("environ", "expected"), DETECTED.values(), ids=DETECTED.keys())
def test_detect_reads_os_environ_by_default(environ: dict[str, str],
                                            expected: dict[str, Any]) -> None:
    with mock.patch.dict(os.environ, environ, clear=True):
        found = detect()
    assert _fields(found, expected) == expected


def test_every_srun_task_derives_the_same_table() -> None:
    """The four tasks of one step agree on hosts and addresses, and on who is where."""
    tasks = [srun_task(0, 0, 0, "0,1"), srun_task(1, 1, 0, "0,1"),
             srun_task(2, 0, 1, "2,3"), srun_task(3, 1, 1, "2,3")]
    found = [detect(task) for task in tasks]
    assert {(env.hosts, env.worker_addresses) for env in found} == {(("n1", "n2"), BLOCK)}
    assert [env.worker_addresses[env.rank].split(":")[0] for env in found] == [
        "n1", "n1", "n2", "n2"]
    assert [env.is_chief for env in found] == [True, False, False, False]
    assert len(set(BLOCK)) == 4


RAISES: dict[str, tuple[dict[str, str], type[Exception], str]] = {
    "batch shell of a 4-task job": (
        {"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"},
        LaunchError, "srun"),
    "batch shell with SLURM_PROCID but no step": (
        {"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, LaunchError, "srun"),
    "batch shell of a one-task job on two nodes": (
        {"SLURM_JOB_ID": JOB, "SLURM_JOB_NUM_NODES": "2"}, LaunchError, "srun"),
    "SLURM_NODEID contradicts the block layout": (
        srun_task(1, 1, 1, "0,1"), LaunchError, "SLURM_NODEID"),
    "SLURM_LOCALID contradicts the block layout": (
        srun_task(1, 0, 0, "0,1"), LaunchError, "SLURM_LOCALID"),
    "SLURM_GTIDS show a cyclic layout but SLURM_DISTRIBUTION is unset": (
        srun_task(0, 0, 0, "0,2"), LaunchError, "SLURM_GTIDS"),
    "step variables disagree on the number of tasks": (
        srun_task(0, 0, 0, "0,1", ntasks=5), LaunchError, "disagree"),
    "step variables disagree on the number of nodes": (
        srun_task(0, 0, 0, "0,1", nodelist="n[1-3]"), LaunchError, "disagree"),
    "an srun step without a node list": (
        {k: v for k, v in srun_task(0, 0, 0, "0,1").items() if "NODELIST" not in k},
        LaunchError, "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set"),
    "a two-node step without SLURM_STEP_TASKS_PER_NODE": (
        {k: v for k, v in srun_task(0, 0, 0, "0,1").items()
         if k != "SLURM_STEP_TASKS_PER_NODE"},
        LaunchError, "SLURM_STEP_TASKS_PER_NODE is not set, and the step has 2 nodes"),
    "SLURM_DISTRIBUTION=arbitrary": (
        srun_task(0, 0, 0, "0,1", SLURM_DISTRIBUTION="arbitrary"), LaunchError, "arbitrary"),
    "plane without SLURM_DIST_PLANESIZE": (
        srun_task(0, 0, 0, "0,1", SLURM_DISTRIBUTION="plane"), ConfigError,
        "SLURM_DIST_PLANESIZE"),
    "plane size 0": (
        srun_task(0, 0, 0, "0,1", SLURM_DISTRIBUTION="plane", SLURM_DIST_PLANESIZE="0"),
        LaunchError, "plane size"),
    "SLURM_PROCID beyond the step's tasks": (
        srun_task(0, 0, 0, "0,1", SLURM_PROCID="4"), LaunchError, "SLURM_PROCID=4"),
    "negative SLURM_PROCID": (
        srun_task(0, 0, 0, "0,1", SLURM_PROCID="-1"), LaunchError, "SLURM_PROCID=-1"),
    "malformed SLURM_PROCID": (srun_task(0, 0, 0, "0,1", SLURM_PROCID="abc"), ConfigError,
                               "SLURM_PROCID='abc'"),
    "malformed SLURM_STEP_NUM_TASKS": (
        srun_task(0, 0, 0, "0,1", SLURM_STEP_NUM_TASKS="four"), ConfigError,
        "SLURM_STEP_NUM_TASKS"),
    "malformed SLURM_NTASKS in the batch shell": (
        {"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "4x"}, ConfigError, "SLURM_NTASKS"),
    "malformed hostlist": (srun_task(0, 0, 0, "0,1", nodelist="n[1-2"), ConfigError, "n[1-2"),
    "malformed tasks per node": (srun_task(0, 0, 0, "0,1", tasks_per_node="2(x2"), ConfigError,
                                 "2(x2"),
    "TFDIST_HOST_TEMPLATE without {host}": (
        srun_task(0, 0, 0, "0,1", TFDIST_HOST_TEMPLATE="ib0"), ConfigError,
        "TFDIST_HOST_TEMPLATE"),
    "SLURM_GPUS_PER_TASK not a count": (
        srun_task(0, 0, 0, "0,1", SLURM_GPUS_PER_TASK="many"), ConfigError,
        "SLURM_GPUS_PER_TASK='many'"),
    "MASTER_PORT not a number": (
        srun_task(0, 0, 0, "0,1", MASTER_PORT="auto"), ConfigError, "MASTER_PORT"),
    "TFDIST_PORT_BASE not a number": (
        srun_task(0, 0, 0, "0,1", TFDIST_PORT_BASE="high"), ConfigError, "TFDIST_PORT_BASE"),
    "TFDIST_PORT_BASE privileged": (
        srun_task(0, 0, 0, "0,1", TFDIST_PORT_BASE="80"), ConfigError, "TFDIST_PORT_BASE"),
    "TFDIST_PORT_BASE leaves no room for 2 ports": (
        srun_task(0, 0, 0, "0,1", TFDIST_PORT_BASE="65535"), ConfigError, "TFDIST_PORT_BASE"),
    "more tasks on a node than a derived port block holds": (
        srun_task(0, 0, 0, ",".join(map(str, range(33))), tasks_per_node="33", ntasks=33,
                  nodelist="n1"),
        ConfigError, "TFDIST_PORT_BASE"),
    "TF_CONFIG exported in the batch script, inherited by every srun task": (
        {**srun_task(3, 1, 1, "2,3"),
         "TF_CONFIG": tf_config({"worker": ["n1:7000", "n1:7001", "n2:7000", "n2:7001"]},
                                "worker", 0)},
        LaunchError, "unset TF_CONFIG"),
    "TF_CONFIG not JSON": ({"TF_CONFIG": "{cluster: "}, ConfigError, "TF_CONFIG"),
    "TF_CONFIG without a task": (
        {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})}, ConfigError, "TF_CONFIG"),
    "TF_CONFIG parameter server task": (
        {"TF_CONFIG": tf_config({"worker": ["a:1"], "ps": ["b:2"]}, "ps", 0)}, ConfigError,
        "'ps'"),
    "TF_CONFIG evaluator in the cluster": (
        {"TF_CONFIG": tf_config({"worker": ["a:1"], "evaluator": ["b:2"]}, "worker", 0)},
        ConfigError, "evaluator"),
    "TF_CONFIG index out of range": (
        {"TF_CONFIG": tf_config({"worker": ["a:1", "b:1"]}, "worker", 2)}, ConfigError,
        "worker:2"),
    "TF_CONFIG negative index": (
        {"TF_CONFIG": tf_config({"worker": ["a:1", "b:1"]}, "worker", -1)}, ConfigError,
        "worker:-1"),
    "torchrun malformed RANK": ({**TORCHRUN, "RANK": "x"}, ConfigError, "RANK='x'"),
    "torchrun without WORLD_SIZE": (
        {k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, ConfigError, "WORLD_SIZE"),
    "Open MPI malformed size": ({**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "4.0"}, ConfigError,
                                "OMPI_COMM_WORLD_SIZE"),
}


@pytest.mark.parametrize(("environ", "error", "message"), RAISES.values(), ids=RAISES.keys())
def test_detect_raises(environ: dict[str, str], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        detect(environ)
    assert message in str(raised.value)


def test_batch_shell_error_says_how_to_fix_it() -> None:
    batch_shell = {"SLURM_JOB_ID": JOB, "SLURM_NTASKS": "4"}
    with mock.patch.dict(os.environ, batch_shell, clear=True), pytest.raises(LaunchError) as raised:
        detect()
    message = str(raised.value)
    assert "srun python" in message and JOB in message and "4 tasks" in message


# --- ports ------------------------------------------------------------------------------

def _base(job: int, step: int = 0, tasks_on_node: int = 2) -> int:
    return slurm.port_base({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)},
                           tasks_on_node)


@pytest.mark.parametrize("job", [1, 4242, 398, 399, 123456789])
def test_consecutive_jobs_get_disjoint_port_blocks(job: int) -> None:
    first, second = _base(job), _base(job + 1)
    assert abs(first - second) >= slurm.PORT_BLOCK


@pytest.mark.parametrize("job", [1, 4242, 123456789])
def test_each_step_of_a_job_gets_its_own_port_block(job: int) -> None:
    bases = {_base(job, step) for step in range(4)}
    assert len(bases) == 4
    assert min(abs(a - b) for a in bases for b in bases if a != b) >= slurm.PORT_BLOCK


def test_the_step_id_changes_the_addresses() -> None:
    step0 = detect(srun_task(0, 0, 0, "0,1"))
    step1 = detect(srun_task(0, 0, 0, "0,1", SLURM_STEP_ID="1"))
    assert step0.worker_addresses != step1.worker_addresses
    assert step0.hosts == step1.hosts


def test_derived_ports_stay_below_the_ephemeral_range() -> None:
    slots = (slurm.PORT_RANGE[1] - slurm.PORT_RANGE[0]) // slurm.PORT_BLOCK
    low, high = slurm.PORT_RANGE
    assert high == 32768
    for job in [*range(2 * slots), 4294967294, 10**9 + 7]:
        for step in (0, 1, 7):
            base = _base(job, step, slurm.PORT_BLOCK)
            # Every port of the block, up to PORT_BLOCK local tasks, is in [20000, 32768).
            assert low <= base and base + slurm.PORT_BLOCK - 1 < high, (job, step, base)


def test_tfdist_port_base_wins_over_the_job_id() -> None:
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "TFDIST_PORT_BASE": "40000"}
    assert slurm.port_base(environ, 4) == 40000
    assert slurm.port_base({**environ, "SLURM_JOB_ID": "8"}, 4) == 40000


# --- purity -----------------------------------------------------------------------------

def test_importing_tfdist_env_imports_no_tensorflow() -> None:
    code = ("import sys, tfdist.env; tfdist.env.detect({}); "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr


def test_detect_caches_nothing() -> None:
    first = detect(srun_task(0, 0, 0, "0,1"))
    second = detect(srun_task(3, 1, 1, "2,3"))
    assert (first.rank, second.rank) == (0, 3)
    with mock.patch.dict(os.environ, {"TF_CONFIG": tf_config({"worker": ["a:1"]}, "worker", 0)},
                         clear=True):
        assert detect().launcher == "tf_config"
    with mock.patch.dict(os.environ, {}, clear=True):
        assert detect().launcher == "single"


def test_detect_does_not_modify_its_input() -> None:
    environ = srun_task(2, 0, 1, "2,3")
    before = dict(environ)
    detect(environ)
    assert environ == before


def test_cluster_environment_is_frozen() -> None:
    found = detect({})
    with pytest.raises(AttributeError):
        found.rank = 1  # type: ignore[misc]
