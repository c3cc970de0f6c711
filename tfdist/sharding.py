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
    from tfdist.handle import Handle

__all__ = ["POLICIES", "UNSEEDED_SHUFFLE", "check", "last_batch_rows", "shard", "shard_files",
           "unseeded_shuffle", "with_policy"]


POLICIES = ("data", "file", "off")


def shard(dataset: Any, dist: Handle, policy: str = "data", *,
          num_files: int | None = None) -> Any:
    """Tells the strategy how to split ``dataset`` (batched with the GLOBAL batch size).

    Args:
        dataset: a ``tf.data.Dataset``.
        dist: the handle from :func:`tfdist.init`.
        policy: ``"data"`` (default: every worker reads all input and keeps every N-th
            element; correct when every worker reads it in the same order: not shuffled, or
            shuffled with a seed that is the same on every rank), ``"file"`` (each worker
            reads its own files; pass ``num_files``), or ``"off"`` (the dataset is already
            this worker's share, e.g. built from :func:`shard_files`).
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


UNSEEDED_SHUFFLE = (
    "the dataset given to dist.shard shuffles without a seed (`shuffle(n)` with neither `seed=` "
    "nor tf.random.set_seed): each worker shuffles its own way, so the split trains some rows "
    "twice an epoch and others never. Give the shuffle a seed, the same on every rank "
    "(`shuffle(n, seed=S)`, or tf.random.set_seed(S) before building the dataset)")


def unseeded_shuffle(dataset: Any, depth: int = 64) -> bool:
    """Whether ``dataset`` or one it reads from shuffles with no seed at all: TensorFlow then
    draws a new order in every process (its seeds are (0, 0), which no seed given ever makes).
    Walks the pipeline's Python objects, never its graph (which would hold the arrays of
    ``from_tensor_slices``); a shuffle it cannot see (in a function, an interleave) is not
    found (pure, until a dataset is passed)."""
    seen: set[int] = set()
    stack = [dataset]
    while stack and len(seen) < depth:
        found = stack.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if "Shuffle" in type(found).__name__ and _no_seed(found):
            return True
        stack.append(getattr(found, "_input_dataset", None))
        for several in ("_input_datasets", "_datasets"):  # concatenate; zip (nested)
            stack.extend(_flatten(getattr(found, several, None)))
    return False


def last_batch_rows(dataset: Any, depth: int = 100) -> int | None:
    """The rows of each epoch's last batch when it is short, 0 when none is (a batch that
    divides its input, or ``drop_remainder``), ``None`` when that is not known: no constant
    ``batch``, or an input of unknown or infinite length. Follows the chain back from
    ``dataset`` to its first ``batch``, as the throughput meter does (pure, until a dataset is
    passed)."""
    for _ in range(depth):
        if dataset is None:
            return None
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            break
        dataset = getattr(dataset, "_input_dataset", None)
    else:
        return None
    try:
        batch = int(size.numpy() if hasattr(size, "numpy") else size)
        drop = getattr(dataset, "_drop_remainder", False)
        if bool(drop.numpy() if hasattr(drop, "numpy") else drop):
            return 0
        rows = int(dataset._input_dataset.cardinality())
    except (AttributeError, TypeError, ValueError):
        return None
    return rows % batch if rows >= 0 and batch > 0 else None


def _no_seed(shuffle: Any) -> bool:
    seeds = [getattr(shuffle, name, 1) for name in ("_seed", "_seed2")]
    return all(seed is None or int(seed) == 0 for seed in seeds)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _flatten(item)]
    return [] if value is None else [value]
