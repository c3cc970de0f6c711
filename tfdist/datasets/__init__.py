"""Offline datasets for the examples, tests and benchmarks, served through tensorflow-datasets.

Nothing here downloads: each dataset is built from data installed with a Python package (for
``"digits"``, the 1797 images of scikit-learn's ``load_digits``, shipped in tfdist itself) and
written once under a data directory::

    tfdist.datasets.prepare("digits")                     # before the strategy: files only
    strategy = ...                                         # create the strategy
    ds = tfdist.datasets.load("digits", split="train")     # after it: (uint8 image, label)
    ds = ds.map(tfdist.datasets.normalize)                 # float32 image in [0, 1]

Importing this package imports neither TensorFlow nor tensorflow-datasets; `load` and `prepare`
import a dataset's module on first call.

The data directory is, in order: the ``data_dir`` argument, the ``TFDS_DATA_DIR`` environment
variable (the one tfds itself reads), ``~/tensorflow_datasets``.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import types
from typing import TYPE_CHECKING

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import tensorflow as tf

__all__ = ["arrays", "available", "load", "normalize", "prepare", "resolve_data_dir"]

# Short name -> module with prepare(data_dir) and load(split, data_dir, ...). Modules, not
# builder classes, so that listing names imports no TensorFlow.
_REGISTRY: dict[str, str] = {
    "digits": "tfdist.datasets.digits",
}


def available() -> list[str]:
    """The dataset names `load` and `prepare` accept."""
    return sorted(_REGISTRY)


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The data directory: ``data_dir``, else ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``."""
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    return pathlib.Path(data_dir).expanduser()


def prepare(name: str, data_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Writes dataset ``name``'s files under ``data_dir`` once; safe before the strategy.

    Does not initialise TensorFlow's eager context, so an example may call it before creating
    ``MultiWorkerMirroredStrategy``. Concurrent callers with the same ``data_dir`` are
    serialised by a lock file there; one writes, the others wait.

    Args:
        name: One of `available()`, e.g. ``"digits"``.
        data_dir: Root data directory. Default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.

    Returns:
        The prepared dataset directory, e.g. ``<data_dir>/tfdist_digits/1.0.0``.

    Raises:
        ConfigError: ``name`` is not a known dataset.
    """
    prepared: pathlib.Path = _module(name).prepare(data_dir)
    return prepared


def load(
    name: str,
    split: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    as_supervised: bool = True,
    shuffle_files: bool = False,
) -> tf.data.Dataset:
    """Returns ``split`` of dataset ``name``, preparing it first if needed.

    Call it AFTER creating the distribution strategy: a ``tf.data.Dataset`` initialises
    TensorFlow's eager context, and ``MultiWorkerMirroredStrategy`` then refuses to start
    ("Collective ops must be configured at program startup"). Use `prepare` before it. The
    dataset's auto-shard policy is DATA: a split is a single file, which FILE sharding cannot
    divide among workers.

    Args:
        name: One of `available()`, e.g. ``"digits"``.
        split: ``"train"`` or ``"test"``, or a tfds slice such as ``"train[:10%]"``.
        data_dir: Root data directory. Default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.
        as_supervised: Yield ``(image, label)`` tuples instead of feature dicts.
        shuffle_files: Shuffle the order of the split's files (tfds ``shuffle_files``).

    Returns:
        A dataset of uint8 images and int64 labels; map `normalize` for float32 images.

    Raises:
        ConfigError: ``name`` is not a known dataset.
    """
    dataset: tf.data.Dataset = _module(name).load(
        split, data_dir, as_supervised=as_supervised, shuffle_files=shuffle_files
    )
    return dataset


def normalize(image: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Maps a uint8 image to float32 in [0, 1] (``image / 255``); the label passes unchanged.

    For ``load(..., as_supervised=True).map(normalize)``: shape is kept ((8, 8, 1) for digits)
    and the label stays int64.
    """
    import tensorflow as tf

    return tf.cast(image, tf.float32) / 255.0, label


def arrays(name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``split`` of dataset ``name`` as numpy ``(images, labels)``, without TensorFlow.

    The same examples as ``load(name, split)`` (uint8 ``(N, 8, 8, 1)`` images, int64 labels),
    for PyTorch; see `tfdist.datasets.in_memory.arrays`. Only ``"train"`` and ``"test"``.
    """
    from tfdist.datasets import in_memory

    return in_memory.arrays(name, split)


def _module(name: str) -> types.ModuleType:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown dataset {name!r}; available datasets: {', '.join(available())}")
    from tfdist import quiet

    quiet.import_tensorflow()  # tensorflow-datasets loads it: without the start-up noise
    return importlib.import_module(_REGISTRY[name])
