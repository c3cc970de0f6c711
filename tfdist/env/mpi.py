"""horovodrun and mpirun (Open MPI, MPICH/Intel MPI hydra).

These are the variables the launchers put in each process's environment before MPI starts.
``srun --mpi=pmix`` sets ``PMIX_RANK`` but none of these: such a step is Slurm's.
``tfdist launch --backend horovod`` sets horovodrun's variables plus ``TFDIST_LAUNCHER=local``.
"""

from __future__ import annotations

from collections.abc import Mapping

from tfdist.env.base import ClusterEnvironment, common, get_int

__all__ = ["detect"]

# (launcher, rank, size, local rank, local size, node rank); the first present rank wins.
_FLAVOURS = (
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
     "HOROVOD_CROSS_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    # Hydra sets PMI_RANK like Slurm's pmi2 plugin does; MPI_LOCALRANKID is hydra's alone.
    ("mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
)


def detect(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """Reads the first launcher's variables present, Horovod's own before MPI's."""
    for launcher, rank_var, size_var, local_var, local_size_var, node_var in _FLAVOURS:
        if rank_var in environ and local_var in environ:
            rank = get_int(environ, rank_var)
            local_size = get_int(environ, local_size_var, 1)
            size = get_int(environ, size_var)
            node_rank = get_int(environ, node_var, rank // local_size) if node_var else (
                rank // local_size)
            coordinator = None
            if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
                coordinator = (f"{environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
                               f"{environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}")
            reason = f"{launcher} ({rank_var}={rank}, {size_var}={size})"
            launched_for = None
            if launcher == "horovodrun" and environ.get("TFDIST_LAUNCHER") == "local":
                launcher, reason = "local", f"tfdist launch --backend horovod ({rank_var}={rank})"
                launched_for = "horovod"
            return ClusterEnvironment(
                launcher=launcher, rank=rank, world_size=size,
                local_rank=get_int(environ, local_var), local_world_size=local_size,
                node_rank=node_rank, num_nodes=get_int(
                    environ, "HOROVOD_CROSS_SIZE", -(-size // local_size)),
                coordinator=coordinator, launched_for=launched_for, **common(environ),
                reason=reason)
    return None
