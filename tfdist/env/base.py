"""The one interface every launcher's detection returns."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tfdist.env.launchers import Launcher, launcher
from tfdist.errors import ConfigError

__all__ = ["ClusterEnvironment", "common", "get_int", "local_ranks"]


@dataclass(frozen=True)
class ClusterEnvironment:
    """How this process was launched, read from environment variables only.

    Attributes:
        launcher: ``"slurm"``, ``"tf_config"``, ``"local"`` (``tfdist launch``), ``"torchrun"``,
            ``"mpirun"``, ``"horovodrun"`` or ``"single"``.
        rank: this process's index among all processes, 0-based; rank 0 is the chief.
        world_size: number of processes.
        local_rank: index among the processes on this node (selects the GPU).
        local_world_size: number of processes on this node.
        node_rank: index of this node among ``hosts``.
        num_nodes: number of nodes.
        hosts: node names in the launcher's order (Slurm's node order, never sorted); empty
            when the launcher does not say.
        worker_addresses: ``host:port`` of every rank, in rank order, for TensorFlow's gRPC
            collectives; empty when the launcher does not provide one per rank.
        coordinator: ``host:port`` where the launch's ranks meet: rank 0's worker address
            (srun, ``TF_CONFIG``), torchrun's store, horovodrun's Gloo rendezvous; None when the
            launcher gives none (mpirun).
        master_addr: ``MASTER_ADDR`` as exported by a job script or mpirun ``-x``, or None: where
            a torch process group meets when the launcher gives no place of its own.
        master_port: ``MASTER_PORT``, likewise.
        job_id: the scheduler's job id, if any.
        step_id: the Slurm step id, if any.
        gpus_per_task: GPUs Slurm bound to each task (``srun --gpus-per-task``), or None when
            the task sees the node's GPUs.
        mpi_plugin: ``"pmix"`` or ``"pmi2"`` when srun's MPI plugin started the step (``srun
            --mpi=pmix``), so MPI can initialise from Slurm; else None.
        restart_count: how often the scheduler restarted (requeued) this job
            (``SLURM_RESTART_COUNT``), 0 for its first run.
        array_job_id: the job array's id (``SLURM_ARRAY_JOB_ID``), if this job is an array task.
        array_task_id: the array task's index (``SLURM_ARRAY_TASK_ID``).
        launched_for: for ``tfdist launch`` (launcher ``"local"``), the backend its workers were
            set up for: ``"mwms"`` (a ``TF_CONFIG`` each) or ``"horovod"`` (Horovod's Gloo
            variables); None for other launchers.
        visible_devices: this process's ``CUDA_VISIBLE_DEVICES`` as inherited, or None.
        job_nodes: nodes of the Slurm job around the process (``SLURM_JOB_NUM_NODES``), which
            a step may use only some of; None outside Slurm.
        job_tasks_per_node: tasks per node the job asked for (``SLURM_NTASKS_PER_NODE``, set by
            ``sbatch --ntasks-per-node`` and inherited by its steps), or None.
        slurm_gpus: the physical ids of the node's GPUs Slurm gave the step (``SLURM_STEP_GPUS``,
            else ``SLURM_JOB_GPUS``), or None.
        batch_host: the node of the Slurm job's batch script (the first of the job's nodes), or
            None outside a Slurm job.
        step_loop: ``"survive"`` when ``tfdist survive`` started this step
            (``TFDIST_STEP_LOOP``): it decides what follows exit code 75, a preemption's
            requeue included; else None.
        end_time: when this run must end, in seconds since the epoch: ``TFDIST_END_TIME``
            (``tfdist launch --time-limit``), else Slurm's ``SLURM_JOB_END_TIME``; None when
            neither is set (:mod:`tfdist.walltime`).
        end_time_from: the variable ``end_time`` came from, or None.
        reason: which variables decided the detection, for logs and ``tfdist env``.

    What the other rooms must know about the launcher is a column of its row, :attr:`facts`.
    """

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    hosts: tuple[str, ...] = ()
    worker_addresses: tuple[str, ...] = ()
    coordinator: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    step_id: str | None = None
    gpus_per_task: int | None = None
    mpi_plugin: str | None = None
    restart_count: int = 0
    array_job_id: str | None = None
    array_task_id: str | None = None
    launched_for: str | None = None
    visible_devices: str | None = None
    job_nodes: int | None = None
    job_tasks_per_node: int | None = None
    slurm_gpus: str | None = None
    batch_host: str | None = None
    step_loop: str | None = None
    end_time: float | None = None
    end_time_from: str | None = None
    reason: str = ""

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def facts(self) -> Launcher:
        """This launcher's row of the launcher table (:mod:`tfdist.env.launchers`).

        Raises:
            ConfigError: a launcher the table does not have.
        """
        return launcher(self.launcher, self.launched_for)


def local_ranks(owners: Sequence[Hashable]) -> list[int]:
    """Each rank's index among the ranks with the same owner (its node): the local rank.

    ``owners`` holds the node (name or index) of every rank, in rank order; ranks on one node
    are numbered in rank order, whatever the distribution across nodes.
    """
    seen: dict[Hashable, int] = {}
    result = []
    for owner in owners:
        result.append(seen.get(owner, 0))
        seen[owner] = result[-1] + 1
    return result


def common(environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields every launcher's detection reads the same way: the job around the process
    (its ids and restarts), the GPUs it inherited and a ``MASTER_ADDR``/``MASTER_PORT`` a job
    script exported.

    Raises:
        ConfigError: a malformed ``MASTER_PORT`` or ``SLURM_GPUS_PER_TASK``.
    """
    port = environ.get("MASTER_PORT", "").strip()
    return {
        "job_id": environ.get("SLURM_JOB_ID"),
        "step_id": environ.get("SLURM_STEP_ID"),
        "gpus_per_task": _gpus_per_task(environ.get("SLURM_GPUS_PER_TASK")),
        "master_addr": environ.get("MASTER_ADDR") or None,
        "master_port": get_int(environ, "MASTER_PORT") if port else None,
        "visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "restart_count": get_int(environ, "SLURM_RESTART_COUNT", 0),
        "array_job_id": environ.get("SLURM_ARRAY_JOB_ID") or None,
        "array_task_id": environ.get("SLURM_ARRAY_TASK_ID") or None,
        "job_nodes": _optional_int(environ, "SLURM_JOB_NUM_NODES"),
        "job_tasks_per_node": _optional_int(environ, "SLURM_NTASKS_PER_NODE"),
        "slurm_gpus": environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS") or None,
        "batch_host": _first_node(environ.get("SLURM_JOB_NODELIST")),
        "step_loop": environ.get("TFDIST_STEP_LOOP") or None,
        **_end_time(environ),
    }


def _first_node(nodelist: str | None) -> str | None:
    """The first node of a Slurm node list: where Slurm runs the job's batch script."""
    from tfdist.hostlist import expand_hostlist

    return expand_hostlist(nodelist)[0] if nodelist else None


def _end_time(environ: Mapping[str, str]) -> dict[str, Any]:
    """``end_time`` and ``end_time_from``: ``TFDIST_END_TIME`` (set by ``tfdist launch
    --time-limit``) wins over Slurm's ``SLURM_JOB_END_TIME``.

    Raises:
        ConfigError: a ``TFDIST_END_TIME`` that is no number.
    """
    given = environ.get("TFDIST_END_TIME", "").strip()
    if given:
        try:
            return {"end_time": float(given), "end_time_from": "TFDIST_END_TIME"}
        except ValueError:
            raise ConfigError(f"TFDIST_END_TIME={given!r} is no time: seconds since the epoch, "
                              "as `tfdist launch --time-limit` sets it") from None
    slurm = environ.get("SLURM_JOB_END_TIME", "").strip()
    if slurm.isdigit():
        return {"end_time": float(slurm), "end_time_from": "SLURM_JOB_END_TIME"}
    return {}


def _optional_int(environ: Mapping[str, str], name: str) -> int | None:
    # Slurm writes some counts per node group ("4(x2)"); only a plain number is read here.
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _gpus_per_task(value: str | None) -> int | None:
    # `--gpus-per-task=[type:]count`, several types separated by commas.
    if value is None or not value.strip():
        return None
    try:
        return sum(int(part.rsplit(":", 1)[-1]) for part in value.split(","))
    except ValueError:
        raise ConfigError(f"SLURM_GPUS_PER_TASK={value!r} is not [type:]count as "
                          "`srun --gpus-per-task` writes it") from None


def get_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Reads an integer environment variable, naming the variable when it is malformed."""
    value = environ.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
