"""Creating the distribution strategy at program startup, and the handle scripts use.

Settings, highest precedence first: the Python argument, then the ``TFDIST_*`` environment
variable, then what the cluster implies, then the default. Example scripts pass a flag as the
argument only when the user gave it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from tfdist.env import ClusterEnvironment, detect
from tfdist.errors import ConfigError, InitOrderError, LaunchError

__all__ = ["Distributed", "init", "strategy_scope", "current", "reset"]

logger = logging.getLogger("tfdist")

BACKENDS = ("auto", "mwms", "horovod", "single")
# Launchers that start MPI/Horovod processes: auto picks Horovod there (MWMS would need an
# address per process, which they do not give).
HOROVOD_LAUNCHERS = ("horovodrun", "mpirun")
COLLECTIVES = ("auto", "ring", "nccl")
_current: Distributed | None = None
_current_settings: dict[str, Any] = {}


class Distributed:
    """What a training script needs to know about its place in the job.

    Create it with :func:`init` or :func:`strategy_scope`, never directly.

    Attributes:
        environment: how the processes were launched (:class:`tfdist.env.ClusterEnvironment`).
        backend: ``"mwms"`` (MultiWorkerMirroredStrategy), ``"horovod"`` or ``"single"`` (one
            process).
        strategy: the ``tf.distribute.Strategy`` (TensorFlow's default one with Horovod).
        collective: ``"nccl"``, ``"ring"``, ``"gloo"`` or ``"mpi"`` (Horovod's controller), or
            ``"none"`` for one process.
        num_gpus: GPUs this process drives (0 on CPU).
    """

    def __init__(self, environment: ClusterEnvironment, backend: str, strategy: Any,
                 collective: str, num_gpus: int) -> None:
        self.environment = environment
        self.backend = backend
        self.strategy = strategy
        self.collective = collective
        self.num_gpus = num_gpus

    @property
    def rank(self) -> int:
        """This process's index, 0-based; rank 0 is the chief (0 for a single process)."""
        return self.environment.rank if self.backend != "single" else 0

    @property
    def size(self) -> int:
        """Number of processes training together."""
        return self.environment.world_size if self.backend != "single" else 1

    @property
    def local_rank(self) -> int:
        """Index among the processes on this node (selects the GPU)."""
        return self.environment.local_rank

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints, logs and progress."""
        return self.rank == 0

    @property
    def num_replicas(self) -> int:
        """Replicas in sync across all processes (GPUs, or one per CPU worker)."""
        return int(self.strategy.num_replicas_in_sync)

    def scope(self) -> Any:
        """The strategy's scope: build and compile models inside it."""
        return self.strategy.scope()

    def scale_lr(self, learning_rate: float) -> float:
        """Linear scaling: ``learning_rate`` times the number of replicas (Goyal et al., 2017).

        Pair it with ``callbacks(warmup_epochs=...)`` to ramp up from the unscaled rate.
        """
        return learning_rate * self.num_replicas

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """Splits a global batch over the replicas.

        Raises:
            ConfigError: the global batch does not divide evenly.
        """
        from tfdist.data import split_batch

        return split_batch(global_batch_size, self.num_replicas)

    def global_batch_size(self, per_replica_batch_size: int) -> int:
        """The global batch that gives each replica ``per_replica_batch_size`` examples."""
        return per_replica_batch_size * self.num_replicas

    def shard(self, dataset: Any, policy: str = "data", *, num_files: int | None = None) -> Any:
        """Sets how ``dataset`` is split across workers; see :func:`tfdist.data.shard`."""
        from tfdist import data

        return data.shard(dataset, self, policy, num_files=num_files)

    def shard_files(self, files: list[str]) -> list[str]:
        """This worker's share of ``files``; see :func:`tfdist.data.shard_files`."""
        from tfdist import data

        return data.shard_files(files, self.rank, self.size)

    def callbacks(self, *extra: Any, **options: Any) -> list[Any]:
        """Keras callbacks for distributed training; see :func:`tfdist.callbacks.build`."""
        from tfdist import callbacks

        return callbacks.build(self, *extra, **options)

    def backend_callbacks(self) -> list[Any]:
        """Callbacks the backend needs first in ``fit`` (Horovod: broadcast, metric averaging)."""
        return []

    def gradient_tape(self, persistent: bool = False) -> Any:
        """A ``tf.GradientTape`` for custom loops whose gradients are summed across replicas.

        Under MultiWorkerMirroredStrategy a plain tape, since ``optimizer.apply_gradients``
        inside ``strategy.run`` sums; with Horovod a tape that sums in ``gradient()``. Either
        way, scale the loss by the GLOBAL batch (``tf.nn.compute_average_loss``).
        """
        import tensorflow as tf

        return tf.GradientTape(persistent=persistent)

    def reduce(self, op: str, value: Any) -> Any:
        """Reduces a per-replica ``value`` across all replicas: ``op`` is "sum" or "mean"."""
        return self.strategy.reduce(op.upper(), value, axis=None)

    def broadcast_initial_state(self, model: Any, optimizer: Any = None) -> None:
        """Copies rank 0's model and optimizer state to every rank (custom loops).

        Call it once after creating the model and optimizer, before the first step.
        MultiWorkerMirroredStrategy already broadcasts when it creates the variables, so only
        Horovod does something here.
        """
        del model, optimizer

    def __repr__(self) -> str:
        return (f"Distributed(backend={self.backend!r}, rank={self.rank}, size={self.size}, "
                f"local_rank={self.local_rank}, collective={self.collective!r}, "
                f"num_gpus={self.num_gpus}, launcher={self.environment.launcher!r})")


def init(backend: str | None = None, *, collective: str | None = None,
         threads: int | None = None) -> Distributed:
    """Detects the launch and creates the strategy. Call it first in ``main``.

    Calling it again returns the same handle (the strategy can be created once per process).

    Args:
        backend: ``"auto"``, ``"mwms"``, ``"horovod"`` or ``"single"``; env
            ``TFDIST_BACKEND``. Auto picks Horovod when horovodrun or mpirun started the
            processes, MultiWorkerMirroredStrategy when another launcher started several, and
            ``"single"`` for one process; it logs which and why.
        collective: ``"auto"``, ``"ring"`` or ``"nccl"``; env ``TFDIST_COLLECTIVE``. Auto
            picks NCCL when GPUs are visible, ring on CPU.
        threads: TensorFlow intra- and inter-op threads; env ``TFDIST_NUM_THREADS``. By default
            the number of cores this process is pinned to, when it is pinned (srun
            ``--cpu-bind``, ``tfdist launch``), else TensorFlow's default.

    Returns:
        The :class:`Distributed` handle.

    Raises:
        InitOrderError: TensorFlow was initialised before this call in a multi-worker job.
        LaunchError: the launch cannot train as started (e.g. the Slurm batch shell).
        ConfigError: an invalid setting, named with the allowed values.
    """
    global _current, _current_settings
    settings = _settings(backend, collective, threads, os.environ)
    if _current is not None:
        if _current_settings != settings:
            raise ConfigError(f"tfdist is already initialised with {_current_settings} in "
                              f"this process; it cannot switch to {settings}")
        return _current
    environment = detect()
    backend, why = choose_backend(settings["backend"], environment)
    if environment.is_chief:
        logger.info("tfdist: backend %s: %s", backend, why)
    handle = _create(backend, environment, settings)
    _current, _current_settings = handle, settings
    return handle


@contextlib.contextmanager
def strategy_scope(backend: str | None = None, *, collective: str | None = None,
                   threads: int | None = None) -> Iterator[Distributed]:
    """``init()`` and enter the strategy's scope: ``with strategy_scope() as dist: ...``.

    Takes the same arguments as :func:`init`.
    """
    handle = init(backend, collective=collective, threads=threads)
    with handle.scope():
        yield handle


def current() -> Distributed | None:
    """The handle created by :func:`init` in this process, if any."""
    return _current


def reset() -> None:
    """Forgets the handle (tests only: TensorFlow cannot reconfigure collectives in-process)."""
    global _current, _current_settings
    _current, _current_settings = None, {}


def _settings(backend: str | None, collective: str | None, threads: int | None,
              environ: Mapping[str, str]) -> dict[str, Any]:
    backend = (backend or environ.get("TFDIST_BACKEND") or "auto").lower()
    collective = (collective or environ.get("TFDIST_COLLECTIVE") or "auto").lower()
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not one of {BACKENDS} "
                          "(argument `backend=` or TFDIST_BACKEND)")
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective {collective!r} is not one of {COLLECTIVES} "
                          "(argument `collective=` or TFDIST_COLLECTIVE)")
    if threads is None and environ.get("TFDIST_NUM_THREADS"):
        from tfdist.env.base import get_int

        threads = get_int(environ, "TFDIST_NUM_THREADS")
    if threads is not None and threads < 1:
        raise ConfigError(f"threads={threads}: use a positive count (or leave it unset)")
    return {"backend": backend, "collective": collective, "threads": threads}


def choose_backend(requested: str, environment: ClusterEnvironment) -> tuple[str, str]:
    """The backend for ``requested`` under this launch, and why (pure).

    Args:
        requested: ``"auto"`` or a backend name.
        environment: the detected launch.

    Returns:
        ``(backend, reason)``.
    """
    if requested != "auto":
        return requested, "requested (argument, flag or TFDIST_BACKEND)"
    if environment.launcher in HOROVOD_LAUNCHERS and environment.is_distributed:
        return "horovod", (f"auto: {environment.launcher} started the processes "
                           f"({environment.reason})")
    if environment.is_distributed:
        return "mwms", f"auto: {environment.world_size} processes ({environment.reason})"
    return "single", f"auto: one process ({environment.reason})"


def _create(backend: str, environment: ClusterEnvironment,
            settings: dict[str, Any]) -> Distributed:
    if backend == "horovod":
        from tfdist.horovod.handle import create

        return create(environment, settings["threads"])
    if backend == "mwms":
        return _create_mwms(environment, settings)
    return _create_single(environment)


def _create_single(environment: ClusterEnvironment) -> Distributed:
    import tensorflow as tf

    return Distributed(environment, "single", tf.distribute.get_strategy(), "none",
                       len(tf.config.list_physical_devices("GPU")))


def _create_mwms(environment: ClusterEnvironment, settings: dict[str, Any]) -> Distributed:
    from tfdist.resolver import select_gpus

    chosen = select_gpus(environment.visible_devices, environment.local_rank,
                         environment.local_world_size, "SLURM_GPUS_PER_TASK" in os.environ)
    if chosen is not None and chosen != environment.visible_devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = chosen  # before TensorFlow first looks at CUDA
    import tensorflow as tf

    _check_not_initialised(environment)
    _configure_threads(settings["threads"])
    num_gpus = _pin_gpus(tf, environment) if chosen is None else len(
        [gpu for gpu in chosen.split(",") if gpu])
    collective = settings["collective"]
    if collective == "auto":
        collective = "nccl" if num_gpus else "ring"
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation,
                               collective.upper()))
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=_resolver(environment, num_gpus), communication_options=options)
    except RuntimeError as error:
        if "configured at program startup" in str(error):
            raise _too_late(environment) from None
        raise
    from tfdist import keras_compat

    keras_compat.apply()
    handle = Distributed(environment, "mwms", strategy, collective, num_gpus)
    if handle.is_chief:
        logger.info("tfdist: MultiWorkerMirroredStrategy, %d workers, %s collectives, %d GPU(s) "
                    "per worker; launched by %s", handle.size, collective.upper(), num_gpus,
                    environment.reason)
    return handle


def _resolver(environment: ClusterEnvironment, num_gpus: int) -> Any:
    if environment.launcher == "slurm":
        from tfdist.resolver import SlurmClusterResolver

        return SlurmClusterResolver(environment, num_gpus=num_gpus)
    if environment.launcher in ("tf_config", "local"):
        import tensorflow as tf

        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    raise LaunchError(
        f"{environment.reason}: this launcher gives MultiWorkerMirroredStrategy no address per "
        "process. Start the workers with srun (one task per GPU) or `tfdist launch -n N`, or "
        "set TF_CONFIG in each process")


def _check_not_initialised(environment: ClusterEnvironment) -> None:
    from tensorflow.python.eager import context

    if context.context()._initialized:
        raise _too_late(environment)


def _too_late(environment: ClusterEnvironment) -> InitOrderError:
    return InitOrderError(
        f"TensorFlow's runtime was already initialised when tfdist set up {environment.world_size}"
        "-worker training. Something ran a TensorFlow op first: creating a tensor or a "
        "tf.data.Dataset, building or loading a Keras model, or tf.config.list_logical_devices(). "
        "Multi-worker collectives can only be configured before that. Fix: make "
        "`with tfdist.strategy_scope() as dist:` (or `tfdist.init()`) the first TensorFlow "
        "work in main() and build datasets and models after it. Safe before it: imports, "
        "tf.random.set_seed, keras.utils.set_random_seed, tf.config.list_physical_devices.")


def _configure_threads(threads: int | None) -> None:
    if threads is None:
        pinned = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        if not pinned or pinned >= (os.cpu_count() or pinned):
            return  # not pinned: TensorFlow's defaults fit the whole machine
        threads = pinned
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def _pin_gpus(tf: Any, environment: ClusterEnvironment) -> int:
    # CUDA_VISIBLE_DEVICES unset: count GPUs and give each local process its own share.
    gpus = tf.config.list_physical_devices("GPU")
    local = environment.local_world_size
    if not gpus or local == 1:
        return len(gpus)
    if len(gpus) % local:
        raise ConfigError(f"{len(gpus)} GPUs cannot be shared evenly by {local} processes on "
                          f"this node: start {len(gpus)} processes per node, one per GPU")
    share = len(gpus) // local
    mine = gpus[environment.local_rank * share:(environment.local_rank + 1) * share]
    tf.config.set_visible_devices(mine, "GPU")
    return len(mine)
