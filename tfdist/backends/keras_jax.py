"""Keras 3 on JAX: ``keras.distribution.DataParallel`` over every process's devices.

Chosen when ``KERAS_BACKEND`` is ``jax`` (:func:`tfdist.backends.choose`). Several processes
meet through JAX's own runtime (``jax.distributed.initialize``) at the address tfdist derives
from the launch, as for a torch process group (:func:`coordinator`: rank 0's worker address
under ``tfdist launch``, an srun step or ``TF_CONFIG``; ``MASTER_ADDR`` and one port above
torchrun's store under torchrun); on CPUs the collectives are Gloo's. Keras then runs each step
as one computation over all devices: the gradients are averaged inside it, and every variable is
one array replicated on every device.

What tfdist adds, as for its TensorFlow backends:

- each rank reads its part of every GLOBAL batch (:meth:`JaxDistributed.shard`, and ``fit``,
  ``evaluate`` and ``predict`` on in-memory arrays, which Keras refuses on several processes);
- a variable takes rank 0's value wherever a rank places one (a model built with other seeds on
  other ranks starts from rank 0's weights; JAX would otherwise stop with a raw assertion);
- ``predict`` returns every row on every rank (Keras cannot read a batch that spans processes);
- saving runs on every rank, the chief's file kept (Keras reads the replicated arrays through
  JAX's runtime).

JAX and Keras are imported inside the functions that need them only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tfdist import backend_facts as facts
from tfdist.backends.base import Distributed, Settings
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError, InitOrderError, LaunchError

__all__ = ["JaxDistributed", "coordinator", "create"]

logger = logging.getLogger("tfdist")


class NoStrategyError(ConfigError, AttributeError):
    """``dist.strategy`` read under Keras 3 on JAX: there is no TensorFlow strategy. An
    AttributeError too, so that ``getattr(dist.strategy, name, default)`` reads the default."""


class _NoStrategy:
    """``dist.strategy`` under Keras 3 on JAX: false like None; using it raises
    :class:`NoStrategyError`, whose one line says why (not Python's "'NoneType' object has no
    attribute")."""

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise NoStrategyError(
            f"dist.strategy.{name}: KERAS_BACKEND=jax trains with JAX, and a TensorFlow "
            "strategy (strategy.run, experimental_distribute_dataset, a tf.GradientTape loop) "
            "does not exist there. Fix: run a TensorFlow custom loop with "
            "KERAS_BACKEND=tensorflow (or unset), or train with model.fit on JAX")

    def __repr__(self) -> str:
        return "<no TensorFlow strategy: KERAS_BACKEND=jax>"


class JaxDistributed(Distributed):
    """The handle for Keras 3 on JAX (one process or several)."""

    backend = "jax"
    # Keras reads a replicated array of several processes through JAX's runtime: a save on the
    # chief alone waited for the others (seen: the job hung at the chief's model.save).
    save_on_every_rank = True

    def __init__(self, environment: ClusterEnvironment, distribution: Any, collective: str,
                 num_gpus: int, jax: Any) -> None:
        super().__init__(environment, _NoStrategy(), collective, num_gpus)
        self.distribution = distribution
        self._jax = jax

    @property
    def facts(self) -> facts.Backend:
        return facts.backend("jax", facts.JAX)

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """Devices over all processes: one replica each."""
        return int(self._jax.device_count())

    @property
    def local_replicas(self) -> int:
        return int(self._jax.local_device_count())

    def scope(self) -> Any:
        """The distribution's scope (it is also set for the whole process: ``fit`` outside the
        scope trains the same)."""
        return self.distribution.scope() if self.distribution else contextlib.nullcontext()

    def shard(self, dataset: Any, policy: str = "data", *, num_files: int | None = None) -> Any:
        """This rank's part of every global batch of ``dataset`` (a batched ``tf.data``
        dataset), as :meth:`Distributed.shard`'s policies say; Keras puts the ranks' parts
        together into the global batch of each step."""
        from tfdist.horovod import sharding as by_rank

        self.look_at_input(dataset, policy)
        return by_rank.shard(dataset, self.rank, self.world_size, policy, num_files=num_files)

    def gradient_tape(self, persistent: bool = False, compression: str | None = None) -> Any:
        raise ConfigError("Keras 3 on JAX has no gradient tape: a custom step is a train_step "
                          "(jax.value_and_grad inside it), which Keras runs over all devices; "
                          "see Keras's guide 'Customizing what happens in fit() with JAX'")

    def reduce(self, op: str, value: Any) -> Any:
        raise ConfigError("dist.reduce takes per-replica values, which Keras 3 on JAX does not "
                          "make: a value inside train_step is already over the global batch")

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Every rank's float32 ``values`` gathered and added in rank order: the same bits on
        every rank."""
        if self.world_size == 1:
            return [float(v) for v in values]
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float32)))
        total = np.zeros(every.shape[1:], np.float32)
        for row in every:  # one order on every rank
            total += row
        return [float(v) for v in total]

    def local_copies(self, variable: Any) -> list[Any]:
        """The copy of ``variable`` on each of this process's devices (its shards' data: one
        replicated array holds a copy per device)."""
        value = getattr(variable, "value", variable)
        shards = sorted(value.addressable_shards, key=lambda shard: shard.device.id)
        return [np.asarray(shard.data) for shard in shards]

    def gather_rows(self, rows: np.ndarray, timeout_s: float) -> np.ndarray:
        del timeout_s  # JAX's runtime ends a job whose rank stops answering (heartbeat)
        if self.world_size == 1:
            return rows
        from jax.experimental import multihost_utils

        halves = np.ascontiguousarray(rows, np.int64).view(np.uint32)  # JAX's ints are 32 bits
        every = np.asarray(multihost_utils.process_allgather(halves, tiled=True))
        return np.ascontiguousarray(every, np.uint32).view(np.int64)

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        return lambda value=1.0: self.sum_over_ranks([float(value)] * max(n, 1))[0]

    def callbacks(self, *extra: Any, **options: Any) -> list[Any]:
        """Keras callbacks for Keras 3 on JAX (:mod:`tfdist.jax.callbacks`), planned as for
        TensorFlow's Keras (:func:`tfdist.keras.plan.plan`): your ``extra`` callbacks, their
        writers routed (the chief writes, a BackupAndRestore per rank); with ``model_dir`` the
        chief's checkpoint and TensorBoard logs, the preemption and walltime stop with an exact
        resume and the exact state at each epoch's end; the warm-up, ``chief_only``; the
        throughput meter (``throughput=False`` turns it off) and, on ranks other than the
        chief, a silent progress bar. An option Keras 3 on JAX cannot honour is refused with
        the fix (:class:`tfdist.errors.ConfigError`)."""
        from tfdist.jax import callbacks as jax_callbacks

        return jax_callbacks.build(self, *extra, **options)


def coordinator(environment: ClusterEnvironment) -> tuple[str, str]:
    """Where JAX's processes meet (``host:port`` of rank 0's coordination service) and why
    (pure). The rules of :func:`tfdist.torch.rendezvous.plan`, but under torchrun, whose store
    holds ``MASTER_PORT``: one port above it.

    Raises:
        LaunchError: the launcher gives no address; the message names the fix.
    """
    from tfdist.torch import rendezvous

    if environment.facts.torch_store:
        if not (environment.master_addr and environment.master_port):
            raise LaunchError("torchrun's MASTER_ADDR/MASTER_PORT are not set in this worker: "
                              "start the script with torchrun itself")
        port = environment.master_port + 1
        return (f"{environment.master_addr}:{port}",
                f"MASTER_ADDR, one port above torchrun's store ({port})")
    plan = rendezvous.plan(environment)
    if plan.init_method is None:
        raise LaunchError("one process has no coordinator")  # not called for one process
    return plan.init_method.removeprefix("tcp://"), plan.reason


def create(environment: ClusterEnvironment, settings: Settings) -> JaxDistributed:
    """Starts JAX's multi-process runtime (several processes) and sets Keras's distribution.
    Each process drives its own GPUs, as under the TensorFlow backends
    (:func:`tfdist.devices.narrow_visible_gpus`, before JAX reads ``CUDA_VISIBLE_DEVICES``)."""
    from tfdist import devices

    chosen = devices.narrow_visible_gpus(environment)
    import jax

    collective = "none"
    if environment.is_distributed:
        own = None  # nothing narrowed: this process's share of the node's GPUs
        if chosen is None and environment.local_world_size > 1 and devices.node_gpus():
            own = list(devices.share(devices.node_gpus(), environment.local_rank,
                                     environment.local_world_size))
        collective = _start_runtime(jax, environment, settings, own)
    import keras

    every = jax.devices()
    gpus = sum(1 for d in jax.local_devices() if d.platform == "gpu")
    distribution = None
    if len(every) > 1:  # one device: plain Keras, nothing to distribute
        distribution = keras.distribution.DataParallel(devices=every,
                                                       auto_shard_dataset=False)
        keras.distribution.set_distribution(distribution)
    # Its patches (where fit's input stands; the jax-* rows for several processes) follow:
    # tfdist.backends.create.
    handle = JaxDistributed(environment, distribution, collective, gpus, jax)
    if environment.is_chief:
        logger.info("tfdist: Keras %s on JAX %s, %d process(es), %d %s device(s)%s; %s",
                    keras.__version__, jax.__version__, environment.world_size, len(every),
                    every[0].platform.upper(),
                    ", DataParallel over all" if distribution else "",
                    f"{collective} collectives" if environment.is_distributed else "one process")
    return handle


def _start_runtime(jax: Any, environment: ClusterEnvironment, settings: Settings,
                   own: list[int] | None) -> str:
    """``jax.distributed.initialize`` for this launch (``own``: the local GPU ids this process
    drives, None for JAX's default); the collective's name."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise InitOrderError(
            f"JAX's runtime had already started when tfdist set up {environment.world_size}-"
            "process training: something ran a JAX computation first (an array, a Keras model "
            "or layer, jax.devices()). Fix: make `tfdist.init()` (or `with "
            "tfdist.strategy_scope() as dist:`) the first JAX work in main(); imports are safe")
    address, why = coordinator(environment)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = int(max(settings.get("heartbeat_timeout") or 30, 10))
    jax.distributed.initialize(coordinator_address=address,
                               num_processes=environment.world_size,
                               process_id=environment.rank, local_device_ids=own,
                               heartbeat_timeout_seconds=heartbeat)
    if environment.is_chief:
        logger.info("tfdist: JAX's processes met at %s (%s)", address, why)
    return "nccl" if any(d.platform == "gpu" for d in jax.local_devices()) else "gloo"
