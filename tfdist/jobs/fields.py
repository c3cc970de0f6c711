"""The keys of a ``tfdist job`` config: one frozen dataclass with a field per YAML key and its
default, and the values that follow from them (pure).

:class:`tfdist.jobs.config.JobConfig` is this dataclass checked when it is built; the checks
(:mod:`tfdist.jobs.checks`) read the fields here, so they need not know how a config is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tfdist.jobs.choices import BACKEND_LAUNCHERS
from tfdist.scaling import default_sizes

__all__ = ["JobFields"]


@dataclass(frozen=True)
class JobFields:
    """Every key of a job, with its default; :class:`~tfdist.jobs.config.JobConfig` checks
    them."""

    kind: str = "train"
    job_name: str = "tfdist"
    # Resources
    nodes: int = 1
    gpus_per_node: int = 1
    gpu_type: str | None = None
    gpus_per_task: bool = False
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None
    # The cores of a node, for cpus_per_task's default (tfdist job asks sinfo when unset)
    cores_per_node: int | None = None
    # Scheduling and output
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    constraint: str | None = None
    mem: str | None = None
    array: str | None = None
    # Preemption and walltime: a signal to the tasks before the limit, and the requeue
    signal: str | None = None
    requeue: bool = False
    # A lost node survived: the training goes on on the nodes left (tfdist survive), while at
    # least min_nodes are (None: off), at most node_restarts times (a task crashed on a healthy
    # node: the same nodes again)
    min_nodes: int | None = None
    node_restarts: int = 3
    # Hot spares: this many nodes more, idle until a lost node's place goes to one of them
    spare_nodes: int = 0
    sbatch_args: tuple[str, ...] = ()
    output: str = "%x-%j.out"
    task_output: str | None = None
    # Software
    modules: tuple[str, ...] = ()
    runtime: str = "venv"
    venv: str | None = None
    python: str | None = None
    image: str | None = None
    binds: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # Launch
    backend: str = "mwms"
    launcher: str | None = None
    launcher_args: tuple[str, ...] = ()
    cpu_bind: str | None = "cores"
    doctor: bool = True
    script: str | None = None
    args: tuple[str, ...] = ()
    # Venv build
    packages: tuple[str, ...] = ()
    system_site_packages: bool = False
    # Scaling: the node counts to measure (default: powers of two below nodes, and nodes)
    scaling_nodes: tuple[int, ...] = ()

    @property
    def survives(self) -> bool:
        """Whether the training runs under ``tfdist survive`` (``min_nodes`` or
        ``spare_nodes``)."""
        return self.min_nodes is not None or self.spare_nodes > 0

    @property
    def effective_min_nodes(self) -> int | None:
        """``min_nodes``, else ``nodes`` with spares (a lost node is replaced, never left out),
        else None."""
        if self.min_nodes is not None:
            return self.min_nodes
        return self.nodes if self.spare_nodes > 0 else None

    @property
    def effective_launcher(self) -> str:
        """``launcher``, or the backend's default launcher when it is not set."""
        return self.launcher or BACKEND_LAUNCHERS[self.backend][0]

    @property
    def effective_tasks_per_node(self) -> int:
        """Slurm tasks per node: ``tasks_per_node``, else 1 for torchrun (one agent per node)
        and for CPU-only jobs, else one per GPU."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        if self.kind == "build-venv" or self.effective_launcher == "torchrun":
            return 1
        return self.gpus_per_node or 1

    @property
    def effective_cpus_per_task(self) -> int | None:
        """``cpus_per_task``, else the node's cores shared by its tasks (``cores_per_node``),
        else None: Slurm's default, one core a task unless the partition gives whole nodes."""
        if self.cpus_per_task is not None or self.kind == "build-venv":
            return self.cpus_per_task
        if self.cores_per_node is None:
            return None
        return max(1, self.cores_per_node // self.effective_tasks_per_node)

    @property
    def effective_scaling_nodes(self) -> tuple[int, ...]:
        """The node counts a scaling job measures: ``scaling_nodes``, else the powers of two
        below ``nodes``, and ``nodes`` (:func:`tfdist.scaling.default_sizes`)."""
        return self.scaling_nodes or default_sizes(self.nodes)
