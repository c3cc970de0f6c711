"""The datasets as numpy arrays, for frameworks other than TensorFlow (the PyTorch example).

The same examples and the same train/test split as `tfdist.datasets.load`, without TensorFlow
or a data directory: the digits come straight from scikit-learn, split by
`split_indices` below, which the tfds builder in `tfdist.datasets.digits` uses too. This module
imports neither TensorFlow nor tensorflow-datasets: numpy and scikit-learn are enough.
"""

from __future__ import annotations

import numpy as np

from tfdist.errors import ConfigError

__all__ = ["SPLITS", "SPLIT_SEED", "TEST_SIZE", "arrays", "split_indices", "to_uint8"]

SPLITS = ("train", "test")
TEST_SIZE = 0.2
SPLIT_SEED = 0
_SKLEARN_MAX = 16  # load_digits intensities are the integers 0..16.


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
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = split_indices(digits.target)[split]
    return to_uint8(digits.images[rows]), digits.target[rows].astype(np.int64)


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


def split_indices(labels: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of load_digits in each split: stratified by label, 20 % test, ``random_state=0``.

    Deterministic for a given scikit-learn version (its StratifiedShuffleSplit algorithm); a
    prepared data directory keeps the split it was written with.
    """
    from sklearn.model_selection import train_test_split

    train, test = train_test_split(
        np.arange(len(labels)), test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=labels
    )
    return {"train": train, "test": test}
