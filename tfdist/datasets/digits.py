"""The handwritten digits of ``sklearn.datasets.load_digits`` as an offline tensorflow-datasets
dataset, ``tfdist_digits``.

The 1797 8x8 images ship inside tfdist (`tfdist.datasets.in_memory` says whence), so nothing is
downloaded: the builder writes them to TFRecord files under a data directory once, and every
later call reads those files.

Two entry points, because of when TensorFlow may be touched in a multi-worker program:

* `prepare` only writes files. It never initialises TensorFlow's eager context, so it is safe to
  call BEFORE creating a ``tf.distribute.MultiWorkerMirroredStrategy`` (whose constructor raises
  "Collective ops must be configured at program startup" once the context exists).
* `load` returns a ``tf.data.Dataset``, which initialises the eager context: call it AFTER the
  strategy exists.

Both may be called by several processes at once with the same data directory (the workers of one
machine, or Slurm tasks on a shared file system): the preparation runs under an exclusive
``flock`` on ``<data_dir>/tfdist_digits.lock``, so one process writes and the others wait and read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pathlib
import struct
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import gcs_utils

from tfdist.datasets import resolve_data_dir
from tfdist.datasets.in_memory import source, split_indices, to_uint8
from tfdist.errors import TfdistError
from tfdist.sharding import with_policy

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = [
    "NAME",
    "TfdistDigits",
    "dataset_dir",
    "load",
    "prepare",
    "split_indices",
    "to_uint8",
]

logger = logging.getLogger(__name__)

NAME = "tfdist_digits"
_NUM_CLASSES = 10

# flock errors that mean "this file system cannot lock" rather than "try again".
_NO_LOCK_ERRNOS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class TfdistDigits(tfds.core.GeneratorBasedBuilder):  # type: ignore[misc]
    """``sklearn.datasets.load_digits`` with a fixed stratified train/test split (1437/360)."""

    name = NAME
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": (
            "Initial release: scikit-learn's load_digits, intensities 0..16 scaled to uint8 "
            "0..255 (round half up), stratified train_test_split(test_size=0.2, random_state=0)."
        ),
    }

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo directly, not dataset_info_from_configs: the latter reads metadata files
        # (README.md, CITATIONS.bib, ...) from this module's package directory.
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Optical recognition of handwritten digits (UCI, CC BY 4.0), as scikit-learn's "
                "load_digits gives them: "
                "8x8 grayscale images of the digits 0-9."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=_NUM_CLASSES),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html#digits-dataset",
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
        del dl_manager  # The data ship inside tfdist: nothing to download.
        images, labels = source()
        images = to_uint8(images)
        return {
            split: self._generate_examples(images, labels, indices)
            for split, indices in split_indices().items()
        }

    def _generate_examples(
        self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        for index in indices:
            # The key is the row of load_digits: stable, and tfds orders records by its hash.
            yield (
                int(index),
                {
                    "image": _encode_png(images[index]),
                    "label": int(labels[index]),
                },
            )


def _encode_png(image: np.ndarray) -> bytes:
    """Encodes an (H, W, 1) uint8 image as an 8-bit grayscale PNG without TensorFlow.

    Given a numpy array, ``tfds.features.Image`` would encode it with ``tf.image.encode_png``
    run eagerly, which initialises TensorFlow's eager context and would make `prepare` unsafe
    before the strategy. Given bytes, it stores them as they are.
    """
    height, width, _ = image.shape
    # Each scanline starts with its filter type, 0 = None.
    raw = b"".join(b"\x00" + row.tobytes() for row in image[:, :, 0])
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # depth 8, grayscale
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _png_chunk(b"IHDR", header),
            _png_chunk(b"IDAT", zlib.compress(raw, 9)),
            _png_chunk(b"IEND", b""),
        ]
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def dataset_dir(data_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Where the prepared files live: ``<data_dir>/tfdist_digits/1.0.0``."""
    return resolve_data_dir(data_dir) / NAME / str(TfdistDigits.VERSION)


def prepare(data_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Writes the dataset's files under ``data_dir`` unless they are there already.

    Safe to call BEFORE creating a ``MultiWorkerMirroredStrategy``: it does not initialise
    TensorFlow's eager context (images are PNG-encoded in Python, and no tf.data runs). Safe to
    call from several processes at once: one prepares under an exclusive lock on
    ``<data_dir>/tfdist_digits.lock`` while the others wait. Nothing is downloaded and GCS is
    never tried.

    Args:
        data_dir: Root data directory. Default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.

    Returns:
        The prepared dataset directory, ``<data_dir>/tfdist_digits/1.0.0``.

    Raises:
        TfdistError: The file system of ``data_dir`` cannot ``flock`` and the data are not
            prepared yet.
    """
    root = resolve_data_dir(data_dir)
    target = dataset_dir(root)
    # tfds writes into a temporary directory and renames it, so a present dataset_info.json
    # means complete files: readers then skip the lock (and work where flock does not).
    if _is_prepared(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{NAME}.lock"):
        if not _is_prepared(target):  # Another process may have prepared it while we waited.
            _build(root)
            logger.info("prepared %s in %s", NAME, target)
    return target


def load(
    split: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    as_supervised: bool = True,
    shuffle_files: bool = False,
) -> tf.data.Dataset:
    """Returns a split of ``tfdist_digits``, preparing the files on first use (see `prepare`).

    Call it AFTER creating the distribution strategy: building a ``tf.data.Dataset`` initialises
    TensorFlow's eager context, after which ``MultiWorkerMirroredStrategy`` cannot be created.

    Each split is one TFRecord file, so FILE auto-sharding would fail with two or more workers
    ("Could not apply FILE based sharding", or empty batches on the others): the dataset comes
    with ``AutoShardPolicy.DATA``, under which each worker reads the file and keeps its share.

    Args:
        split: ``"train"`` (1437 examples) or ``"test"`` (360), or a tfds slice such as
            ``"train[:10%]"``.
        data_dir: Root data directory. Default: ``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``.
        as_supervised: Yield ``(image, label)`` tuples instead of feature dicts.
        shuffle_files: Passed to tfds; with one file per split it changes nothing.

    Returns:
        Elements ``(image, label)``: uint8 ``(8, 8, 1)`` in 0..255 and int64 in 0..9. Map
        `tfdist.datasets.normalize` for float32 images in [0, 1].
    """
    root = resolve_data_dir(data_dir)
    prepare(root)
    builder = TfdistDigits(data_dir=os.fspath(root))
    # No tfds auto-cache. tfds caches small datasets in memory (``ds.cache()``), and tf.data
    # shares that one cache among all iterators of the dataset, including the copies that
    # tf.distribute rewrites to shard it, completing or resetting it from whichever iterator
    # gets there first. Under MultiWorkerMirroredStrategy, Keras's evaluate and predict and a
    # plain loop over the same dataset then share state: on a 4-worker job, one worker's
    # predict pipeline and its plain label loop both stopped at row 352 of 360 (predict
    # returned 358 rows). The splits are a few hundred kB: read the file every time.
    dataset = builder.as_dataset(
        split=split,
        as_supervised=as_supervised,
        shuffle_files=shuffle_files,
        read_config=tfds.ReadConfig(try_autocache=False),
    )
    return with_policy(dataset, "data")


def _is_prepared(target: pathlib.Path) -> bool:
    return (target / "dataset_info.json").is_file()


def _build(root: pathlib.Path) -> None:
    # tfds 4.9.10 keeps GCS disabled by default; pin it so no version probes gs://tfds-data
    # (with no network, each probe waits minutes before failing).
    gcs_utils._is_gcs_disabled = True
    builder = TfdistDigits(data_dir=os.fspath(root))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path) -> Iterator[None]:
    """Holds an exclusive flock on ``path``; the kernel drops it if the process dies.

    The lock file is never deleted: unlinking it while another process waits on it would let
    a third process lock a new file with the same name.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in _NO_LOCK_ERRNOS:
                raise
            raise TfdistError(
                f"cannot lock {path} ({err.strerror}): its file system does not support flock "
                "(Lustre mounted without -o flock?). Prepare the data once before starting the "
                'workers, e.g. python -c \'import tfdist.datasets as d; d.prepare("digits", '
                f'"{path.parent}")\', or use a data_dir on a local or NFS file system.'
            ) from err
        yield
    finally:
        os.close(fd)  # Closing the descriptor releases the lock.
