"""MultiWorkerMirroredStrategy: one process per GPU (or CPU worker), TensorFlow's collectives.

Start-up order matters: the GPUs are narrowed (``CUDA_VISIBLE_DEVICES``) before TensorFlow first
looks at CUDA, and the strategy is created before TensorFlow's runtime starts, since collectives
can be configured only then (:func:`tfdist.backends.base.too_late` says how to reorder a script).
Each worker's address comes from the launch: tfdist's Slurm resolver for an srun step,
``TF_CONFIG`` for ``tfdist launch`` and hand-written clusters. ``TFDIST_COLLECTIVE_TIMEOUT``
bounds every collective's wait for the other ranks (:mod:`tfdist.timeouts`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tfdist import backend_facts as facts
from tfdist import devices, quiet
from tfdist.backends.base import (
    Distributed,
    Settings,
    check_not_initialised,
    configure_threads,
    split_cpu,
    too_late,
)
from tfdist.env import ClusterEnvironment
from tfdist.errors import LaunchError, TfdistError

if TYPE_CHECKING:
    import numpy as np

    from tfdist.patches import Where

__all__ = ["MultiWorkerDistributed", "cpu_replicas_while_created", "create",
           "heartbeat_while_created"]

logger = logging.getLogger("tfdist")

# How long the exit handshake waits for the other ranks, which have already passed the
# collective barrier before it: a bound for a peer that died there, not a working time.
_EXIT_HANDSHAKE_S = 60.0
# TensorFlow's coordination service without a configured heartbeat timeout
# (coordination_service.cc, kDefaultHeartbeatTimeout).
_TF_HEARTBEAT_TIMEOUT_MS = 10_000


class MultiWorkerDistributed(Distributed):
    """The handle for MultiWorkerMirroredStrategy; ``collective`` is ``"ring"`` or ``"nccl"``."""

    backend = "mwms"
    save_on_every_rank = True  # tf_keras all-reduces its metrics, Keras 3 may add a variable

    @property
    def local_replicas(self) -> int:
        return len(self.strategy.extended.worker_devices)

    def gather_rows(self, rows: np.ndarray, timeout_s: float) -> np.ndarray:
        import numpy as np
        import tensorflow as tf

        gather = _gather_function(self.strategy, float(timeout_s))
        try:
            gathered = gather(tf.constant(rows))
        except tf.errors.DeadlineExceededError:
            raise TfdistError(f"not every rank reached it within {timeout_s:g} s") from None
        return np.asarray(self.strategy.experimental_local_results(gathered)[0])

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        import tensorflow as tf

        # Every replica of this worker contributes the values once: divide by replicas per
        # worker so that the sum counts each rank once.
        summed = _sum_function(self.strategy)(
            tf.constant([float(v) / self.local_replicas for v in values], tf.float32))
        return [float(v) for v in self.strategy.experimental_local_results(summed)[0].numpy()]

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        import tensorflow as tf

        function = _sum_function(self.strategy)
        replicas = self.local_replicas  # each replica of this worker contributes value / replicas

        def reduce(value: float = 1.0) -> float:
            total = function(tf.fill([n], value / replicas))
            return float(self.strategy.experimental_local_results(total)[0][0])

        return reduce

    def exit_barrier(self) -> None:
        """A collective, then a handshake through the chief's coordination service.

        The collective alone is no exit barrier: with 2 workers, rank 1 can return from its
        all-reduce while rank 0 still fetches rank 1's half (``RecvBuf``), and a rank 1 that
        ends at once fails rank 0's with "Socket closed". So each rank arrives at a
        coordination-service barrier (every rank's collective is done), the others then tell
        the chief they have left it, and the chief, which serves the barrier, ends last.
        A peer lost here only shortens the wait: the state is saved by then.
        """
        self.sum_over_ranks([0.0])
        from tensorflow.python.eager import context

        ctx, timeout_ms = context.context(), int(_EXIT_HANDSHAKE_S * 1000)
        try:
            ctx.wait_at_barrier("tfdist-exit", timeout_ms)
            if self.is_chief:
                for rank in range(1, self.world_size):
                    ctx.get_config_key_value(f"tfdist-exit/{rank}", timeout_ms)
            else:
                ctx.set_config_key_value(f"tfdist-exit/{self.rank}", "left")
        except Exception as error:  # a peer gone at exit ends only the wait
            logger.debug("the exit handshake ended early: %s", error)

    def prepare_gather_rows(self, width: int, timeout_s: float) -> None:
        import tensorflow as tf

        spec = tf.TensorSpec((self.local_replicas, width), tf.int64)
        _gather_function(self.strategy, float(timeout_s)).get_concrete_function(spec)


@functools.lru_cache(maxsize=2)
def _sum_function(strategy: Any) -> Any:
    """A tf.function summing a float32 vector over all replicas (traced once per length).

    The value is copied onto the replica's device first (``tf.identity``): a captured host
    tensor gives the collective no destination ("destinations can not be empty"). About 4 ms
    a call with 2 workers on this machine's loopback, so agreements are spaced in time.
    """
    import tensorflow as tf

    def replica_sum(values: Any) -> Any:
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.identity(values))

    @tf.function
    def sum_values(values: Any) -> Any:
        return strategy.run(replica_sum, args=(values,))

    return sum_values


@functools.lru_cache(maxsize=8)
def _gather_function(strategy: Any, timeout_s: float) -> Any:
    """A tf.function that all-gathers each replica's row of this worker's ``(replicas, k)`` rows.

    Traced once per row width; an eager ``strategy.gather`` retraces on every call (~0.1 s).
    """
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)
    count = len(strategy.extended.worker_devices)

    def replica_row(rows: Any) -> Any:
        context = tf.distribute.get_replica_context()
        mine = rows[context.replica_id_in_sync_group % count][None]
        return context.all_gather(mine, axis=0, options=options)

    @tf.function
    def gather(rows: Any) -> Any:
        return strategy.run(replica_row, args=(rows,))

    return gather


def create(environment: ClusterEnvironment, settings: Settings) -> MultiWorkerDistributed:
    """Pins this worker's GPUs, configures threads and creates the strategy.

    Raises:
        InitOrderError: TensorFlow's runtime already started.
        LaunchError: the launcher gives no address per worker.
        ConfigError: the GPUs cannot be shared by the workers on the node.
    """
    chosen = devices.narrow_visible_gpus(environment)
    tf = quiet.import_tensorflow()

    check_not_initialised(environment)
    configure_threads(settings["threads"], environment.local_world_size)
    num_gpus = devices.count(chosen)
    if num_gpus is None:
        num_gpus = _take_share_of_counted_gpus(tf, environment)
    collective = settings["collective"]
    if collective == "auto":
        collective = "nccl" if num_gpus else "ring"
    timeout = settings["collective_timeout"]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=getattr(tf.distribute.experimental.CommunicationImplementation,
                               collective.upper()),
        timeout_seconds=timeout)  # every collective of the strategy; None: wait forever
    cpu_replicas = 0 if num_gpus else (settings["cpu_replicas"] or 1)
    if cpu_replicas > 1:
        split_cpu(tf, cpu_replicas)
    from tfdist import patches
    from tfdist.backends import where_here

    # The inventory's rows of the creation (mwms-cpu-replicas, mwms-heartbeat); the others
    # follow the engine (tfdist.backends.create).
    where = where_here(facts.backend("mwms"), environment.world_size, num_gpus > 0, settings)
    try:
        with patches.creating(where, settings):
            strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=_resolver(environment, num_gpus),
                communication_options=options)
    except RuntimeError as error:
        if "configured at program startup" in str(error):
            raise too_late(environment) from None
        raise
    handle = MultiWorkerDistributed(environment, strategy, collective, num_gpus)
    from tfdist import peer_watch

    peer_watch.start(environment, settings.get("peer_watch"))  # a peer's host lost: seconds
    if handle.is_chief:
        per_worker = (f"{num_gpus} GPU(s) per worker" if num_gpus else
                      f"{cpu_replicas} logical CPUs per worker" if cpu_replicas > 1 else
                      "on the CPU")
        silent = _configured_heartbeat_timeout()
        logger.info("tfdist: MultiWorkerMirroredStrategy, %d workers, %s collectives, %s "
                    "(%d replicas in all)%s%s; launched by %s", handle.world_size,
                    collective.upper(), per_worker, handle.num_replicas,
                    f", collectives time out after {timeout:g} s" if timeout else "",
                    f", a rank silent for {silent:g} s is named" if silent else "",
                    environment.reason)
    return handle


@contextlib.contextmanager
def cpu_replicas_while_created(where: Where, settings: Settings) -> Iterator[None]:
    """Patch ``mwms-cpu-replicas``'s installer (:func:`tfdist.patches.creating`): while MWMS is
    created, its CPU workers train on ``where.cpu_replicas`` logical CPUs each.

    The stand-in for several GPUs per worker (``TFDIST_CPU_REPLICAS``): TensorFlow gives a
    worker without GPUs one replica on ``CPU:0`` (``_initialize_local_devices``), whatever
    logical CPUs exist. Only this creation sees the change; GPUs are untouched.
    """
    from tensorflow.python.distribute import collective_all_reduce_strategy as mwms

    from tfdist import patches

    def wrap(original: Any) -> Any:
        def local_devices(self: Any, cluster_resolver: Any,
                          worker_device: str) -> tuple[tuple[str, ...], str]:
            found, kind = original(self, cluster_resolver, worker_device)
            if kind != "CPU":
                return found, kind
            return (tuple(f"{worker_device}/device:CPU:{i}" for i in range(where.cpu_replicas)),
                    "CPU")

        return local_devices

    with patches.scoped("mwms-cpu-replicas", mwms.CollectiveAllReduceExtended,
                        "_initialize_local_devices", wrap):
        yield


@contextlib.contextmanager
def heartbeat_while_created(where: Where, settings: Settings) -> Iterator[None]:
    """Patch ``mwms-heartbeat``'s installer (:func:`tfdist.patches.creating`): while MWMS is
    created, the coordination service it starts gets ``settings["heartbeat_timeout"]`` as its
    heartbeat timeout (``TFDIST_HEARTBEAT_TIMEOUT``) instead of TensorFlow's 10 s.

    MWMS configures the service itself (``configure_coordination_service``, unless a service
    is configured already) and passes no timeout. Each rank's agent beats from a C++ thread
    every half timeout; a rank whose process gets a sliver of a core (a busy neighbour, a
    swapping node) can miss 10 s, and the service then fails every rank as if it had crashed.
    """
    from tensorflow.python.eager import context

    from tfdist import patches

    def change(bound: Any) -> None:
        bound.arguments.setdefault("heartbeat_timeout_in_ms",
                                   round(settings["heartbeat_timeout"] * 1000))

    with patches.scoped("mwms-heartbeat", context.Context, "configure_coordination_service",
                        lambda original: patches.rebinding(original, change)):
        yield


def _configured_heartbeat_timeout() -> float | None:
    """The heartbeat timeout in TensorFlow's coordination service config, in seconds (its
    default, 10 s, where the config leaves it 0); None without a service (one worker)."""
    from tensorflow.python.eager import context

    config = context.context().coordination_service
    if config is None:
        return None
    return (config.heartbeat_timeout_in_ms or _TF_HEARTBEAT_TIMEOUT_MS) / 1000


def _resolver(environment: ClusterEnvironment, num_gpus: int) -> Any:
    if environment.facts.slurm_addresses:
        from tfdist.backends.resolver import SlurmClusterResolver

        return SlurmClusterResolver(environment, num_gpus=num_gpus)
    if environment.facts.tf_config_addresses and environment.worker_addresses:
        import tensorflow as tf

        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    raise LaunchError(
        f"{environment.reason}: this launcher gives MultiWorkerMirroredStrategy no address per "
        "process. Start the workers with srun (one task per GPU) or `tfdist launch -n N`, or "
        "set TF_CONFIG in each process")


def _take_share_of_counted_gpus(tf: Any, environment: ClusterEnvironment) -> int:
    # CUDA_VISIBLE_DEVICES unset: TensorFlow counts the GPUs, each local worker takes its share.
    gpus = tf.config.list_physical_devices("GPU")
    mine = devices.share(len(gpus), environment.local_rank, environment.local_world_size)
    if len(mine) != len(gpus):
        tf.config.set_visible_devices([gpus[i] for i in mine], "GPU")
    return len(mine)
