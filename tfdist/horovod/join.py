"""Joining a launch with Horovod: ``hvd.init()`` with what the launcher did not set, for either
framework's Horovod (``horovod.tensorflow``, ``horovod.torch``). Imports no framework.

Which controller ``hvd.init()`` uses follows the launch:

- horovodrun (``--gloo`` or MPI), mpirun, ``tfdist launch --backend horovod``: the launcher
  already set everything; ``hvd.init()`` as it is.
- an srun step: with ``TFDIST_HOROVOD_CONTROLLER=mpi``, or ``auto`` (the default) when Slurm's
  PMIx/PMI2 plugin started the step (detected as ``ClusterEnvironment.mpi_plugin``) and Horovod
  has MPI, MPI initialises from Slurm; otherwise Gloo, with rank 0 serving the rendezvous on the
  step's derived port (:mod:`tfdist.horovod.rendezvous`).
"""

from __future__ import annotations

import os
from typing import Any

from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError, LaunchError
from tfdist.settings import resolve

__all__ = ["check_launcher", "choose_controller", "join"]

_server: Any = None  # rank 0's rendezvous server in an srun step, kept for the process's life


def choose_controller(environment: ClusterEnvironment, requested: str, mpi_built: bool,
                      gloo_built: bool) -> str:
    """Which controller an srun step uses (pure; see the module docstring).

    Args:
        environment: the detected srun step.
        requested: ``"auto"``, ``"gloo"`` or ``"mpi"`` (setting ``horovod_controller``).
        mpi_built: Horovod was built with MPI.
        gloo_built: Horovod was built with Gloo.

    Raises:
        ConfigError: the requested controller is one this Horovod was built without.
    """
    if requested == "auto":
        requested = "mpi" if environment.mpi_plugin and mpi_built else "gloo"
    built = {"mpi": mpi_built, "gloo": gloo_built}[requested]
    if not built:
        other = "HOROVOD_WITH_GLOO=1" if requested == "gloo" else "HOROVOD_WITH_MPI=1"
        raise ConfigError(f"this srun step needs Horovod's {requested} controller, which this "
                          f"horovod was built without: rebuild it with {other}, or set "
                          "TFDIST_HOROVOD_CONTROLLER to the other one")
    return requested


def check_launcher(environment: ClusterEnvironment, other: str = "backend='mwms'") -> None:
    """Refuses a launch Horovod cannot join, naming how to start it, or ``other`` backend.

    Raises:
        LaunchError: e.g. workers of `tfdist launch` without ``--backend horovod``.
    """
    if environment.facts.horovod_joins:
        return
    if environment.facts.tfdist_launch:
        raise LaunchError(
            "these workers were started by `tfdist launch` without Horovod's rendezvous "
            "(TF_CONFIG): start them with `tfdist launch --backend horovod -n N ...` to use "
            f"Horovod, or use {other}")
    raise LaunchError(
        f"{environment.reason}: Horovod cannot join this launch. Start the processes with "
        f"horovodrun, mpirun, `tfdist launch --backend horovod -n N` or srun, or use {other}")


def join(environment: ClusterEnvironment, hvd: Any) -> None:
    """``hvd.init()`` for this launch, with what the launcher did not set (any framework's
    ``hvd``: ``horovod.tensorflow`` or ``horovod.torch``).

    Raises:
        LaunchError: Horovod joined another number of processes than the launch started.
    """
    # A rank that stops calling collectives (uneven data, an exception on one rank) would
    # otherwise stall the others forever; Horovod shuts down after this many seconds instead.
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "300")
    if environment.facts.serves_rendezvous:
        _join_srun_step(environment, hvd)
    elif environment.facts.one_process and hvd.gloo_built():
        # One plain process: Gloo needs no peers, while MPI would try a singleton MPI_Init.
        os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
    hvd.init()
    if int(hvd.size()) != environment.world_size:
        raise LaunchError(
            f"Horovod joined {hvd.size()} process(es), but {environment.reason} started "
            f"{environment.world_size}: the processes did not find each other. With an MPI "
            "build under srun use `srun --mpi=pmix`, or set TFDIST_HOROVOD_CONTROLLER=gloo")


def _join_srun_step(environment: ClusterEnvironment, hvd: Any) -> None:
    controller = choose_controller(environment, resolve("horovod_controller"),
                                   bool(hvd.mpi_built()), bool(hvd.gloo_built()))
    if controller == "mpi":
        os.environ["HOROVOD_CONTROLLER"] = "mpi"
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "mpi")
        return
    _join_gloo(environment)


def _join_gloo(environment: ClusterEnvironment) -> None:
    global _server
    from tfdist.horovod import rendezvous

    host_of = [address.rsplit(":", 1)[0] for address in environment.worker_addresses]
    address, port = environment.coordinator.rsplit(":", 1) if environment.coordinator else (
        host_of[0], "0")
    plan = rendezvous.slots(host_of)
    token = f"{environment.job_id}:{environment.step_id or ''}:{len(plan)}"
    iface = "lo" if len(set(host_of)) == 1 and _is_loopback(address) else None
    os.environ.update(rendezvous.gloo_env(plan[environment.rank], address, int(port),
                                          resolve("horovod_gloo_iface") or iface,
                                          resolve("horovod_gloo_timeout")))
    if environment.rank == 0:
        _server = rendezvous.RendezvousServer(int(port), plan, token)
    else:
        rendezvous.wait_for_server(address, int(port), token, resolve("horovod_start_timeout"))


def _is_loopback(address: str) -> bool:
    import socket

    try:
        return socket.gethostbyname(address).startswith("127.")
    except OSError:
        return False
