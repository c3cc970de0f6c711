"""Splitting input across workers with an explicit policy.

TensorFlow's default (AUTO) shards file-backed datasets by FILE and silently falls back or hands
a worker nothing when there are fewer files than workers: the collectives then hang. tfdist
makes the policy explicit and checks the file count when files are split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.strategy import Distributed

__all__ = ["POLICIES", "shard", "shard_files", "split_batch", "with_policy"]

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
    if policy not in POLICIES:
        raise ConfigError(f"shard policy {policy!r} is not one of {POLICIES}")
    if policy == "file":
        if num_files is None:
            raise ConfigError("shard(policy='file') needs num_files= so that tfdist can check "
                              "every worker gets a file; or use policy='data'")
        _check_enough_files(num_files, dist.size)
    return with_policy(dataset, policy)


def with_policy(dataset: Any, policy: str) -> Any:
    """``dataset`` with tf.distribute's auto-shard policy set to ``policy`` (one of POLICIES)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy.upper())
    return dataset.with_options(options)


def shard_files(files: Sequence[str], rank: int, size: int) -> list[str]:
    """This worker's files, ``files[rank::size]``; build the dataset and ``shard(policy="off")``.

    Raises:
        ConfigError: fewer files than workers (some worker would get none and hang the job).
    """
    _check_enough_files(len(files), size)
    return list(files[rank::size])


def _check_enough_files(num_files: int, size: int) -> None:
    if num_files < size:
        raise ConfigError(f"{num_files} input file(s) for {size} workers: at least one worker "
                          "would get no data and the collectives would hang. Split the data "
                          f"into >= {size} files, or shard by element with policy='data'")


def split_batch(global_batch_size: int, replicas: int) -> int:
    """Each replica's share of a global batch (TensorFlow and PyTorch handles alike).

    Raises:
        ConfigError: the global batch does not divide evenly, naming the nearest that does.
    """
    if global_batch_size % replicas:
        nearest = max(replicas, global_batch_size // replicas * replicas)
        raise ConfigError(f"global batch size {global_batch_size} does not divide over "
                          f"{replicas} replicas: use a multiple of {replicas}, e.g. {nearest}")
    return global_batch_size // replicas
