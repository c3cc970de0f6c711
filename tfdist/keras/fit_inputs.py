"""``fit``'s own inputs on several processes: one order and one split on every rank.

In-memory arrays shuffled by Keras with each rank's random state become one dataset shuffled
the same way everywhere (:func:`install_arrays_one_order`, patch ``arrays-one-order``, with
:func:`fixed_shuffle_seed`, ``arrays-shuffle-seed``, for each such shuffle); a PyDataset's
shuffled batches come from one seeded stream (:func:`install_sequence_one_order`,
``sequence-one-order``); a generator's elements are copied before a split batch can be written
in place (:func:`install_generator_copies`, ``generator-copies``); forked loader processes
become threads. The sharding policy itself is :mod:`tfdist.sharding`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["GENERATOR", "LOADER_PROCESSES", "SHUFFLE_SEED", "arrays_as_dataset",
           "arrays_rows_left", "copying", "fixed_shuffle_seed", "install_arrays_one_order",
           "install_generator_copies", "install_sequence_one_order", "is_arrays", "is_generator",
           "is_sequence", "loader_threads", "own_copies", "warn_about_arrays", "warn_once"]


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
    data = tuple(_as_structure(v) for v in (x, y, weights) if v is not None)
    dataset = tf.data.Dataset.from_tensor_slices(data if len(data) > 1 else data[0])
    if arguments.get("shuffle", True) and rows > 0:  # no rows: fit warns and ends, as alone
        dataset = _agreed_shuffle(dataset, rows)
    changed["x"] = dataset.batch(batch)
    changed["shuffle"] = False
    return changed


def _as_structure(value: Any) -> Any:
    """A list of arrays (``fit(x, [y1, y2])``: one per output) as the tuple Keras reads it;
    tf.data would read a list as one tensor and fail on arrays of different shapes."""
    if isinstance(value, list):
        return tuple(_as_structure(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_structure(v) for k, v in value.items()}
    return value


def _agreed_shuffle(dataset: Any, rows: int) -> Any:
    """``dataset.shuffle(rows)``, reshuffled each epoch, in the same order on every rank.

    A seed given to ``shuffle`` is not enough: TensorFlow pairs it with the process's global
    seed (``tf.random.set_seed``, ``keras.utils.set_random_seed``), which scripts often set per
    rank. While the shuffle is made its two seeds are fixed (:func:`fixed_shuffle_seed`).
    """
    with fixed_shuffle_seed():
        return dataset.shuffle(rows, reshuffle_each_iteration=True)


@contextlib.contextmanager
def fixed_shuffle_seed() -> Iterator[None]:
    """Patch ``arrays-shuffle-seed``'s installer (phase ``call``: inside the wrapper of
    ``arrays-one-order``, ``horovod-fit`` or ``jax-inputs-by-rank``): while the block runs,
    every tf.data op's two seeds are :data:`SHUFFLE_SEED`'s, where the process's plan holds the
    row (:func:`tfdist.patches.planned_here`)."""
    from tfdist import patches

    if not patches.planned_here("arrays-shuffle-seed"):
        yield
        return
    import tensorflow as tf
    from tensorflow.python.data.util import random_seed

    def fixed(original: Any) -> Any:
        def get_seed(seed: Any) -> tuple[Any, Any]:
            return (tf.constant(SHUFFLE_SEED, tf.int64), tf.constant(SHUFFLE_SEED + 1, tf.int64))

        return get_seed

    with patches.scoped("arrays-shuffle-seed", random_seed, "get_seed", fixed):
        yield


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


def install_arrays_one_order(where: Where, dist: Any) -> None:
    """Patch ``arrays-one-order``'s installer: under MultiWorkerMirroredStrategy,
    ``fit(x, y, shuffle=True)`` on arrays (Keras's default) trains one permutation that every
    worker agrees on, split by DATA, instead of each worker's own (:func:`arrays_as_dataset`);
    ``fit`` on a Python generator gets one warning on the chief (:data:`GENERATOR`), as do
    arrays whose last batch does not split evenly over the replicas
    (:func:`tfdist.replicas.last_batch_line`). Once."""
    import tensorflow as tf

    from tfdist import patches

    is_chief, num_replicas = bool(dist.is_chief), int(dist.num_replicas)

    def one_order(bound: Any) -> None:
        x = bound.arguments.get("x")
        loader_threads(bound.arguments, is_chief)
        if is_generator(x) and is_chief:
            warn_once(GENERATOR)
        if is_arrays(x) and is_chief:
            warn_about_arrays(bound.arguments, num_replicas)
        if bound.arguments.get("shuffle", True) and is_sequence(x) and is_chief:
            warn_once(SEQUENCE_ORDER)
        if bound.arguments.get("shuffle", True) and is_arrays(x):
            if is_chief:
                warn_once(ARRAYS_ORDER)
            # world_size 1: MWMS splits any global batch, evenly or not
            bound.arguments.update(arrays_as_dataset(bound.arguments, 1))

    def wrap(original: Any) -> Any:
        return patches.rebinding(original, one_order)

    patches.apply("arrays-one-order", tf.keras.Model, "fit", wrap)


_warned: set[str] = set()

SEQUENCE_ORDER = (
    "fit shuffles your PyDataset's batches with one seeded stream every rank shares (Keras "
    "would shuffle with each rank's own Python random), not Keras's order in one process: "
    "every batch once an epoch, in another order than one process's. For one process's order: "
    "shuffle=False (shuffle inside your PyDataset with a seed), or a tf.data pipeline through "
    "dist.shard")

ARRAYS_ORDER = (
    "fit shuffles your arrays with one permutation every rank agrees on (Keras would shuffle "
    "with each rank's own random state), not the one Keras draws in one process: every row "
    "once an epoch, in another order than one process's, so the numbers differ from one "
    "process's by the order only. For one process's order: shuffle=False, or a tf.data "
    "pipeline with a seeded shuffle through dist.shard")


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
    from tfdist import patches
    from tfdist.replicas import last_batch_line

    line = last_batch_line(arrays_rows_left(arguments), num_replicas, arrays=True,
                           weighted=patches.is_planned(patches.ROWS_WEIGHTED))
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

    from tfdist.keras.versions import keras2_package

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


def install_sequence_one_order(where: Where, dist: Any) -> None:
    """Patch ``sequence-one-order``'s installer: ``fit`` on a ``keras.utils.PyDataset`` (Keras
    3) or ``Sequence`` (tf_keras) with ``shuffle=True`` (the default) takes its batches in one
    order every rank agrees on: Keras draws it from Python's ``random``, which each rank seeds
    its own way, and a split of each global batch over the workers is right only if every
    worker reads the same batch. Once."""
    from tfdist import patches

    for module in _sequence_modules():
        patches.apply("sequence-one-order", module, "random",
                      lambda original: _AgreedRandom(original, SHUFFLE_SEED))


def install_generator_copies(where: Where, dist: Any) -> None:
    """Patch ``generator-copies``'s installer: every element a
    ``tf.data.Dataset.from_generator`` generator yields (Keras's own, for a
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
