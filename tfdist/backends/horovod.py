"""The Horovod backend: rendezvous, ``hvd.init()``, GPU pinning and the handle.

Horovod's own pieces, which need Horovod and TensorFlow loaded, live in :mod:`tfdist.horovod`
(collective ops, ``fit`` helpers, input splitting, the Gloo rendezvous, install checks).

How ``hvd.init()`` joins the launch (the controller, the rendezvous) is
:mod:`tfdist.horovod.join`'s, which the torch backend uses too.

GPUs: one per process, as Horovod expects: the first of the task's GPUs when
:mod:`tfdist.devices` narrowed them, else the local rank's among those TensorFlow counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tfdist import devices, quiet
from tfdist.backends.base import Distributed, Settings, configure_threads
from tfdist.env import ClusterEnvironment

if TYPE_CHECKING:
    import numpy as np

__all__ = ["HorovodDistributed", "create"]

logger = logging.getLogger("tfdist")


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
        from tfdist.horovod.sharding import shard

        self.look_at_input(dataset, policy)
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


def create(environment: ClusterEnvironment, settings: Settings) -> HorovodDistributed:
    """Initialises Horovod for this launch and returns the handle.

    Raises:
        ConfigError: Horovod is missing or unusable (see :mod:`tfdist.horovod.install`).
        LaunchError: a launch Horovod cannot join (e.g. ``TF_CONFIG`` without a launcher).
    """
    from tfdist.horovod.install import import_horovod
    from tfdist.horovod.join import check_launcher, join

    check_launcher(environment)
    narrowed = devices.narrow_visible_gpus(environment) is not None
    quiet.import_tensorflow()  # before Horovod's import loads it, with the noise
    hvd = import_horovod()
    join(environment, hvd)
    import tensorflow as tf

    configure_threads(settings["threads"], environment.local_world_size)
    num_gpus, given = _pin_gpu(tf, 0 if narrowed else int(hvd.local_rank()),
                               1 if narrowed else environment.local_world_size)
    idle = devices.one_gpu_per_process("Horovod", given, "backend mwms")
    if idle and environment.local_rank == 0:
        logger.warning("tfdist: %s", idle)
    from tfdist.horovod import fit, heartbeat

    # Horovod's error for a peer that died or hung names no rank: patch failure-line does,
    # after it; a peer that stops is named by tfdist's heartbeat, over the Gloo rendezvous'
    # store. The patches (horovod-fit, ...) follow the engine: tfdist.backends.create.
    heartbeat.start(environment, hvd)
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    handle = HorovodDistributed(environment, hvd, controller, num_gpus)
    if handle.is_chief:
        logger.info("tfdist: Horovod %s, %d processes, %s controller, %d GPU(s) per process, %s;"
                    " launched by %s", _version(), handle.world_size, controller, num_gpus,
                    "Keras 3 (tfdist's averaging)" if fit.is_keras3()
                    else "tf_keras (Horovod's DistributedOptimizer)", environment.reason)
    return handle


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
