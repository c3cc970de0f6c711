"""Splitting input across workers with an explicit policy, and the one check of that split.

TensorFlow's default (AUTO) shards file-backed datasets by FILE and silently falls back or hands
a worker nothing when there are fewer files than workers: the collectives then hang. tfdist
makes the policy explicit and checks the file count when files are split (:func:`check`, used by
every backend: MWMS sets tf.distribute's policy here, Horovod splits in
:mod:`tfdist.horovod.sharding`). Offline datasets are another room: :mod:`tfdist.datasets`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["GENERATOR", "LOADER_PROCESSES", "POLICIES", "UNSEEDED_SHUFFLE", "agree_on_arrays",
           "agree_on_sequences", "arrays_as_dataset", "arrays_rows_left", "check", "copying",
           "host_iterators", "is_arrays", "is_generator", "is_sequence", "last_batch_rows",
           "loader_threads", "own_copies", "own_generator_batches", "shard", "shard_files",
           "skip_end_checks", "unseeded_shuffle", "warn_about_arrays", "warn_once",
           "with_policy"]

logger = logging.getLogger("tfdist")

POLICIES = ("data", "file", "off")


def shard(dataset: Any, dist: Distributed, policy: str = "data", *,
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


def host_iterators() -> bool:
    """Reads each distributed dataset through a plain tf.data iterator on a worker whose one
    replica is its CPU. Once.

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
    ``TFDIST_INPUT_ITERATOR=tensorflow`` keeps it everywhere.

    Returns:
        Whether the plain iterators are installed.
    """
    from tfdist import patches
    from tfdist.settings import resolve

    if resolve("input_iterator") == "tensorflow":
        return False
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
        return False

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
    return True


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


SHUFFLE_SEED = 20251123  # the same on every rank, so that the ranks split one permutation


def arrays_as_dataset(arguments: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The ``fit`` arguments that turn in-memory arrays into one dataset every rank agrees on.

    Keras shuffles arrays with each process's own random state, so on several workers each
    splits a different permutation: some rows are trained twice an epoch and others never. Here
    the arrays become one dataset batched with the GLOBAL ``batch_size`` (default 32), shuffled
    each epoch the same way on every rank when ``shuffle`` is on (:data:`SHUFFLE_SEED`);
    ``validation_split`` takes the last rows before shuffling, as Keras does, and every rank
    validates on them. The backend splits every global batch (MWMS's DATA policy, Horovod's
    :func:`tfdist.horovod.sharding.shard`).

    Raises:
        ConfigError: the global batch does not divide over the ranks, or arguments that only
            apply to arrays are combined with others Keras would refuse.
    """
    import tensorflow as tf

    x, y = arguments["x"], arguments.get("y")
    weights = arguments.get("sample_weight")
    batch = arguments.get("batch_size") or 32
    if batch % world_size:
        raise ConfigError(f"fit(batch_size={batch}) is the GLOBAL batch and must divide over "
                          f"{world_size} ranks: use a multiple of {world_size}")
    rows = len(tf.nest.flatten(x)[0])
    split = float(arguments.get("validation_split") or 0.0)
    changed: dict[str, Any] = {"y": None, "sample_weight": None, "batch_size": None}
    if split:
        if arguments.get("validation_data") is not None:
            raise ConfigError("fit() got both validation_split and validation_data: pass one")
        cut = int(rows * (1.0 - split))
        changed["validation_data"] = tuple(
            tf.nest.map_structure(lambda a: a[cut:], v) for v in (x, y, weights)
            if v is not None)
        changed["validation_split"] = 0.0
        x, y, weights = (tf.nest.map_structure(lambda a: a[:cut], v) if v is not None else None
                         for v in (x, y, weights))
        rows = cut
    data = tuple(v for v in (x, y, weights) if v is not None)
    dataset = tf.data.Dataset.from_tensor_slices(data if len(data) > 1 else data[0])
    if arguments.get("shuffle", True):
        dataset = _agreed_shuffle(dataset, rows)
    changed["x"] = dataset.batch(batch)
    changed["shuffle"] = False
    return changed


def _agreed_shuffle(dataset: Any, rows: int) -> Any:
    """``dataset.shuffle(rows)``, reshuffled each epoch, in the same order on every rank.

    A seed given to ``shuffle`` is not enough: TensorFlow pairs it with the process's global
    seed (``tf.random.set_seed``, ``keras.utils.set_random_seed``), which scripts often set per
    rank. While the shuffle is made its two seeds are fixed (patch ``arrays-shuffle-seed``).
    """
    import tensorflow as tf
    from tensorflow.python.data.util import random_seed

    from tfdist import patches

    def fixed(original: Any) -> Any:
        def get_seed(seed: Any) -> tuple[Any, Any]:
            return (tf.constant(SHUFFLE_SEED, tf.int64), tf.constant(SHUFFLE_SEED + 1, tf.int64))

        return get_seed

    with patches.scoped("arrays-shuffle-seed", random_seed, "get_seed", fixed):
        return dataset.shuffle(rows, reshuffle_each_iteration=True)


def is_arrays(x: Any) -> bool:
    """Whether ``x`` (fit's first argument) is numpy arrays: one, or a list, tuple or dict."""
    import numpy as np
    import tensorflow as tf

    leaves = tf.nest.flatten(x) if isinstance(x, list | tuple | Mapping) else [x]
    return bool(leaves) and all(isinstance(leaf, np.ndarray) for leaf in leaves)


def arrays_rows_left(arguments: Mapping[str, Any]) -> int:
    """The rows of each epoch's last batch of ``fit``'s in-memory arrays when it is short, else
    0 (pure): the rows ``fit`` trains on (before ``validation_split``'s cut) modulo the global
    ``batch_size`` (default 32)."""
    leaf = arguments["x"]
    while isinstance(leaf, list | tuple | Mapping):
        leaf = next(iter(leaf.values() if isinstance(leaf, Mapping) else leaf))
    rows = len(leaf)
    split = float(arguments.get("validation_split") or 0.0)
    if split and arguments.get("validation_data") is None:
        rows = int(rows * (1.0 - split))
    return rows % (arguments.get("batch_size") or 32)


def agree_on_arrays(is_chief: bool = False, num_replicas: int = 1) -> None:
    """Under MultiWorkerMirroredStrategy, ``fit(x, y, shuffle=True)`` on arrays (Keras's
    default) trains one permutation that every worker agrees on, split by DATA, instead of each
    worker's own (:func:`arrays_as_dataset`); ``fit`` on a Python generator gets one warning on
    the chief (:data:`GENERATOR`), as do arrays whose last batch does not split evenly over
    the ``num_replicas`` replicas (:func:`tfdist.replicas.last_batch_line`). Once."""
    import tensorflow as tf

    from tfdist import patches

    def one_order(bound: Any) -> None:
        x = bound.arguments.get("x")
        loader_threads(bound.arguments, is_chief)
        if is_generator(x) and is_chief:
            warn_once(GENERATOR)
        if is_arrays(x) and is_chief:
            warn_about_arrays(bound.arguments, num_replicas)
        if bound.arguments.get("shuffle", True) and is_arrays(x):
            # world_size 1: MWMS splits any global batch, evenly or not
            bound.arguments.update(arrays_as_dataset(bound.arguments, 1))

    def wrap(original: Any) -> Any:
        return patches.rebinding(original, one_order)

    patches.apply("arrays-one-order", tf.keras.Model, "fit", wrap)


_warned: set[str] = set()

LOADER_PROCESSES = (
    "fit(use_multiprocessing=True) would fork Keras's loader processes from a process that runs "
    "the framework's and the collectives' threads: a forked loader can deadlock on a lock one of "
    "them held (seen: a worker stuck on a futex, the job hung), so on several workers the "
    "loaders run as threads (workers= kept). For CPU-heavy loading use a tf.data pipeline "
    "(dataset.map(..., num_parallel_calls=tf.data.AUTOTUNE)) through dist.shard")


def loader_threads(arguments: dict[str, Any], is_chief: bool) -> None:
    """``fit``'s loader processes become threads (:data:`LOADER_PROCESSES`, warned once on the
    chief): a Keras 3 ``PyDataset(use_multiprocessing=True)``, or tf_keras's
    ``fit(use_multiprocessing=True)``. Call it on several workers only."""
    x: Any = arguments.get("x")
    if getattr(x, "_use_multiprocessing", False):  # Keras 3's PyDataset
        x._use_multiprocessing = False
    elif arguments.get("use_multiprocessing"):  # tf_keras's fit argument
        arguments["use_multiprocessing"] = False
    else:
        return
    if is_chief:
        warn_once(LOADER_PROCESSES)


def warn_once(line: str) -> None:
    """``line`` as a tfdist warning, once a process."""
    if line not in _warned:
        _warned.add(line)
        logging.getLogger("tfdist").warning("tfdist: %s", line)


def warn_about_arrays(arguments: Mapping[str, Any], num_replicas: int) -> None:
    """One warning when ``fit``'s arrays end each epoch in a batch that does not split evenly
    over ``num_replicas`` replicas; call it on the chief."""
    from tfdist.replicas import last_batch_line

    line = last_batch_line(arrays_rows_left(arguments), num_replicas, arrays=True)
    if line:
        warn_once(line)


class _AgreedRandom:
    """Python's ``random`` module as Keras's sequence adapters see it: ``shuffle`` draws from one
    seeded stream, the same on every rank (each rank shuffles as often: once an epoch); all
    else is the module's."""

    def __init__(self, module: Any, seed: int) -> None:
        self._module, self._stream = module, module.Random(seed)

    def shuffle(self, items: Any) -> None:
        self._stream.shuffle(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _sequence_modules() -> list[Any]:
    """The modules of the installed Kerases that shuffle a PyDataset's (Keras 3) or a
    Sequence's (tf_keras) batches with Python's ``random``."""
    import importlib

    from tfdist.keras_compat import keras2_package

    found = []
    names = ["keras.src.trainers.data_adapters.py_dataset_adapter"]
    if keras2_package():
        names += [f"{keras2_package()}.src.engine.data_adapter",
                  f"{keras2_package()}.src.utils.data_utils"]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:  # Keras 2.12's layout, or no Keras 3 beside tf_keras
            continue
        if hasattr(module, "random"):
            found.append(module)
    return found


def agree_on_sequences() -> None:
    """``fit`` on a ``keras.utils.PyDataset`` (Keras 3) or ``Sequence`` (tf_keras) with
    ``shuffle=True`` (the default) takes its batches in one order every rank agrees on: Keras
    draws it from Python's ``random``, which each rank seeds its own way, and a split of each
    global batch over the workers is right only if every worker reads the same batch. Once."""
    from tfdist import patches

    for module in _sequence_modules():
        patches.apply("sequence-one-order", module, "random",
                      lambda original: _AgreedRandom(original, SHUFFLE_SEED))


def own_generator_batches() -> None:
    """Every element a ``tf.data.Dataset.from_generator`` generator yields (Keras's own, for a
    ``PyDataset``, a ``Sequence`` or a Python generator passed to ``fit``) reaches TensorFlow as
    a copy: TensorFlow takes numpy arrays without copying them, and once MWMS has split a global
    batch over the replicas an op of the step may write its result into a replica's part in
    place, that is into the arrays the batch was a view of (the user's labels, found
    overwritten on one worker after its first epoch). Once."""
    import tensorflow as tf

    from tfdist import patches

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def from_generator(generator: Any, *args: Any, **kwargs: Any) -> Any:
            return original(copying(generator) if callable(generator) else generator,
                            *args, **kwargs)

        return from_generator

    patches.apply("generator-copies", tf.data.Dataset, "from_generator", wrap)


def copying(generator: Any) -> Any:
    """``generator`` (a callable returning an iterator) whose every yielded element has its
    numpy arrays copied (:func:`own_copies`)."""
    @functools.wraps(generator)
    def copied(*args: Any) -> Any:
        for element in generator(*args):
            yield own_copies(element)

    return copied


def own_copies(element: Any) -> Any:
    """``element`` with every numpy array in it (nested in tuples, lists and dicts) replaced by
    a copy that owns its memory (pure)."""
    import numpy as np

    if isinstance(element, np.ndarray):
        return element.copy()
    if isinstance(element, Mapping):
        return {key: own_copies(value) for key, value in element.items()}
    if isinstance(element, tuple) and hasattr(element, "_fields"):  # a namedtuple
        return type(element)(*(own_copies(value) for value in element))
    if isinstance(element, list | tuple):
        return type(element)(own_copies(value) for value in element)
    return element


def is_sequence(x: Any) -> bool:
    """Whether ``x`` (fit's first argument) is a Keras 3 ``PyDataset`` or a tf_keras
    ``Sequence``: indexed batches that Keras reads (and shuffles) itself."""
    names = {cls.__name__ for cls in type(x).__mro__}
    return bool(names & {"PyDataset", "Sequence"}) and hasattr(x, "__getitem__")


def is_generator(x: Any) -> bool:
    """Whether ``x`` (fit's first argument) is a Python generator or iterator of batches."""
    import types

    return isinstance(x, types.GeneratorType) or (
        hasattr(x, "__next__") and hasattr(x, "__iter__") and not hasattr(x, "__getitem__")
        and "tensorflow" not in type(x).__module__)


GENERATOR = (
    "fit reads a Python generator on several workers: each worker runs its own copy, which "
    "must yield the same batches in the same order on every worker (each global batch is "
    "split over them), and under a strategy Keras takes the first batch to build the model "
    "without training it. For one process's numbers, pass a tf.data.Dataset through "
    "dist.shard or a keras.utils.PyDataset (its order is agreed over the ranks)")


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
