"""The Horovod backend: rendezvous, ``hvd.init()``, GPU pinning and the handle.

Horovod's own pieces, which need Horovod and TensorFlow loaded, live in :mod:`tfdist.horovod`
(collective ops, ``fit`` helpers, input splitting, the Gloo rendezvous, install checks).

Which controller ``hvd.init()`` uses follows the launch:

- horovodrun (``--gloo`` or MPI), mpirun, ``tfdist launch --backend horovod``: the launcher
  already set everything; ``hvd.init()`` as it is.
- an srun step: with ``TFDIST_HOROVOD_CONTROLLER=mpi``, or ``auto`` (the default) when Slurm's
  PMIx/PMI2 plugin started the step (detected as ``ClusterEnvironment.mpi_plugin``) and Horovod
  has MPI, MPI initialises from Slurm; otherwise Gloo, with rank 0 serving the rendezvous on the
  step's derived port (:mod:`tfdist.horovod.rendezvous`).

GPUs: one per process, as Horovod expects: the first of the task's GPUs when
:mod:`tfdist.devices` narrowed them, else the local rank's among those TensorFlow counts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tfdist import devices, quiet
from tfdist.backends.base import Distributed, Settings, configure_threads
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError, LaunchError
from tfdist.settings import resolve

if TYPE_CHECKING:
    import numpy as np

__all__ = ["HorovodDistributed", "check_launcher", "choose_controller", "create", "join"]

logger = logging.getLogger("tfdist")
_LAUNCHED = ("horovodrun", "mpirun", "local", "single")  # hvd.init() needs nothing more
_server: Any = None  # rank 0's rendezvous server in an srun step, kept for the process's life


class HorovodDistributed(Distributed):
    """The handle for the Horovod backend: one process per GPU (or CPU worker).

    ``strategy`` is TensorFlow's default strategy, so ``dist.scope()`` and custom loops written
    with ``strategy.run`` work unchanged; Horovod's collectives do the communication.
    ``collective`` names Horovod's controller: ``"gloo"`` or ``"mpi"``.
    """

    backend = "horovod"

    def __init__(self, environment: ClusterEnvironment, hvd: Any, controller: str,
                 num_gpus: int) -> None:
        import tensorflow as tf

        super().__init__(environment, tf.distribute.get_strategy(), controller, num_gpus)
        self.hvd = hvd

    @property
    def rank(self) -> int:  # type: ignore[override]
        return int(self.hvd.rank())

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return int(self.hvd.size())

    @property
    def local_rank(self) -> int:
        return int(self.hvd.local_rank())

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return int(self.hvd.size())

    def shard(self, dataset: Any, policy: str = "data", *, num_files: int | None = None) -> Any:
        """This rank's share of ``dataset`` (batched with the GLOBAL batch size).

        Horovod has no strategy to split the input, so tfdist does it here, with the same
        result per step as MultiWorkerMirroredStrategy: ``"data"`` gives each rank its slice of
        every global batch (the same number of steps on every rank, also for a short last
        batch), ``"file"`` gives each rank its files then splits the batches, ``"off"`` only
        splits the batches (the dataset already is this rank's).
        """
        from tfdist import throughput
        from tfdist.horovod.sharding import shard

        self.sharded_batch_size = throughput.batch_size_of(dataset)
        return shard(dataset, self.rank, self.world_size, policy, num_files=num_files)

    def backend_callbacks(self) -> list[Any]:
        from tfdist.horovod import fit

        return fit.callbacks()

    def gradient_tape(self, persistent: bool = False, compression: str | None = None) -> Any:
        """A tape whose ``gradient()`` sums the gradients across ranks, like tf.distribute;
        ``compression="fp16"`` all-reduces them as float16 (Horovod's ``Compression.fp16``)."""
        import tensorflow as tf

        from tfdist.horovod.ops import DistributedGradientTape

        return DistributedGradientTape(tf.GradientTape(persistent=persistent), op="sum",
                                       compression=compression)

    def reduce(self, op: str, value: Any) -> Any:
        from tfdist.horovod.ops import reduce

        return reduce(value, op)

    def broadcast_initial_state(self, model: Any, optimizer: Any = None) -> None:
        from tfdist.horovod.fit import broadcast_initial_state

        broadcast_initial_state(model, optimizer)

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        import tensorflow as tf

        total = self.hvd.allreduce(tf.constant([float(v) for v in values], tf.float32),
                                   op=self.hvd.Sum, name=f"tfdist_sum_{len(values)}")
        return [float(v) for v in total.numpy()]

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        import tensorflow as tf

        def reduce(value: float = 1.0) -> float:
            total = self.hvd.allreduce(tf.fill([n], value), op=self.hvd.Sum,
                                       name=f"tfdist_doctor_{n}")
            return float(total[0])

        return reduce

    def gather_objects(self, obj: Any) -> list[Any] | None:
        return list(self.hvd.allgather_object(obj))

    def gather_rows(self, rows: np.ndarray, timeout_s: float) -> np.ndarray:
        # Horovod bounds a missing rank with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, not per call.
        import numpy as np
        import tensorflow as tf

        gathered = self.hvd.allgather(tf.constant(rows), name="tfdist_gather_rows")
        return np.asarray(gathered.numpy())


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


def create(environment: ClusterEnvironment, settings: Settings) -> HorovodDistributed:
    """Initialises Horovod for this launch and returns the handle.

    Raises:
        ConfigError: Horovod is missing or unusable (see :mod:`tfdist.horovod.install`).
        LaunchError: a launch Horovod cannot join (e.g. ``TF_CONFIG`` without a launcher).
    """
    from tfdist.horovod.install import import_horovod

    check_launcher(environment)
    narrowed = devices.narrow_visible_gpus(environment) is not None
    quiet.import_tensorflow()  # before Horovod's import loads it, with the noise
    hvd = import_horovod()
    join(environment, hvd)
    import tensorflow as tf

    configure_threads(settings["threads"])
    num_gpus, given = _pin_gpu(tf, 0 if narrowed else int(hvd.local_rank()),
                               1 if narrowed else environment.local_world_size)
    idle = devices.one_gpu_per_process("Horovod", given, "backend mwms")
    if idle and environment.local_rank == 0:
        logger.warning("tfdist: %s", idle)
    from tfdist import failures, keras_compat
    from tfdist.horovod import fit

    fit.install_hooks(int(hvd.rank()), int(hvd.size()))
    if environment.is_distributed:
        keras_compat.refuse_mixed_keras()  # a Keras 3 model would train without averaging
    # Horovod's error for a peer that died or hung names no rank: the line does, after it.
    failures.install(environment)
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    handle = HorovodDistributed(environment, hvd, controller, num_gpus)
    if handle.is_chief:
        logger.info("tfdist: Horovod %s, %d processes, %s controller, %d GPU(s) per process, %s;"
                    " launched by %s", _version(), handle.world_size, controller, num_gpus,
                    "Keras 3 (tfdist's averaging)" if fit.is_keras3()
                    else "tf_keras (Horovod's DistributedOptimizer)", environment.reason)
    return handle


def check_launcher(environment: ClusterEnvironment, other: str = "backend='mwms'") -> None:
    """Refuses a launch Horovod cannot join, naming how to start it, or ``other`` backend.

    Raises:
        LaunchError: e.g. workers of `tfdist launch` without ``--backend horovod``.
    """
    if environment.launcher == "local" and environment.launched_for != "horovod":
        raise LaunchError(
            "these workers were started by `tfdist launch` without Horovod's rendezvous "
            "(TF_CONFIG): start them with `tfdist launch --backend horovod -n N ...` to use "
            f"Horovod, or use {other}")
    if environment.launcher in (*_LAUNCHED, "slurm"):
        return
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
    if environment.launcher == "slurm":
        _join_srun_step(environment, hvd)
    elif environment.launcher == "single" and hvd.gloo_built():
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


def _pin_gpu(tf: Any, index: int, shared_by: int) -> tuple[int, int]:
    """Pins one GPU per process, as Horovod expects: the local rank's, or the first of this
    task's. Returns the GPUs pinned (0 or 1) and those in this process's share of the
    ``shared_by`` processes that see the same GPUs."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return 0, 0
    mine = gpus[index % len(gpus)]
    tf.config.experimental.set_memory_growth(mine, True)
    tf.config.set_visible_devices(mine, "GPU")
    return 1, len(gpus) // max(shared_by, 1)


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return "?"
