"""Where a torch process group meets, derived from the detected launch.

Pure like :mod:`tfdist.env`, and this module imports no torch: a
:class:`~tfdist.env.ClusterEnvironment` in, a frozen :class:`Rendezvous` out, so every launcher
is a table-driven test.

- torchrun: its agent already runs a store and exports ``MASTER_ADDR``/``MASTER_PORT``: ``env://``.
- An srun step: the first node of the step's nodelist, in Slurm's order (``TFDIST_HOST_TEMPLATE``
  applied), at the port tfdist derives from the job and step id for every backend
  (:func:`tfdist.env.slurm.port_base`). ``MASTER_ADDR``/``MASTER_PORT``, when a job script
  exports them (detection keeps them as ``master_addr``/``master_port``), take precedence, as
  they do for PyTorch Lightning.
- ``tfdist launch`` or a user's ``TF_CONFIG``: rank 0's worker address. No TensorFlow server runs
  in a torch process, so that port is free for the store.
- mpirun/horovodrun: they give ranks but no address; ``MASTER_ADDR``/``MASTER_PORT`` are required.
- One plain process: a one-rank group over an in-memory store (no port, no network), so a script
  runs the same code (DDP, samplers, collectives) on one process as on many.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.env.base import ClusterEnvironment
from tfdist.errors import LaunchError

__all__ = ["Rendezvous", "plan"]


@dataclass(frozen=True)
class Rendezvous:
    """How ``torch.distributed.init_process_group`` is called for this process.

    Attributes:
        init_method: ``"env://"``, ``"tcp://host:port"``, or None for a one-process group over
            an in-memory store.
        rank: this process's rank in the group.
        world_size: number of processes in the group.
        reason: where the address comes from, for logs.
    """

    init_method: str | None
    rank: int
    world_size: int
    reason: str


def plan(environment: ClusterEnvironment) -> Rendezvous:
    """Chooses the rendezvous for ``environment`` (see the module docstring for the rules).

    Args:
        environment: the detected launch (:func:`tfdist.env.detect`).

    Returns:
        The :class:`Rendezvous`.

    Raises:
        LaunchError: the launcher gives no address to meet at; the message names the fix.
    """
    launcher, rank, size = environment.facts, environment.rank, environment.world_size
    if launcher.one_process:
        return Rendezvous(None, 0, 1, "one process: in-memory store")
    if launcher.torch_store:
        if environment.coordinator is None:
            raise LaunchError("torchrun's MASTER_ADDR/MASTER_PORT are not set in this worker: "
                              "start the script with torchrun itself, not with a copy of its "
                              "variables")
        return Rendezvous("env://", rank, size, f"torchrun store at {environment.coordinator}")
    if launcher.tf_config_addresses and environment.worker_addresses:
        first = environment.worker_addresses[0]
        return Rendezvous(f"tcp://{first}", rank, size, f"rank 0's TF_CONFIG address {first}")
    # srun: rank 0's derived address. MPI launchers give none (Horovod's coordinator is its own
    # HTTP rendezvous, not a place for torch's store): MASTER_ADDR/MASTER_PORT must.
    derived = environment.worker_addresses[0] if launcher.slurm_addresses else None
    address = _master_override(environment, derived)
    return Rendezvous(f"tcp://{address}", rank, size, _describe(environment, address))


def _master_override(environment: ClusterEnvironment, derived: str | None) -> str:
    host, _, port = (derived or "").rpartition(":")
    host = environment.master_addr or host
    if environment.master_port is not None:
        port = str(environment.master_port)
    if not host or not port:
        raise LaunchError(
            f"{environment.reason}: this launch starts the ranks but gives PyTorch no address to "
            "meet at. Start the script with torchrun or srun (one task per GPU), or export "
            "MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port) to every rank, e.g. "
            "`mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...`")
    return f"{host}:{port}"


def _describe(environment: ClusterEnvironment, address: str) -> str:
    given = [name for name, value in (("MASTER_ADDR", environment.master_addr),
                                      ("MASTER_PORT", environment.master_port)) if value]
    if environment.facts.slurm_addresses and not given:
        return f"first node of the step's nodelist at the job's derived port: {address}"
    return f"{address} from {' and '.join(given)}"
