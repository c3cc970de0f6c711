"""torchrun (torch.distributed.run): the elastic agent's variables."""

from __future__ import annotations

from collections.abc import Mapping

from tfdist.env.base import ClusterEnvironment, common, get_int

__all__ = ["detect"]


def detect(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """Reads the variables torchrun's agent sets for each worker (``TORCHELASTIC_RUN_ID``...)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    world_size = get_int(environ, "WORLD_SIZE")
    local_world_size = get_int(environ, "LOCAL_WORLD_SIZE", 1)
    rank = get_int(environ, "RANK")
    coordinator = None
    if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        coordinator = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return ClusterEnvironment(
        launcher="torchrun", rank=rank, world_size=world_size,
        local_rank=get_int(environ, "LOCAL_RANK", 0), local_world_size=local_world_size,
        node_rank=get_int(environ, "GROUP_RANK", rank // local_world_size),
        num_nodes=get_int(environ, "GROUP_WORLD_SIZE", -(-world_size // local_world_size)),
        coordinator=coordinator, **common(environ),
        reason=f"torchrun run {environ['TORCHELASTIC_RUN_ID']} (RANK={rank})")
