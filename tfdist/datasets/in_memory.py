"""The datasets as numpy arrays, for frameworks other than TensorFlow (the PyTorch example).

The same examples and the same train/test split as `tfdist.datasets.load`, without TensorFlow
or a data directory: the digits come from `digits.npz` beside this module, split by
`split_indices` below, which the tfds builder in `tfdist.datasets.digits` uses too. This module
imports neither TensorFlow nor tensorflow-datasets: numpy is enough.

`digits.npz` (48 KB) holds the 1797 8x8 images and labels of the UCI "Optical Recognition of
Handwritten Digits" test set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0), exactly as scikit-learn's
``load_digits`` returns them (intensities 0..16), and the rows of the train/test split that
scikit-learn 1.9's ``train_test_split(test_size=0.2, random_state=0, stratify=labels)`` chose.
It ships with tfdist so that the examples need no scikit-learn: Keras 3 imports scikit-learn at
start-up whenever it is installed (its scikit-learn wrappers), about 1.1 s of every process's
start on one core. tests/test_datasets.py pins the file's content and, where scikit-learn is
installed, compares it with ``load_digits``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tfdist.errors import ConfigError

__all__ = ["DATA_FILE", "SPLITS", "SPLIT_SEED", "TEST_SIZE", "arrays", "source", "split_indices",
           "to_uint8"]

SPLITS = ("train", "test")
TEST_SIZE = 0.2
SPLIT_SEED = 0
_SKLEARN_MAX = 16  # load_digits intensities are the integers 0..16.
DATA_FILE = Path(__file__).with_name("digits.npz")


def arrays(name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(images, labels)`` of ``split`` of dataset ``name``.

    Args:
        name: ``"digits"``.
        split: ``"train"`` (1437 examples) or ``"test"`` (360); no tfds slices.

    Returns:
        uint8 images ``(N, 8, 8, 1)`` in 0..255, exactly the values `load` yields, and int64
        labels ``(N,)``, in the order of `split_indices` (`load` reads them in another order).

    Raises:
        ConfigError: an unknown dataset or split, naming the choices.
    """
    if name != "digits":
        raise ConfigError(f"no in-memory arrays for dataset {name!r}; available: digits")
    if split not in SPLITS:
        raise ConfigError(f"split {split!r} is not one of {SPLITS} (slices are tfds-only)")
    images, labels = source()
    rows = split_indices()[split]
    return to_uint8(images[rows]), labels[rows].astype(np.int64)


def source() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 images ``(1797, 8, 8)``, intensities 0..16, and their labels, as ``load_digits``
    gives them (``load_digits().images`` as uint8, ``load_digits().target``)."""
    with np.load(DATA_FILE) as data:
        return data["images"], data["labels"].astype(np.int64)


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Scales load_digits intensities 0..16 to uint8 0..255, shape (N, 8, 8) -> (N, 8, 8, 1).

    ``round(v * 255 / 16)`` with halves rounded up, in integer arithmetic so it is exact:
    0 -> 0, 8 -> 128 (the only half: 127.5), 16 -> 255. The map is strictly increasing, so no two
    intensities collide.
    """
    values = np.rint(images).astype(np.int64)
    if values.min() < 0 or values.max() > _SKLEARN_MAX or not np.array_equal(values, images):
        raise ValueError(f"expected integer intensities 0..{_SKLEARN_MAX}")
    scaled = (values * 255 + _SKLEARN_MAX // 2) // _SKLEARN_MAX
    return scaled.astype(np.uint8)[..., np.newaxis]


def split_indices() -> dict[str, np.ndarray]:
    """Rows of `source` in each split: stratified by label, 20 % test, ``random_state=0``.

    Stored with the data (what scikit-learn 1.9 chose), so the split never changes with a
    library's version: a prepared data directory and the in-memory arrays always agree.
    """
    with np.load(DATA_FILE) as data:
        return {split: data[split].astype(np.int64) for split in SPLITS}
