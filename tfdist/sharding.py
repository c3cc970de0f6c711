"""Splitting input across workers with an explicit policy, and the one check of that split.

TensorFlow's default (AUTO) shards file-backed datasets by FILE and silently falls back or hands
a worker nothing when there are fewer files than workers: the collectives then hang. tfdist
makes the policy explicit and checks the file count when files are split (:func:`check`, used by
every backend: MWMS sets tf.distribute's policy here, Horovod splits in
:mod:`tfdist.horovod.sharding`). Offline datasets are another room: :mod:`tfdist.datasets`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["POLICIES", "check", "shard", "shard_files", "skip_end_checks", "with_policy"]

POLICIES = ("data", "file", "off")


def shard(dataset: Any, dist: Distributed, policy: str = "data", *,
          num_files: int | None = None) -> Any:
    """Tells the strategy how to split ``dataset`` (batched with the GLOBAL batch size).

    Args:
        dataset: a ``tf.data.Dataset``.
        dist: the handle from :func:`tfdist.init`.
        policy: ``"data"`` (default: every worker reads all input and keeps every N-th
            element; always correct), ``"file"`` (each worker reads its own files; pass
            ``num_files``), or ``"off"`` (the dataset is already this worker's share, e.g.
            built from :func:`shard_files`).
        num_files: how many files the dataset reads, required with ``"file"`` so that no
            worker is left without data.

    Returns:
        The dataset with the sharding option set.

    Raises:
        ConfigError: an unknown policy, or fewer files than workers.
    """
    check(policy, num_files, dist.world_size)
    return with_policy(dataset, policy)


def check(policy: str, num_files: int | None, world_size: int) -> None:
    """Refuses a split that would leave a worker without data.

    Raises:
        ConfigError: an unknown policy, ``"file"`` without ``num_files``, or fewer files than
            workers.
    """
    if policy not in POLICIES:
        raise ConfigError(f"shard policy {policy!r} is not one of {POLICIES}")
    if policy == "file":
        if num_files is None:
            raise ConfigError("shard(policy='file') needs num_files= so that tfdist can check "
                              "every worker gets a file; or use policy='data'")
        _check_enough_files(num_files, world_size)


def with_policy(dataset: Any, policy: str) -> Any:
    """``dataset`` with tf.distribute's auto-shard policy set to ``policy`` (one of POLICIES)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy.upper())
    return dataset.with_options(options)


def shard_files(files: Sequence[str], rank: int, world_size: int) -> list[str]:
    """This worker's files, ``files[rank::size]``; build the dataset and ``shard(policy="off")``.

    Raises:
        ConfigError: fewer files than workers (some worker would get none and hang the job).
    """
    _check_enough_files(len(files), world_size)
    return list(files[rank::world_size])


def _check_enough_files(num_files: int, world_size: int) -> None:
    if num_files < world_size:
        raise ConfigError(f"{num_files} input file(s) for {world_size} workers: at least one "
                          "worker would get no data and the collectives would hang. Split the "
                          f"data into >= {world_size} files, or shard by element with "
                          "policy='data'")


def skip_end_checks() -> bool:
    """Drops tf.distribute's per-step end-of-data check where it cannot matter. Once.

    On several workers a distributed iterator draws each batch with ``get_next_as_optional``
    and all-reduces whether every worker still has one, so that a worker whose shard ran out
    does not leave the others in a collective: one collective per step (about 1.2 ms on
    loopback gRPC, as much as the gradients'). Where the dataset is split by DATA and
    tf.distribute can rebatch it (``compute_batch_size`` finds its constant batch size), every
    worker gets exactly one minibatch of every global batch (an empty one past the rows): the
    same number of steps, so the check is dropped for that dataset. Every other dataset (FILE
    or AUTO sharding, no constant batch, ``distribute_datasets_from_function``) keeps it.
    ``TFDIST_INPUT_END_CHECK=always`` keeps it everywhere.

    Returns:
        Whether the fast path is installed.
    """
    from tensorflow.python.distribute import input_lib

    from tfdist import patches
    from tfdist.settings import resolve

    if resolve("input_end_check") == "always":
        return False

    def wrap(build: Any) -> Any:
        def build_without_needless_check(self: Any, dataset_to_replace: Any = None) -> Any:
            result = build(self, dataset_to_replace)
            dataset = dataset_to_replace or getattr(self, "_original_dataset", None)
            if self._enable_get_next_as_optional and _same_steps_on_every_worker(dataset):
                self._enable_get_next_as_optional = False
            return result

        return build_without_needless_check

    patches.apply("input-end-check", input_lib.DistributedDataset, "build", wrap)
    return True


def _same_steps_on_every_worker(dataset: Any) -> bool:
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute

    if dataset is None or not tf.executing_eagerly():
        return False
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy != tf.data.experimental.AutoShardPolicy.DATA:
        return False
    try:
        return int(distribute.compute_batch_size(dataset)) > 0
    except (tf.errors.OpError, ValueError, TypeError, IndexError):  # scalars: no batch
        return False
