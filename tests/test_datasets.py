"""Tests of tfdist.datasets: the offline digits dataset, its locking and its TensorFlow hygiene.

No test touches the network: the data come from the file tfdist ships (digits.npz). The
multiprocess test starts 3 real workers of a MultiWorkerMirroredStrategy on loopback that prepare
one fresh data directory at the same moment. Every data directory is a fresh temporary one. Where
tensorflow-datasets is not installed (tfdist[datasets]), the tests of the data skip with the
reason; those of the import, the names, the shipped file and the data directory still run.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import needs, require

import tfdist.datasets
from tfdist.errors import ConfigError, TfdistError

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ("tensorflow_datasets",)  # what the digits dataset is built with

# sha256 of the sorted test-split rows of load_digits (scikit-learn 1.9's stratified split, the
# split of every data directory prepared since tfdist_digits 1.0.0), and of the images and
# labels of tfdist/datasets/digits.npz. A change to either is a new TfdistDigits.VERSION:
# data directories prepared before and after would hold other examples.
TEST_ROWS_SHA256 = "2fbaae31b8c6aad12464a07771b64269876d904bfed86f77a63c8265fa201621"
DATA_SHA256 = "65e5b4619795efb40c1082f4c350c049e4ad552200d369b6ae99e21eef5e72c5"

# One worker of a 3-worker MultiWorkerMirroredStrategy, in the order the examples use: prepare
# (all workers at once, on an empty data_dir), create the strategy, then load. Prints one JSON
# line. Python-level network calls are refused and recorded.
_WORKER = r"""
import hashlib, json, logging, pathlib, socket, sys, time
attempts = []
def _refuse(*args, **kwargs):
    attempts.append(repr(args)[:200])
    raise OSError("network disabled by test")
socket.socket.connect = _refuse
socket.getaddrinfo = _refuse
socket.create_connection = _refuse

import tensorflow as tf  # imported before the start signal, so the prepares overlap
import tfdist.datasets

messages = []
class _Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
log = logging.getLogger("tfdist.datasets.digits")
log.setLevel(logging.INFO)
log.addHandler(_Keep())

data_dir, barrier, index = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
(barrier / f"ready-{index}").touch()
while not (barrier / "go").exists():
    time.sleep(0.005)
start = time.perf_counter()
tfdist.datasets.prepare("digits", data_dir)
prepare_seconds = time.perf_counter() - start

from tensorflow.python.eager import context
untouched = context.context()._context_handle is None
tf.config.threading.set_inter_op_parallelism_threads(1)  # raises once TF is initialised
strategy = tf.distribute.MultiWorkerMirroredStrategy()

digest, counts = {}, {}
for split in ("train", "test"):
    h, n = hashlib.sha256(), 0
    for image, label in tfdist.datasets.load("digits", split, data_dir).as_numpy_iterator():
        h.update(image.tobytes() + int(label).to_bytes(8, "little"))
        n += 1
    digest[split], counts[split] = h.hexdigest(), n
print(json.dumps({
    "prepared": any(m.startswith("prepared") for m in messages),
    "prepare_seconds": prepare_seconds,
    "untouched": untouched,
    "replicas": strategy.num_replicas_in_sync,
    "digest": digest,
    "counts": counts,
    "network": attempts,
}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.pop("TFDS_DATA_DIR", None)
    return env


def _run_together(
    argvs: list[list[str]], envs: list[dict[str, str]], workdir: pathlib.Path, barrier: pathlib.Path
) -> list[dict[str, Any]]:
    """Starts one process per argv, releases them together once all are ready, returns their JSON.

    Output goes to files, not pipes (TensorFlow's logs could fill a pipe). If one fails the others
    are killed: the survivors of a broken multi-worker group would otherwise wait for it.
    """
    procs, logs = [], []
    try:
        for i, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            out, err = workdir / f"child-{i}.out", workdir / f"child-{i}.err"
            logs.append((out, err))
            with out.open("w") as out_file, err.open("w") as err_file:
                procs.append(subprocess.Popen(argv, env=env, stdout=out_file, stderr=err_file))
        deadline = time.monotonic() + 90
        released = False
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            assert not failed, (
                f"child {failed[0]} failed:\n{logs[failed[0]][1].read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, "children timed out"
            if not released and len(list(barrier.glob("ready-*"))) == len(procs):
                (barrier / "go").touch()
                released = True
            time.sleep(0.01)
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"child {i} failed:\n{logs[i][1].read_text()[-3000:]}"
        return [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in logs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _digest(dataset: Any) -> str:
    digest = hashlib.sha256()
    for image, label in dataset.as_numpy_iterator():
        digest.update(image.tobytes() + int(label).to_bytes(8, "little"))
    return digest.hexdigest()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port: int = sock.getsockname()[1]
        return port


def test_import_loads_no_tensorflow() -> None:
    code = (
        "import sys, tfdist.datasets as d; assert d.available() == ['digits']; "
        "print(sorted(m for m in ('tensorflow', 'tensorflow_datasets') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    require(*DATA)
    path = tmp_path_factory.mktemp("tfds")
    tfdist.datasets.prepare("digits", path)
    return path


@pytest.fixture(scope="module")
def arrays(data_dir: pathlib.Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each split read back as (images, labels) numpy arrays."""
    out = {}
    for split in ("train", "test"):
        pairs = list(tfdist.datasets.load("digits", split, data_dir).as_numpy_iterator())
        out[split] = (np.stack([x for x, _ in pairs]), np.array([y for _, y in pairs]))
    return out


@pytest.fixture(scope="module")
def digests(data_dir: pathlib.Path) -> dict[str, str]:
    return {s: _digest(tfdist.datasets.load("digits", s, data_dir)) for s in ("train", "test")}


def test_split_sizes(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    assert {s: len(labels) for s, (_, labels) in arrays.items()} == {"train": 1437, "test": 360}


def test_splits_are_stratified(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    train = np.bincount(arrays["train"][1], minlength=10)
    test = np.bincount(arrays["test"][1], minlength=10)
    assert (train > 0).all() and (test > 0).all()
    # Stratified: each class holds 20 % of its examples in test, to within one example.
    assert np.all(np.abs(test - 0.2 * (train + test)) <= 1), (train, test)


def test_content_is_the_shipped_files(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    from tfdist.datasets import digits

    source_images, labels = digits.source()
    images = digits.to_uint8(source_images)
    for split, rows in digits.split_indices().items():
        got_images, got_labels = arrays[split]

        def as_set(imgs: np.ndarray, labels: np.ndarray) -> list[bytes]:
            return sorted(i.tobytes() + bytes([int(y)]) for i, y in zip(imgs, labels, strict=True))

        assert as_set(got_images, got_labels) == as_set(images[rows], labels[rows])


def test_the_shipped_digits_and_split_are_pinned() -> None:
    from tfdist.datasets import in_memory

    rows = in_memory.split_indices()
    assert not set(rows["train"]) & set(rows["test"])
    assert sorted(np.concatenate([rows["train"], rows["test"]])) == list(range(1797))
    digest = hashlib.sha256(np.sort(rows["test"]).astype("<i8").tobytes()).hexdigest()
    assert digest == TEST_ROWS_SHA256, "the split changed: bump TfdistDigits.VERSION"
    images, labels = in_memory.source()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    digest = hashlib.sha256(images.tobytes() + labels.astype("<i8").tobytes()).hexdigest()
    assert digest == DATA_SHA256, "the digits changed: bump TfdistDigits.VERSION"


@needs("sklearn")
def test_the_shipped_digits_are_scikit_learns_load_digits_and_split() -> None:
    # Where scikit-learn is installed (not in the test environments: Keras 3 would import it
    # in every process): the shipped file is load_digits, and its split is train_test_split's.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from tfdist.datasets import in_memory

    digits = load_digits()
    images, labels = in_memory.source()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    train, test = train_test_split(np.arange(len(labels)), test_size=in_memory.TEST_SIZE,
                                   random_state=in_memory.SPLIT_SEED, stratify=labels)
    rows = in_memory.split_indices()
    assert np.array_equal(rows["train"], train) and np.array_equal(rows["test"], test)


def test_pixel_range(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    images = arrays["train"][0]
    assert images.dtype == np.uint8 and images.shape == (1437, 8, 8, 1)
    assert images.min() == 0 and images.max() == 255
    # 0..16 scaled with halves rounded up: 17 distinct levels, 8 -> 128.
    assert set(np.unique(images)) <= {(v * 255 + 8) // 16 for v in range(17)}
    assert 128 in set(np.unique(images))


@needs("tensorflow_datasets")
def test_to_uint8_rounding() -> None:
    from tfdist.datasets import digits

    out = digits.to_uint8(np.arange(17, dtype=np.float64).reshape(1, 1, 17))
    assert out.shape == (1, 1, 17, 1) and out.dtype == np.uint8
    assert out.ravel().tolist() == [round(v * 255 / 16 + 1e-9) for v in range(17)]
    assert out.ravel()[[0, 8, 16]].tolist() == [0, 128, 255]
    with pytest.raises(ValueError, match=r"0\.\.16"):
        digits.to_uint8(np.array([[[17.0]]]))


def test_as_supervised_shapes(data_dir: pathlib.Path) -> None:
    import tensorflow as tf

    ds = tfdist.datasets.load("digits", "test", data_dir)
    image_spec, label_spec = ds.element_spec
    assert (image_spec.shape, image_spec.dtype) == ((8, 8, 1), tf.uint8)
    assert (label_spec.shape, label_spec.dtype) == ((), tf.int64)
    features = tfdist.datasets.load("digits", "test", data_dir, as_supervised=False)
    assert set(features.element_spec) == {"image", "label"}


def test_normalize(data_dir: pathlib.Path) -> None:
    import tensorflow as tf

    ds = tfdist.datasets.load("digits", "train", data_dir).map(tfdist.datasets.normalize)
    image_spec, label_spec = ds.element_spec
    assert (image_spec.shape, image_spec.dtype, label_spec.dtype) == (
        (8, 8, 1),
        tf.float32,
        tf.int64,
    )
    images = np.stack([x for x, _ in ds.as_numpy_iterator()])
    assert images.min() == 0.0 and images.max() == 1.0


def test_load_shards_by_data(data_dir: pathlib.Path) -> None:
    import tensorflow as tf

    ds = tfdist.datasets.load("digits", "train", data_dir)
    policy = ds.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA


def _dataset_ops(dataset: Any) -> set[str]:
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    return {node.op for node in graph.node} | {
        node.op for function in graph.library.function for node in function.node_def}


def test_load_keeps_no_memory_cache_shared_by_iterators(data_dir: pathlib.Path) -> None:
    # tfds would cache this small dataset in memory, one cache shared by every iterator of the
    # dataset; under MultiWorkerMirroredStrategy that cache cut a 4-worker job's predict and
    # label loop short (358 and 352 of 360 rows). load() must read the file instead.
    from tfdist.datasets.digits import TfdistDigits

    stock = TfdistDigits(data_dir=os.fspath(data_dir)).as_dataset(split="test")
    assert any(op.startswith("CacheDataset") for op in _dataset_ops(stock)), \
        "control: tfds's default pipeline caches this dataset, so the check below means something"
    ops = _dataset_ops(tfdist.datasets.load("digits", "test", data_dir))
    assert not any(op.startswith("CacheDataset") for op in ops), sorted(ops)


def test_unknown_name_lists_available(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown dataset 'mnist'; available datasets: digits"):
        tfdist.datasets.load("mnist", "train", tmp_path)
    with pytest.raises(ValueError, match="available datasets: digits"):
        tfdist.datasets.prepare("mnist", tmp_path)
    assert not any(tmp_path.iterdir())


def test_unknown_split(data_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="validation"):
        tfdist.datasets.load("digits", "validation", data_dir)


@pytest.mark.parametrize(
    ("arg", "env", "expected"),
    [
        ("/explicit", {"TFDS_DATA_DIR": "/from/env"}, "/explicit"),
        (None, {"TFDS_DATA_DIR": "/from/env"}, "/from/env"),
        (None, {"TFDS_DATA_DIR": ""}, "/home/u/tensorflow_datasets"),
        (None, {}, "/home/u/tensorflow_datasets"),
        ("~/d", {}, "/home/u/d"),
    ],
)
def test_resolve_data_dir(
    arg: str | None, env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tfdist.datasets.resolve_data_dir(arg) == pathlib.Path(expected)


@pytest.fixture()
def prepare_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="tfdist.datasets.digits"):
        yield caplog


@needs(*DATA)
def test_second_load_does_not_rewrite(
    tmp_path: pathlib.Path, prepare_log: pytest.LogCaptureFixture
) -> None:
    start = time.perf_counter()
    first = _digest(tfdist.datasets.load("digits", "test", tmp_path))
    cold = time.perf_counter() - start
    assert [r.getMessage().split()[0] for r in prepare_log.records] == ["prepared"]
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert any(p.suffix != ".lock" for p in files) and len(files) > 3

    prepare_log.clear()
    start = time.perf_counter()
    second = _digest(tfdist.datasets.load("digits", "test", tmp_path))
    warm = time.perf_counter() - start
    assert second == first
    assert not prepare_log.records
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == files
    assert warm < max(1.0, cold), (cold, warm)


def test_no_flock_fails_with_fix_unless_prepared(
    tmp_path: pathlib.Path, data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(TfdistError, match=r"does not support flock.*prepare"):
        tfdist.datasets.prepare("digits", tmp_path)
    # Prepared data are read without the lock.
    assert tfdist.datasets.prepare("digits", data_dir) == data_dir / "tfdist_digits" / "1.0.0"


@pytest.mark.multiprocess
def test_workers_prepare_once_then_strategy_then_load(
    tmp_path: pathlib.Path, digests: dict[str, str]
) -> None:
    """3 workers prepare an empty data_dir at once, then create a 3-worker MWMS, then load.

    Checks the lock (exactly one worker writes, all read the same data) and that prepare leaves
    TensorFlow uninitialised: with the eager context initialised first (e.g. by tf.constant),
    the strategy raises "Collective ops must be configured at program startup".
    """
    data_dir, barrier = tmp_path / "data", tmp_path / "barrier"
    barrier.mkdir()
    workers = [f"localhost:{_free_port()}" for _ in range(3)]
    argvs = [[sys.executable, "-c", _WORKER, str(data_dir), str(barrier), str(i)] for i in range(3)]
    envs = [
        _env(
            TF_CONFIG=json.dumps(
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
            )
        )
        for i in range(3)
    ]
    results = _run_together(argvs, envs, tmp_path, barrier)

    assert [r["prepared"] for r in results].count(True) == 1
    assert [r["untouched"] for r in results] == [True] * 3
    assert [r["replicas"] for r in results] == [3] * 3
    assert [r["counts"] for r in results] == [{"train": 1437, "test": 360}] * 3
    # Identical in all three, and identical to the module's separately prepared data_dir.
    assert [r["digest"] for r in results] == [digests] * 3
    assert [r["network"] for r in results] == [[]] * 3
    assert all(r["prepare_seconds"] < 20 for r in results), results
