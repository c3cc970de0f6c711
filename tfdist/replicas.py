"""What every handle, TensorFlow's, JAX's and torch's, computes the same way, and the
one-per-process cache that holds it.

Vocabulary (the same in every module of tfdist and in docs/architecture.md):

- **rank**: this process's index among all processes, 0-based; **world_size**: how many
  processes train together; **local_rank**: the index among the processes on this node;
  **chief**: rank 0, which writes checkpoints, logs and progress.
- **replica**: one copy of the model that trains on its share of each global batch; a process
  drives one replica per GPU it uses under MWMS and mirrored, one under Horovod and torch (on
  CPU one, or ``TFDIST_CPU_REPLICAS``). **num_replicas** counts them across the job,
  **local_replicas** in this process.
- **backend**: the engine that keeps the replicas in sync, one row of
  :mod:`tfdist.backend_facts`: ``mwms`` (MultiWorkerMirroredStrategy), ``horovod``,
  ``mirrored`` (one process, several devices), ``single`` (one process), ``jax`` (Keras 3 on
  JAX); torch's ``ddp``, ``horovod`` and ``deepspeed``.
- **collective**: how a backend moves tensors between processes: ``ring`` or ``nccl`` for
  MWMS, ``nccl`` or ``local`` for mirrored, Horovod's controller ``gloo`` or ``mpi``, JAX's
  ``gloo`` on CPUs or ``nccl`` on GPUs, ``gloo`` or ``nccl`` for a torch process group, ``none``
  for one process.
- **launcher**: what started the processes, one row of :mod:`tfdist.env.launchers`
  (:class:`tfdist.env.ClusterEnvironment`'s ``launcher``).

Pure: no framework is imported here.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from tfdist.errors import ConfigError

__all__ = ["HandleCache", "ReplicaMath", "batch_line", "last_batch_line", "split_batch"]


def split_batch(global_batch_size: int, replicas: int) -> int:
    """Each replica's share of a global batch.

    Raises:
        ConfigError: the global batch does not divide evenly, naming the nearest that does.
    """
    if global_batch_size % replicas:
        nearest = max(replicas, global_batch_size // replicas * replicas)
        raise ConfigError(f"global batch size {global_batch_size} does not divide over "
                          f"{replicas} replicas: use a multiple of {replicas}, e.g. {nearest}")
    return global_batch_size // replicas


class ReplicaMath:
    """The arithmetic of a handle with ``rank``, ``world_size`` and ``num_replicas``.

    Subclasses provide those three; everything here follows from them.
    """

    rank: int
    world_size: int
    num_replicas: int

    @property
    def size(self) -> int:
        """Same as :attr:`world_size` (Horovod's name, kept for scripts written for it)."""
        return self.world_size

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints, logs and progress (rank 0)."""
        return self.rank == 0

    def scale_lr(self, learning_rate: float) -> float:
        """Linear scaling: ``learning_rate`` times the number of replicas (Goyal et al., 2017).

        Pair it with a warmup that ramps up from the unscaled rate.
        """
        from tfdist.verify import replicas_for_scaling  # tfdist verify's one-process run

        return learning_rate * replicas_for_scaling(self.num_replicas)

    def per_replica_batch_size(self, global_batch_size: int) -> int:
        """Splits a global batch over the replicas.

        Raises:
            ConfigError: the global batch does not divide evenly.
        """
        return split_batch(global_batch_size, self.num_replicas)

    def global_batch_size(self, per_replica_batch_size: int) -> int:
        """The global batch that gives each replica ``per_replica_batch_size`` examples."""
        return per_replica_batch_size * self.num_replicas


_Handle = TypeVar("_Handle")


class HandleCache(Generic[_Handle]):
    """The one handle of a process and the settings it was created with.

    A strategy or process group can be created once per process: asking again with the same
    settings returns the same handle; other settings are an error that shows both.

    Args:
        what: the name in messages, e.g. ``"tfdist"`` or ``"tfdist.torch"``.
        how_to_switch: appended to the error, e.g. ``"; call shutdown() first"``.
    """

    def __init__(self, what: str, how_to_switch: str = "") -> None:
        self.what, self.how_to_switch = what, how_to_switch
        self.handle: _Handle | None = None
        self.settings: Any = None

    def get(self, settings: Any) -> _Handle | None:
        """The cached handle if it was created with ``settings``; None if there is none.

        Raises:
            ConfigError: a handle exists with other settings.
        """
        if self.handle is not None and settings != self.settings:
            raise ConfigError(f"{self.what} is already initialised with {self.settings} in this "
                              f"process; it cannot switch to {settings}{self.how_to_switch}")
        return self.handle

    def put(self, handle: _Handle, settings: Any) -> _Handle:
        """Caches ``handle``, created with ``settings``, and returns it."""
        self.handle, self.settings = handle, settings
        return handle

    def clear(self) -> _Handle | None:
        """Forgets the handle and returns it."""
        handle, self.handle, self.settings = self.handle, None, None
        return handle


def batch_line(global_batch: int, num_replicas: int, *, weighted: bool = False
               ) -> tuple[str, bool]:
    """The line ``dist.shard`` logs on the chief about the batch it splits, and whether it is a
    warning: the batch cannot be split evenly over the replicas (a per-worker batch, or every
    step's shares unequal) and ``fit`` does not weigh each replica's loss by its rows
    (``weighted``: tfdist's Keras 3 loss scaling does, which makes such a step one process's)
    (pure).

    A per-worker batch that happens to split evenly (``ds.batch(64 // world_size)``) cannot be
    told from a small global one: the line shows the per-replica batch, so the numbers say it.
    """
    each, left = divmod(global_batch, num_replicas)
    if num_replicas == 1:
        return f"global batch {global_batch}, one replica", False
    if left == 0:
        return (f"global batch {global_batch} = {each} per replica x {num_replicas} "
                "replicas (dist.shard splits the dataset's batch)"), False
    lower, upper = each * num_replicas, (each + 1) * num_replicas
    divides = " or ".join(str(b) for b in (lower, upper) if b)
    if weighted and each:
        return (f"global batch {global_batch} = {each} or {each + 1} per replica x "
                f"{num_replicas} replicas: fit weighs each replica's loss by its rows, so "
                "every step is one process's; a loss you average by hand (a custom loop, "
                "ops.mean in a train_step) weighs the replicas equally: there pick a global "
                f"batch that {num_replicas} divides ({divides})"), False
    return (f"global batch {global_batch} does not split over {num_replicas} replicas "
            f"({'some get no examples' if each == 0 else f'{each} or {each + 1} each'}): on "
            "every step the replicas' unequal shares are averaged with equal weights, so no "
            "step's gradient is one process's. If it is the batch per worker, batch the "
            f"dataset with the GLOBAL batch size, per-replica batch x {num_replicas} "
            "(dist.global_batch_size(n)), which dist.shard splits; else pick a global batch "
            f"that {num_replicas} divides ({divides})"), True


def last_batch_line(rows_left: int, num_replicas: int, *, arrays: bool = False,
                    weighted: bool = False) -> str | None:
    """The warning for an epoch whose last batch (``rows_left`` rows; 0: none short) does not
    split evenly over the replicas, or ``None`` (pure). ``arrays``: the input is ``fit``'s
    in-memory arrays, whose fix is a number of rows, not ``drop_remainder``. ``weighted``:
    ``fit`` weighs each replica's loss by its rows (see :func:`batch_line`), which makes that
    step one process's: no warning (a BatchNormalization model that would leave a replica
    without rows is refused by ``fit`` itself).

    Each replica's loss is the mean over its own rows, and the replicas' gradients are averaged
    with equal weights: with unequal shares that step's gradient is not one process's (2
    replicas, rows [2, 1]: the lone row weighs twice). A replica with no rows at all gives
    BatchNormalization an empty batch, whose statistics (then every weight) become NaN.
    """
    if weighted or rows_left <= 0 or num_replicas <= 1 or rows_left % num_replicas == 0:
        return None
    each, more = divmod(rows_left, num_replicas)
    shares = (f"{more} replica(s) get {each + 1} rows, the others {each}" if each else
              f"{num_replicas - more} of the {num_replicas} replicas get no rows")
    empty = (", and BatchNormalization's statistics on an empty replica, then every weight, "
             "become NaN" if not each else "")
    fix = ("Pass a number of rows that the global batch divides (x[:len(x) // batch_size * "
           "batch_size])" if arrays else "Batch with drop_remainder=True")
    trains, note = ("", "") if arrays else (
        "if fit trains on it, ", " (evaluate's and predict's numbers are)")
    return (f"each epoch's last batch holds {rows_left} rows, which do not split evenly over "
            f"{num_replicas} replicas ({shares}): {trains}that step's gradient is not one "
            f"process's{empty}{note}. {fix}, or pick a global batch that divides the rows")
