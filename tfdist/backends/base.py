"""The handle every TensorFlow backend provides: what a script and tfdist's own rooms call.

A backend is one module (:mod:`tfdist.backends.mwms`, ``horovod``, ``single``) with a subclass of
:class:`Distributed` and a ``create(environment, settings)`` function. Code that needs a
collective (the replica sync check, the callbacks) calls the handle's operations here and never
asks which backend it is.

Also here: what every TensorFlow backend does at start-up the same way (threads, the "too late"
check). TensorFlow is imported inside the functions that need it only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from tfdist import backend_facts as facts
from tfdist.backend_facts import Backend
from tfdist.devices import affinity_thread_count
from tfdist.env import ClusterEnvironment
from tfdist.errors import InitOrderError
from tfdist.replicas import ReplicaMath

logger = logging.getLogger("tfdist")

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Distributed", "Settings", "check_not_initialised", "configure_threads",
           "too_late"]

# The resolved settings of init(): backend, collective, threads, collective_timeout (see
# tfdist.settings).
Settings = dict[str, Any]


class Distributed(ReplicaMath):
    """What a training script needs to know about its place in the job.

    Create it with :func:`tfdist.init` or :func:`tfdist.strategy_scope`, never directly.

    Attributes:
        environment: how the processes were launched (:class:`tfdist.env.ClusterEnvironment`).
        backend: ``"mwms"`` (MultiWorkerMirroredStrategy), ``"horovod"``, ``"mirrored"`` (one
            process, several devices) or ``"single"``.
        strategy: the ``tf.distribute.Strategy`` (TensorFlow's default one with Horovod and for
            one process).
        collective: ``"nccl"`` or ``"ring"`` (MWMS), ``"gloo"`` or ``"mpi"`` (Horovod's
            controller), ``"none"`` (one process).
        num_gpus: GPUs this process drives (0 on CPU).
        sharded_batch_size: the batch size of the last dataset given to :meth:`shard`, when it
            is a constant (the throughput meter's examples per step), else None.
    """

    backend = "?"
    # Whether saving a model may run collectives, so that every rank must save (the chief's
    # file is kept, the others' thrown away): see tfdist.keras.callbacks.
    save_on_every_rank = False

    def __init__(self, environment: ClusterEnvironment, strategy: Any, collective: str,
                 num_gpus: int) -> None:
        self.environment = environment
        self.strategy = strategy
        self.collective = collective
        self.num_gpus = num_gpus
        self._logged: set[tuple[str, int]] = set()  # lines logged once
        self.sharded_batch_size: int | None = None

    @property
    def facts(self) -> Backend:
        """This backend's row of the backend table (:mod:`tfdist.backend_facts`)."""
        return facts.backend(self.backend, facts.TF)

    # --- place in the job --------------------------------------------------------------------

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's index, 0-based; rank 0 is the chief."""
        return self.environment.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """Number of processes training together."""
        return self.environment.world_size

    @property
    def local_rank(self) -> int:
        """Index among the processes on this node (selects the GPU)."""
        return self.environment.local_rank

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """Replicas in sync across all processes (GPUs, or one per CPU worker)."""
        return int(self.strategy.num_replicas_in_sync)

    @property
    def local_replicas(self) -> int:
        """Replicas this process drives (one per GPU it uses, one on CPU)."""
        return 1

    # --- what scripts call -------------------------------------------------------------------

    def scope(self) -> Any:
        """The strategy's scope: build and compile models inside it."""
        return self.strategy.scope()

    def shard(self, dataset: Any, policy: str = "data", *, num_files: int | None = None) -> Any:
        """Sets how ``dataset`` (batched with the GLOBAL batch size) is split across workers.

        ``"data"`` (default: every worker reads the whole dataset and keeps its part of every
        global batch: correct when every worker builds the same order, i.e. the input is not
        shuffled or shuffled with a seed, the same on every rank; an unseeded shuffle it can
        see gets a warning),
        ``"file"`` (each worker reads its own files; pass ``num_files``), or ``"off"`` (the
        dataset already is this worker's share, e.g. from :meth:`shard_files`). See
        :mod:`tfdist.sharding`.

        Raises:
            ConfigError: an unknown policy, or fewer files than workers.
        """
        from tfdist import sharding

        self.look_at_input(dataset, policy)
        return sharding.shard(dataset, self, policy, num_files=num_files)

    def look_at_input(self, dataset: Any, policy: str) -> None:
        """What every backend's :meth:`shard` learns from the dataset it splits: its global
        batch (for the throughput meter), one line on the chief about the split, and a warning
        when the dataset shuffles without a seed (each worker would shuffle its own way) or its
        last batch does not split evenly over the replicas."""
        from tfdist import patches, sharding, throughput
        from tfdist.replicas import batch_line

        self.sharded_batch_size = throughput.batch_size_of(dataset)
        if not self.is_chief or policy == "off":
            return
        if self.sharded_batch_size:
            line, odd = batch_line(self.sharded_batch_size, self.num_replicas,
                                   weighted=patches.is_planned(patches.ROWS_WEIGHTED))
            self._log_once(logging.WARNING if odd else logging.INFO, line)
        if self.world_size > 1 and sharding.unseeded_shuffle(dataset):
            self._log_once(logging.WARNING, sharding.UNSEEDED_SHUFFLE)
        self.look_at_last_batch(sharding.last_batch_rows(dataset))

    def look_at_last_batch(self, rows_left: int | None) -> None:
        """One warning on the chief when each epoch's last batch, of ``rows_left`` rows, does
        not split evenly over the replicas (:func:`tfdist.replicas.last_batch_line`)."""
        from tfdist import patches
        from tfdist.replicas import last_batch_line

        line = last_batch_line(rows_left or 0, self.num_replicas,
                               weighted=patches.is_planned(patches.ROWS_WEIGHTED))
        if line and self.is_chief:
            self._log_once(logging.WARNING, line)

    def _log_once(self, level: int, line: str) -> None:
        if (line, level) not in self._logged:
            self._logged.add((line, level))
            logger.log(level, "tfdist: %s", line)

    def shard_files(self, files: list[str]) -> list[str]:
        """This worker's share of ``files``; see :func:`tfdist.sharding.shard_files`."""
        from tfdist import sharding

        return sharding.shard_files(files, self.rank, self.world_size)

    def callbacks(self, *extra: Any, **options: Any) -> list[Any]:
        """Keras callbacks for distributed training; see :func:`tfdist.keras.callbacks.build`."""
        from tfdist.keras import callbacks

        return callbacks.build(self, *extra, **options)

    def save(self, model: Any, path: str) -> bool:
        """Saves ``model`` to ``path`` once, from the chief, atomically (``.keras``, ``.h5``,
        or a tf_keras SavedModel folder).

        Call it on every rank, e.g. after ``fit``: ``if dist.is_chief: model.save(...)`` can
        leave the other ranks a collective behind under MultiWorkerMirroredStrategy. See
        :func:`tfdist.keras.callbacks.save`.

        Returns:
            Whether this process wrote ``path``.
        """
        from tfdist.keras import callbacks

        return callbacks.save(self, model, path)

    def preemption(self, check_seconds: float | None = None, every: float | None = None) -> Any:
        """Watches for preemption signals and the walltime in a custom loop
        (:func:`tfdist.preemption.watch`; ``every``: seconds between safety saves, env
        ``TFDIST_CHECKPOINT_EVERY``)::

            position = dist.load_state(model_dir, model=model, optimizer=optimizer)
            with dist.preemption() as stop:
                for batch in dataset:
                    train_step(batch)
                    if stop.step():  # the same answer on every rank
                        dist.save_state(model_dir, {"epoch": e, "step": s},
                                        model=model, optimizer=optimizer)
                        dist.exit_preempted()
                    if stop.save_now:  # a safety save, every `every` seconds
                        dist.save_state(model_dir, {"epoch": e, "step": s},
                                        model=model, optimizer=optimizer)
                        stop.saved()
        """
        from tfdist import preemption

        return preemption.watch(self, check_seconds, every)

    def save_state(self, model_dir: str, position: dict[str, Any],
                   background: bool | None = None, **objects: Any) -> bool:
        """Saves a custom loop's ``objects`` and ``position`` in ``model_dir/preempted``, written
        once by the chief (:func:`tfdist.preemption.save_loop_state`; ``background``, default
        ``TFDIST_BACKGROUND_SAVES``: written by a thread of its own while the loop goes on).
        Call it on every rank."""
        from tfdist import ownership, preemption

        ownership.claim(self, model_dir)  # one run, a folder every rank sees (once)
        return preemption.save_loop_state(self, model_dir, position, background, **objects)

    def load_state(self, model_dir: str | None, **objects: Any) -> dict[str, Any] | None:
        """Restores :meth:`save_state`'s ``objects``; the saved position, or None on a first run
        (:func:`tfdist.preemption.load_loop_state`)."""
        from tfdist import ownership, preemption

        if model_dir:
            ownership.claim(self, model_dir)  # one run, a folder every rank sees (once)
        return preemption.load_loop_state(model_dir, strategy_scope=self.scope, **objects)

    def exit_preempted(self) -> NoReturn:
        """Requeues the Slurm job from the chief, waits for every rank and exits with 75
        (:func:`tfdist.preemption.exit_preempted`): call it on every rank after saving."""
        from tfdist import preemption

        preemption.exit_preempted(self)

    def gradient_tape(self, persistent: bool = False, compression: str | None = None) -> Any:
        """A ``tf.GradientTape`` for custom loops whose gradients are summed across replicas.

        Scale the loss by the GLOBAL batch (``tf.nn.compute_average_loss``). The default is a
        plain tape: inside ``strategy.run``, ``optimizer.apply_gradients`` sums.
        ``compression="fp16"`` applies under Horovod only (its ``Compression.fp16``); MWMS sums
        in the gradients' own type.
        """
        import tensorflow as tf

        del compression
        return tf.GradientTape(persistent=persistent)

    def reduce(self, op: str, value: Any) -> Any:
        """Reduces a per-replica ``value`` across all replicas: ``op`` is "sum" or "mean"."""
        return self.strategy.reduce(op.upper(), value, axis=None)

    def broadcast_initial_state(self, model: Any, optimizer: Any = None) -> None:
        """Copies rank 0's model and optimizer state to every rank (custom loops).

        Call it once after creating the model and optimizer, before the first step. A strategy
        that creates its variables in sync (MWMS) has nothing to do here.
        """
        del model, optimizer

    # --- what tfdist's own rooms call --------------------------------------------------------

    def backend_callbacks(self) -> list[Any]:
        """Callbacks the backend needs first in ``fit`` (Horovod: the broadcast from rank 0)."""
        return []

    def local_copies(self, variable: Any) -> list[Any]:
        """This process's copy of ``variable`` on each of its ``local_replicas`` replicas, for
        the replica sync check (:mod:`tfdist.sync`): the strategy's local results, or the one
        variable repeated where the process holds one copy for all."""
        from tfdist.keras.batch_statistics import as_tf_variable

        count = self.local_replicas
        if self.strategy is None:
            return [variable] * count
        results = self.strategy.experimental_local_results(as_tf_variable(variable))
        return list(results) if len(results) == count else [results[0]] * count

    def gather_rows(self, rows: np.ndarray, timeout_s: float) -> np.ndarray:
        """All replicas' rows, in rank order, the same table on every rank (a collective).

        Args:
            rows: ``int64``, shape ``(local_replicas, k)``: one row per replica of this process.
            timeout_s: how long to wait for the other ranks, where the backend can bound it.

        Returns:
            ``int64``, shape ``(num_replicas, k)``.

        Raises:
            TfdistError: a rank did not arrive within ``timeout_s``.
        """
        return rows  # one process: its rows are the table

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of ``values`` over all ranks, bit-identical on every rank.

        A collective of a few float32 numbers: every rank calls it at the same point with as
        many values. Agreements (a preemption, a check interval) are built on it.
        """
        return [float(v) for v in values]  # one process: its own values are the sum

    @property
    def label(self) -> str:
        """The engine and its collective, as the doctor and the logs name them
        (``"mwms ring"``, ``"horovod gloo"``)."""
        return f"{self.backend} {self.collective}"

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        """``tfdist doctor``'s all-reduce: a function that sums a float32 vector of ``n``
        copies of ``value`` over the ranks, over the transport training uses, and returns the
        first element of the sum (one process: ``value``)."""
        del n
        return lambda value=1.0: float(value)

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, on every rank, where the engine can gather Python objects;
        None where it cannot (the doctor then gathers its reports over its own TCP meeting)."""
        del obj
        return None

    def exit_barrier(self) -> None:
        """Returns once every rank has reached it, after which this process may end at once
        (``os._exit``): no peer still needs anything from it. Call it on every rank."""
        self.sum_over_ranks([0.0])

    def prepare_gather_rows(self, width: int, timeout_s: float) -> None:
        """Does the one-off work of :meth:`gather_rows` for ``width``-wide rows now (tracing),
        outside any timed step; runs no collective."""
        del width, timeout_s

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, "
                f"world_size={self.world_size}, local_rank={self.local_rank}, "
                f"collective={self.collective!r}, num_gpus={self.num_gpus}, "
                f"launcher={self.environment.launcher!r})")


def configure_threads(threads: int | None, local_processes: int = 1) -> None:
    """Applies :func:`tfdist.devices.affinity_thread_count` to TensorFlow's thread pools.

    A count tfdist derived (the user asked for none) is skipped where TensorFlow's runtime has
    already started (a script under Horovod that touched TensorFlow first): it keeps its
    defaults, as before."""
    count = affinity_thread_count(threads, local_processes, "TF_NUM_INTRAOP_THREADS")
    if count is None:
        return
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(count)
        tf.config.threading.set_inter_op_parallelism_threads(count)
    except RuntimeError:
        if threads is not None:
            raise
        logger.debug("tfdist: TensorFlow's runtime has started: its thread pools stay as they "
                     "are")


def split_cpu(tf: Any, replicas: int) -> list[str]:
    """Splits the CPU into ``replicas`` logical devices and returns their names.

    The GPU-free stand-in for several GPUs in one process (``TFDIST_CPU_REPLICAS``): the same
    strategy code paths, one replica per device, except NCCL.

    Raises:
        RuntimeError: TensorFlow's runtime already started (its message says "initialized").
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
    return [f"/cpu:{i}" for i in range(replicas)]


def check_not_initialised(environment: ClusterEnvironment) -> None:
    """Raises :func:`too_late` if TensorFlow's runtime already started.

    Raises:
        InitOrderError: something ran a TensorFlow op before tfdist.
    """
    from tensorflow.python.eager import context

    if context.context()._initialized:
        raise too_late(environment)


def too_late(environment: ClusterEnvironment) -> InitOrderError:
    """The error for a multi-worker set-up attempted after TensorFlow's runtime started."""
    return InitOrderError(
        f"TensorFlow's runtime was already initialised when tfdist set up {environment.world_size}"
        "-worker training. Something ran a TensorFlow op first: creating a tensor or a "
        "tf.data.Dataset, building or loading a Keras model, or tf.config.list_logical_devices(). "
        "Multi-worker collectives can only be configured before that. Fix: import tfdist "
        "before the first TensorFlow op (`from tfdist import strategy_scope` at the top: tfdist "
        "then starts at that op), or make `with tfdist.strategy_scope() as dist:` the first "
        "TensorFlow work in main(). Safe before it: imports, tf.random.set_seed, "
        "keras.utils.set_random_seed, tf.config.list_physical_devices.")
