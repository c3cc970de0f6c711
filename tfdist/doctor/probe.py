"""What one rank finds out about itself, without the network and without importing TensorFlow.

Versions come from the installed packages' metadata, the GPUs from tfdist's own policy
(:mod:`tfdist.devices`) and the node's device files, the cores from the affinity mask: all in
milliseconds, so that a broken rank is reported before anything slow starts.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import socket
from collections.abc import Mapping

from tfdist import backend_facts as facts
from tfdist import devices, settings
from tfdist.backend_facts import Backend
from tfdist.backends import choose, choose_torch, keras_backend
from tfdist.doctor.report import INTERFACE_VARIABLES, RankReport, ranges
from tfdist.env import ClusterEnvironment
from tfdist.errors import TfdistError

__all__ = ["replicas", "report", "resolve", "versions"]

# Distribution names of each package, first installed wins.
_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
                   "tf-nightly", "intel-tensorflow"),
    "keras": ("keras",), "tf_keras": ("tf-keras", "tf_keras"), "tfdist": ("tfdist",),
    "horovod": ("horovod",), "torch": ("torch",), "deepspeed": ("deepspeed",),
}


def report(environment: ClusterEnvironment, *, framework: str = "tf",
           backend: str | None = None, environ: Mapping[str, str] | None = None) -> RankReport:
    """This rank's :class:`RankReport`.

    Args:
        environment: the detected launch.
        framework: ``"tf"`` or ``"torch"``: which engine the doctor checks.
        backend: the requested TensorFlow backend (default: the setting).
        environ: the environment to read (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    errors: list[str] = []
    try:
        settings.current(environ)
        requested = settings.resolve("backend", backend, environ)
        collective = settings.resolve(
            "collective" if framework == "tf" else "torch_collective", environ=environ)
    except TfdistError as error:
        errors.append(str(error))
        requested, collective = "auto", "auto"
    try:
        gpus = devices.select_gpus(environment.visible_devices, environment.local_rank,
                                   environment.local_world_size,
                                   environment.gpus_per_task is not None)
    except TfdistError as error:
        errors.append(str(error))
        gpus = ""
    node_gpus = devices.node_gpus()
    try:
        chosen, why = (choose_torch(requested, environment) if framework == "torch" else
                       choose(requested, environment, keras_backend(environ)))
    except TfdistError as error:
        errors.append(str(error))
        chosen, why = requested, str(error)
    row = _row(chosen, framework)
    has_gpus = bool(gpus) if gpus is not None else node_gpus > 0
    collective = _collective(row, collective, has_gpus, environ)
    share = (node_gpus // environment.local_world_size if gpus is None else
             len([gpu for gpu in gpus.split(",") if gpu]))
    try:
        cpu_replicas = settings.resolve("cpu_replicas", environ=environ) or 1
    except TfdistError:  # reported with the other settings
        cpu_replicas = 1
    return RankReport(
        rank=environment.rank, host=socket.gethostname(), local_rank=environment.local_rank,
        local_world_size=environment.local_world_size,
        address=(environment.worker_addresses[environment.rank]
                 if environment.worker_addresses else ""),
        cpus=ranges(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "",
        gpus="?" if gpus is None else gpus, slurm_gpus=environment.slurm_gpus or "",
        node_gpus=node_gpus, gpus_per_task=environment.gpus_per_task,
        replicas=replicas(row, share, cpu_replicas), gpu_share=share, backend=chosen,
        collective=collective, why=why, versions=versions(),
        interfaces=tuple(name for _, name in socket.if_nameindex()),
        network=_network(environ),
        resolved=resolve(_dialled(environment)), step_nodes=environment.num_nodes,
        job_nodes=environment.job_nodes, job_tasks_per_node=environment.job_tasks_per_node,
        errors=tuple(errors))


def _collective(row: Backend, requested: str, has_gpus: bool,
                environ: Mapping[str, str]) -> str:
    """The collective the chosen backend will use between processes; ``""`` where it has none
    or decides when it starts."""
    if row.horovod:  # Horovod's controller, decided when it starts unless set
        controller = settings.resolve("horovod_controller", environ=environ)
        return "" if controller == "auto" else controller
    if not row.crosses_processes:  # one process: nothing crosses processes
        return ""
    if requested == "auto":
        return row.collective_on_gpus if has_gpus else row.collective_on_cpus
    return requested


def replicas(backend: Backend, gpus: int, cpu_replicas: int) -> int:
    """The devices a process trains a replica on (pure).

    Args:
        backend: the chosen backend's facts.
        gpus: the GPUs in this process's share.
        cpu_replicas: ``TFDIST_CPU_REPLICAS`` (1 when unset), used without GPUs.
    """
    if not backend.several_devices:
        return 1  # Horovod, DDP, TensorFlow's default strategy: one device per process
    return gpus or cpu_replicas


def _row(name: str, framework: str) -> Backend:
    """The facts of backend ``name`` (``"tf"`` includes Keras 3 on JAX, which ``tfdist.init``
    also creates); for a name that is none of ``framework``'s (an error the report names),
    those of its first backend that crosses processes."""
    for each in (framework, facts.JAX) if framework == facts.TF else (framework,):
        with contextlib.suppress(TfdistError):
            return facts.backend(name, each)
    return next(row for row in facts.BACKENDS
                if row.framework == framework and row.crosses_processes)


def versions() -> dict[str, str]:
    """Python's version and each installed package's (see :data:`report.PACKAGES`)."""
    found = {"python": platform.python_version()}
    for package, names in _DISTRIBUTIONS.items():
        for name in names:
            try:
                found[package] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def _network(environ: Mapping[str, str]) -> dict[str, str]:
    network = {name: environ[name] for name in INTERFACE_VARIABLES if environ.get(name)}
    try:
        template = settings.resolve("host_template", environ=environ)
    except TfdistError:  # reported with the other settings
        return network
    if template != settings.setting("host_template").default:
        network["TFDIST_HOST_TEMPLATE"] = template
    return network


def _dialled(environment: ClusterEnvironment) -> list[str]:
    """The host names this rank dials first: the coordinator's and the next rank's."""
    addresses = environment.worker_addresses
    if not addresses:
        return []
    neighbour = addresses[(environment.rank + 1) % len(addresses)]
    return list(dict.fromkeys(a.rsplit(":", 1)[0] for a in (addresses[0], neighbour)))


def resolve(names: list[str]) -> dict[str, str]:
    """Each name's first address, or ``"error: ..."``."""
    resolved = {}
    for name in names:
        try:
            resolved[name] = str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as error:
            resolved[name] = f"error: {error.strerror or error}"
    return resolved
