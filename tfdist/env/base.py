"""The one interface every launcher's detection returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tfdist.errors import ConfigError

__all__ = ["ClusterEnvironment", "get_int"]


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
        coordinator: ``host:port`` of rank 0's rendezvous (torchrun, Horovod), if known.
        job_id: the scheduler's job id, if any.
        visible_devices: this process's ``CUDA_VISIBLE_DEVICES`` as inherited, or None.
        reason: which variables decided the detection, for logs and ``tfdist env``.
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
    job_id: str | None = None
    visible_devices: str | None = None
    reason: str = ""

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


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
