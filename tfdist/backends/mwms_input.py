"""MWMS's distributed input, made cheaper where it provably changes nothing.

The per-step collective that asks whether every worker still has a batch is dropped for a
dataset split by DATA with a constant batch (:func:`install_input_end_check`, patch
``input-end-check``), and a CPU worker with one replica reads a plain tf.data iterator instead of
a multi-device one (:func:`install_host_input_iterator`, patch ``host-input-iterator``).
``TFDIST_SKIP_PATCHES`` leaves either out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["install_host_input_iterator", "install_input_end_check"]

logger = logging.getLogger("tfdist")


def install_input_end_check(where: Where, dist: Any) -> None:
    """Patch ``input-end-check``'s installer (:func:`tfdist.patches.install`): drops
    tf.distribute's per-step end-of-data check where it cannot matter. Once.

    On several workers a distributed iterator draws each batch with ``get_next_as_optional``
    and all-reduces whether every worker still has one, so that a worker whose shard ran out
    does not leave the others in a collective: one collective per step (about 1.2 ms on
    loopback gRPC, as much as the gradients'). Where the dataset is split by DATA and
    tf.distribute can rebatch it (``compute_batch_size`` finds its constant batch size), every
    worker gets exactly one minibatch of every global batch (an empty one past the rows): the
    same number of steps, so the check is dropped for that dataset. Every other dataset (FILE
    or AUTO sharding, no constant batch, ``distribute_datasets_from_function``) keeps it.
    ``TFDIST_SKIP_PATCHES=input-end-check`` keeps it everywhere.
    """
    from tensorflow.python.distribute import input_lib

    from tfdist import patches

    def wrap(build: Any) -> Any:
        def build_without_needless_check(self: Any, dataset_to_replace: Any = None) -> Any:
            result = build(self, dataset_to_replace)
            dataset = dataset_to_replace or getattr(self, "_original_dataset", None)
            if self._enable_get_next_as_optional and _same_steps_on_every_worker(dataset):
                self._enable_get_next_as_optional = False
            return result

        return build_without_needless_check

    patches.apply("input-end-check", input_lib.DistributedDataset, "build", wrap)


def install_host_input_iterator(where: Where, dist: Any) -> None:
    """Patch ``host-input-iterator``'s installer: reads each distributed dataset through a
    plain tf.data iterator on a worker whose one replica is its CPU. Once.

    ``experimental_distribute_dataset`` (Keras's ``fit``, ``evaluate`` and ``predict``, a custom
    loop's) gives every worker a multi-device iterator: a thread that copies the next batches
    to the worker's devices ahead of its steps. Where the one replica is the host's CPU there
    is nothing to copy, and the iterator costs every epoch: it is made anew, and freeing it
    waits for its thread on the training thread (2 workers of a small MLP: 0.8 s an epoch
    beyond the steps, against 77 ms with a plain iterator and 6 ms in one process;
    docs/performance.md). TensorFlow reads through a plain iterator when a dataset stays on
    the host and is replicated per replica (``InputOptions(experimental_fetch_to_device=False,
    experimental_replication_mode=PER_REPLICA)``), which MultiWorkerMirroredStrategy accepts
    only from ``distribute_datasets_from_function``: here the strategy's own distribution runs
    with those options. The batches, the sharding, the rebatching and the end-of-data checks
    are the strategy's. GPU workers, several CPU replicas (``TFDIST_CPU_REPLICAS``) and a
    dataset distributed with options of your own keep TensorFlow's iterator;
    ``TFDIST_SKIP_PATCHES=host-input-iterator`` keeps it everywhere. A TensorFlow without
    what it hooks keeps it too (logged).
    """
    from tfdist import patches

    try:
        from tensorflow.python.distribute import collective_all_reduce_strategy as mwms
        from tensorflow.python.distribute import distribute_lib, input_util

        extended = mwms.CollectiveAllReduceExtended
        for name in ("_experimental_distribute_dataset", "_make_input_context",
                     "_input_workers_with_options"):
            getattr(extended, name)
        per_replica = distribute_lib.InputReplicationMode.PER_REPLICA
    except (ImportError, AttributeError) as error:
        logger.info("tfdist: MWMS reads datasets through TensorFlow's multi-device iterators "
                    "on this TensorFlow (%s)", error)
        return

    def wrap(original: Any) -> Any:
        def distribute_dataset(self: Any, dataset: Any, options: Any) -> Any:
            if options is not None or not _one_cpu_replica(self.worker_devices):
                return original(self, dataset, options)
            options = distribute_lib.InputOptions(experimental_fetch_to_device=False,
                                                  experimental_replication_mode=per_replica)
            return input_util.get_distributed_dataset(
                dataset, self._input_workers_with_options(options), self._container_strategy(),
                num_replicas_in_sync=self._num_replicas_in_sync,
                input_context=self._make_input_context(), options=options)

        return distribute_dataset

    patches.apply("host-input-iterator", extended, "_experimental_distribute_dataset", wrap)


def _one_cpu_replica(devices: Sequence[str]) -> bool:
    """Whether a worker's replica devices are one CPU (pure)."""
    return len(devices) == 1 and devices[0].upper().rsplit("/", 1)[-1].startswith(
        ("DEVICE:CPU:", "CPU:"))


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
