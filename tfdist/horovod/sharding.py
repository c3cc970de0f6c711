"""Splitting input by rank under Horovod, where no tf.distribute strategy does it.

The result per step matches MultiWorkerMirroredStrategy's: each rank trains on its part of every
GLOBAL batch, and every rank runs the same number of steps (a rank with one step more would wait
in its all-reduce for the others).
"""

from __future__ import annotations

from typing import Any

from tfdist import sharding
from tfdist.errors import ConfigError

__all__ = ["generator_slices", "sequence_slices", "shard", "whole"]


def shard(dataset: Any, rank: int, size: int, policy: str = "data", *,
          num_files: int | None = None) -> Any:
    """This rank's share of ``dataset``, batched with the GLOBAL batch size.

    Args:
        dataset: a batched ``tf.data.Dataset``.
        rank: this process's rank.
        size: the number of processes.
        policy: ``"data"``: rank r keeps the r-th contiguous slice of every global batch;
            ``"file"``: rank r reads every size-th file (``num_files`` required), and its global
            batches are split into batches of ``global / size``; ``"off"``: the dataset already
            is this rank's, only the batches are split.
        num_files: the number of files the dataset reads, with ``"file"``.

    Raises:
        ConfigError: an unknown policy, fewer files than ranks, or a batch that does not divide.
    """
    sharding.check(policy, num_files, size)
    if size == 1:
        return dataset
    if policy == "data":
        sliced = dataset.map(lambda *batch: _slice(batch, rank, size))
        sliced._tfdist_whole = dataset  # what predict reads: every row, as under MWMS
        return sliced
    if policy == "file":
        dataset = _file_shard(dataset, rank, size)
    return dataset.rebatch(_per_rank_batch(dataset, size))


def _slice(batch: tuple[Any, ...], rank: int, size: int) -> Any:
    import tensorflow as tf

    first = tf.nest.flatten(batch)[0]
    count = tf.shape(first)[0]
    per_rank = (count + size - 1) // size  # ceil: a short last batch leaves the last rank less
    start = tf.minimum(rank * per_rank, count)
    stop = tf.minimum(start + per_rank, count)
    sliced = tf.nest.map_structure(lambda t: t[start:stop], batch)
    return sliced if len(sliced) > 1 else sliced[0]


def _slice_arrays(batch: Any, rank: int, size: int) -> Any:
    """This rank's part of one global batch of numpy arrays, as :func:`_slice` takes it."""
    import tensorflow as tf

    count = len(tf.nest.flatten(batch)[0])
    per_rank = (count + size - 1) // size
    start = min(rank * per_rank, count)
    return tf.nest.map_structure(lambda a: a[start:start + per_rank], batch)


def sequence_slices(sequence: Any, rank: int, size: int) -> Any:
    """A Keras 3 ``PyDataset`` or tf_keras ``Sequence`` whose every batch is this rank's part of
    ``sequence``'s (its workers, queue, length and epoch hooks kept): the split
    MultiWorkerMirroredStrategy makes of each global batch. The ranks read the same batch at
    each step (:func:`tfdist.keras.fit_inputs.install_sequence_one_order`)."""
    base = next(c for c in type(sequence).__mro__ if c.__name__ in ("PyDataset", "Sequence"))

    class RankSlices(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            if base.__name__ == "PyDataset":
                super().__init__(workers=sequence.workers,
                                 use_multiprocessing=sequence.use_multiprocessing,
                                 max_queue_size=sequence.max_queue_size)

        def __len__(self) -> int:
            return len(sequence)

        def __getitem__(self, index: int) -> Any:
            return _slice_arrays(sequence[index], rank, size)

        @property
        def num_batches(self) -> Any:
            return getattr(sequence, "num_batches", len(sequence))

        def on_epoch_begin(self) -> None:
            getattr(sequence, "on_epoch_begin", lambda: None)()

        def on_epoch_end(self) -> None:
            sequence.on_epoch_end()

    return RankSlices()


def generator_slices(generator: Any, rank: int, size: int) -> Any:
    """This rank's part of each batch ``generator`` yields."""
    return (_slice_arrays(batch, rank, size) for batch in generator)


def _file_shard(dataset: Any, rank: int, size: int) -> Any:
    import tensorflow as tf
    from tensorflow.python.distribute import input_ops

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return input_ops.auto_shard_dataset(dataset.with_options(options), size, rank, size)


def _per_rank_batch(dataset: Any, size: int) -> int:
    from tensorflow.python.data.experimental.ops.distribute import compute_batch_size

    batch = int(compute_batch_size(dataset))
    if batch < 1:
        raise ConfigError("cannot find the dataset's batch size to split it over the ranks: "
                          "batch it with the GLOBAL batch size (dataset.batch(n)) before shard()")
    if batch % size:
        raise ConfigError(f"global batch size {batch} does not divide over {size} ranks: use a "
                          f"multiple of {size}")
    return batch // size


def whole(dataset: Any) -> Any:
    """The dataset :func:`shard` split by DATA, before the split; None for any other."""
    return getattr(dataset, "_tfdist_whole", None)
