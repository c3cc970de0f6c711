"""The handle's helpers: sharding policies, batch arithmetic, LR scaling and warmup.

Runs on a real 2-replica strategy: one process whose CPU is split into two logical devices
(MirroredStrategy), in a subprocess so that the device split happens before TensorFlow starts.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from tfdist.errors import ConfigError
from tfdist.sharding import shard_files

SCRIPT = r"""
import json, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tfdist import ConfigError, ClusterEnvironment
from tfdist.keras.callbacks import LearningRateWarmup
from tfdist.backends.mwms import MultiWorkerDistributed
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
dist = MultiWorkerDistributed(
    ClusterEnvironment("local", world_size=2, local_world_size=2, num_nodes=1), strategy,
    "ring", 0)
out = {"replicas": dist.num_replicas, "lr": dist.scale_lr(0.01),
       "per_replica": dist.per_replica_batch_size(64), "global": dist.global_batch_size(16)}
def error(call):
    try:
        call()
    except ConfigError as e:
        return str(e)
out["odd_batch"] = error(lambda: dist.per_replica_batch_size(63))
out["file_policy"] = error(lambda: dist.shard(tf.data.Dataset.range(4), "file"))
out["few_files"] = error(lambda: dist.shard(tf.data.Dataset.range(4), "file", num_files=1))
out["bad_policy"] = error(lambda: dist.shard(tf.data.Dataset.range(4), "rows"))
ds = dist.shard(tf.data.Dataset.range(4), "data")
out["data_policy"] = (ds.options().experimental_distribute.auto_shard_policy
                      == tf.data.experimental.AutoShardPolicy.DATA)
keras = tf.keras
with dist.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(dist.scale_lr(0.1)), loss="mse")
rates = []
class Record(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        rates.append(float(keras.backend.get_value(self.model.optimizer.learning_rate)))
x = tf.zeros((16, 1))
model.fit(x, x, batch_size=4, epochs=3, verbose=0,
          callbacks=[LearningRateWarmup(2, dist.num_replicas), Record()])
out["rates"] = rates
with dist.scope():  # a schedule sets the rate every step: the warmup refuses it, with the fix
    scheduled = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    scheduled.compile(loss="mse", optimizer=keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))
out["schedule"] = error(lambda: scheduled.fit(
    x, x, batch_size=4, epochs=1, verbose=0, callbacks=[LearningRateWarmup(2, 2)]))
out["schedule_steps"] = int(scheduled.optimizer.iterations.numpy())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helpers() -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, check=False,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_batch_arithmetic_and_linear_scaling(helpers):
    assert helpers["replicas"] == 2
    assert helpers["lr"] == pytest.approx(0.02)
    assert (helpers["per_replica"], helpers["global"]) == (32, 32)
    assert "does not divide over 2 replicas" in helpers["odd_batch"]
    assert "e.g. 62" in helpers["odd_batch"]


def test_file_sharding_is_refused_unless_every_worker_gets_a_file(helpers):
    assert "num_files" in helpers["file_policy"]
    assert "1 input file(s) for 2 workers" in helpers["few_files"]
    assert "policy='data'" in helpers["few_files"]
    assert "'rows' is not one of" in helpers["bad_policy"]
    assert helpers["data_policy"] is True


def test_warmup_refuses_a_learning_rate_schedule_before_the_first_step(helpers):
    assert "ExponentialDecay schedule, which sets the rate every step" in helpers["schedule"]
    assert "warmup_steps and warmup_target" in helpers["schedule"]
    assert helpers["schedule_steps"] == 0


def test_warmup_ramps_from_the_unscaled_rate_to_the_scaled_one(helpers):
    rates = helpers["rates"]  # 4 steps per epoch, 2 warmup epochs, target 0.2 from 0.1
    assert len(rates) == 12
    assert rates[0] == pytest.approx(0.1)
    assert all(a < b for a, b in itertools.pairwise(rates[:9]))
    assert rates[4] == pytest.approx(0.15)
    assert rates[8:] == pytest.approx([0.2] * 4)


@pytest.mark.parametrize(("files", "rank", "size", "mine"), [
    (["a", "b", "c", "d", "e"], 0, 2, ["a", "c", "e"]),
    (["a", "b", "c", "d", "e"], 1, 2, ["b", "d"]),
    (["a", "b"], 1, 2, ["b"]),
])
def test_shard_files_gives_each_worker_its_share(files, rank, size, mine):
    assert shard_files(files, rank, size) == mine


def test_shard_files_refuses_fewer_files_than_workers():
    with pytest.raises(ConfigError, match="3 input file"):
        shard_files(["a", "b", "c"], 0, 4)


ONE_CPU_REPLICA = {
    # a worker's replica devices -> whether it reads a plain tf.data iterator
    "one CPU, as MWMS names it": (("/job:worker/replica:0/task:1/device:CPU:0",), True),
    "one CPU, short": (("/cpu:0",), True),
    "one GPU": (("/job:worker/replica:0/task:0/device:GPU:0",), False),
    "two logical CPUs (TFDIST_CPU_REPLICAS=2)": (
        ("/job:worker/replica:0/task:0/device:CPU:0",
         "/job:worker/replica:0/task:0/device:CPU:1"), False),
    "two GPUs": (("/device:GPU:0", "/device:GPU:1"), False),
    "none": ((), False),
}


@pytest.mark.parametrize("case", sorted(ONE_CPU_REPLICA))
def test_only_a_worker_whose_one_replica_is_a_cpu_reads_a_plain_iterator(case):
    from tfdist.backends.mwms_input import _one_cpu_replica

    devices, plain = ONE_CPU_REPLICA[case]
    assert _one_cpu_replica(devices) is plain


def _end_check_cases():
    import tensorflow as tf

    def data(dataset):
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        return dataset.with_options(options)

    rows = tf.data.Dataset.range(100)
    policy = tf.data.experimental.AutoShardPolicy
    other = {name: tf.data.Options() for name in ("FILE", "OFF")}
    for name, options in other.items():
        options.experimental_distribute.auto_shard_policy = getattr(policy, name)
    return {  # dataset -> whether every worker provably gets the same number of batches
        "DATA, batch": (data(rows.batch(32)), True),
        "DATA, batch, cache, prefetch": (data(rows.batch(32).cache().prefetch(2)), True),
        "DATA, filter, then batch": (data(rows.filter(lambda x: x % 3 > 0).batch(32)), True),
        "DATA, batch with drop_remainder": (data(rows.batch(32, drop_remainder=True)), True),
        "DATA, map after batch (no constant batch found)": (
            data(rows.batch(32).map(lambda x: x * 2)), False),
        "DATA, not batched": (data(rows), False),
        "AUTO (may shard by file)": (rows.batch(32), False),
        "FILE": (rows.batch(32).with_options(other["FILE"]), False),
        "OFF": (rows.batch(32).with_options(other["OFF"]), False),
        "no dataset (distribute_datasets_from_function)": (None, False),
    }


@pytest.mark.parametrize("case", [
    "DATA, batch", "DATA, batch, cache, prefetch", "DATA, filter, then batch",
    "DATA, batch with drop_remainder", "DATA, map after batch (no constant batch found)",
    "DATA, not batched", "AUTO (may shard by file)", "FILE", "OFF",
    "no dataset (distribute_datasets_from_function)"])
def test_the_end_of_data_check_is_dropped_only_where_every_worker_gets_as_many_batches(case):
    from tfdist.backends.mwms_input import _same_steps_on_every_worker

    dataset, expected = _end_check_cases()[case]
    assert _same_steps_on_every_worker(dataset) is expected


BATCH_LINES = {
    # name: (global batch, replicas, expected line start, looks per-worker)
    "splits evenly": (64, 2, "global batch 64 = 32 per replica x 2 replicas", False),
    "one replica": (64, 1, "global batch 64, one replica", False),
    "uneven": (33, 2, "global batch 33 does not split over 2 replicas (16 or 17 each)", True),
    "fewer rows than replicas": (2, 4, "global batch 2 does not split over 4 replicas (some "
                                 "get no examples)", True),
}


@pytest.mark.parametrize("case", sorted(BATCH_LINES))
def test_the_batch_line_names_a_batch_that_looks_per_worker(case):
    from tfdist.replicas import batch_line

    batch, replicas, start, odd = BATCH_LINES[case]
    line, looks_per_worker = batch_line(batch, replicas)
    assert line.startswith(start) and looks_per_worker == odd, line
    assert ("GLOBAL batch size" in line) == odd, line
    assert ("no step's gradient is one process's" in line) == odd, line
    weighted, warned = batch_line(batch, replicas, weighted=True)  # Keras 3's fit on MWMS
    if odd and batch >= replicas:  # fit weighs each replica by its rows: one process's step
        assert not warned and "fit weighs each replica's loss by its rows" in weighted, weighted
        assert "a custom loop" in weighted and "global batch that 2 divides (32 or 34)" in (
            weighted), weighted
    else:  # nothing to weigh, or a replica without rows: as unweighted
        assert (weighted, warned) == (line, looks_per_worker)


LAST_BATCHES = {
    # name: (rows left in the last batch, replicas, the line holds (or None: no line))
    "none short": (0, 2, None),
    "splits evenly": (4, 2, None),
    "one replica": (3, 1, None),
    "uneven": (3, 2, "3 rows, which do not split evenly over 2 replicas (1 replica(s) get 2 "
               "rows, the others 1)"),
    "a replica gets none": (1, 2, "(1 of the 2 replicas get no rows)"),
}


@pytest.mark.parametrize("case", sorted(LAST_BATCHES))
def test_a_last_batch_that_does_not_split_evenly_is_named(case):
    from tfdist.replicas import last_batch_line

    rows, replicas, part = LAST_BATCHES[case]
    gradient = "that step's gradient is not one process's"
    nan = "BatchNormalization's statistics on an empty replica, then every weight, become NaN"
    line = last_batch_line(rows, replicas)  # a dataset: it may be evaluate's or predict's
    assert (line is None) if part is None else (
        part in line and f"if fit trains on it, {gradient}" in line
        and "(evaluate's and predict's numbers are)" in line and "drop_remainder=True" in line
        and (nan in line) == (case == "a replica gets none"))
    line = last_batch_line(rows, replicas, arrays=True)  # fit's arrays: a number of rows
    assert (line is None) if part is None else (
        part in line and f"): {gradient}" in line
        and "x[:len(x) // batch_size * batch_size]" in line)
    # Keras 3's fit on MWMS weighs each replica by its rows: no step to warn of (a
    # BatchNormalization model leaving a replica without rows is refused by fit itself)
    assert last_batch_line(rows, replicas, weighted=True) is None


ARRAYS_ROWS_LEFT = {
    # name: (fit's arguments, with x of 100 rows where not given; rows in the last batch)
    "default batch 32": ({}, 4),
    "divides": ({"batch_size": 25}, 0),
    "validation_split cuts first": ({"batch_size": 16, "validation_split": 0.2}, 0),
    "validation_data wins": ({"batch_size": 16, "validation_split": 0.2,
                              "validation_data": ([], [])}, 4),
    "a dict of inputs": ({"x": {"a": np.zeros(10), "b": np.ones(10)}, "batch_size": 4}, 2),
    "a tuple of inputs": ({"x": (np.zeros((7, 2)), np.ones(7)), "batch_size": 4}, 3),
}


@pytest.mark.parametrize("case", sorted(ARRAYS_ROWS_LEFT))
def test_the_last_batch_of_fits_arrays_is_counted(case):
    from tfdist.keras.fit_inputs import arrays_rows_left

    arguments, expected = ARRAYS_ROWS_LEFT[case]
    assert arrays_rows_left({"x": np.zeros((100, 3)), **arguments}) == expected


LAST_BATCH_ROWS = {
    # name: (the pipeline from tf and a dataset of 10 rows, rows of its last batch)
    "short": (lambda tf, d: d.batch(4), 2),
    "divides": (lambda tf, d: d.batch(5), 0),
    "drop_remainder": (lambda tf, d: d.batch(4, drop_remainder=True), 0),
    "under map and prefetch, after a shuffle": (
        lambda tf, d: d.shuffle(10, seed=1).batch(3).map(lambda x: x).prefetch(1), 1),
    "filtered: length unknown": (lambda tf, d: d.filter(lambda x: x > 2).batch(4), None),
    "repeated: no end": (lambda tf, d: d.repeat().batch(4), None),
    "unbatched": (lambda tf, d: d, None),
}


@pytest.mark.parametrize("case", sorted(LAST_BATCH_ROWS))
def test_the_rows_of_the_last_batch_are_known_where_the_length_is(case):
    import tensorflow as tf

    from tfdist.sharding import last_batch_rows

    build, expected = LAST_BATCH_ROWS[case]
    assert last_batch_rows(build(tf, tf.data.Dataset.range(10))) == expected


SHUFFLES = {
    # name: (the pipeline from tf and a dataset of 10 rows, unseeded shuffle seen)
    "no shuffle": (lambda tf, d: d.batch(4), False),
    "unseeded": (lambda tf, d: d.shuffle(10).batch(4), True),
    "seeded": (lambda tf, d: d.shuffle(10, seed=1).batch(4), False),
    "unseeded under map, batch and prefetch": (
        lambda tf, d: d.shuffle(10).map(lambda x: x + 1).batch(4).prefetch(1), True),
    "unseeded inside a zip": (
        lambda tf, d: tf.data.Dataset.zip((d.shuffle(10, seed=2), d.shuffle(10))).batch(4),
        True),
}


@pytest.mark.parametrize("case", sorted(SHUFFLES))
def test_an_unseeded_shuffle_is_seen_before_the_split(case):
    import tensorflow as tf

    from tfdist.sharding import unseeded_shuffle

    build, expected = SHUFFLES[case]
    assert unseeded_shuffle(build(tf, tf.data.Dataset.range(10))) is expected


def test_a_global_seed_seeds_every_shuffle():
    import tensorflow as tf

    from tfdist.sharding import unseeded_shuffle

    tf.random.set_seed(3)
    try:
        assert not unseeded_shuffle(tf.data.Dataset.range(10).shuffle(10))
    finally:
        tf.random.set_seed(None)


def test_an_atomic_write_replaces_a_file_or_a_folder_whole(tmp_path):
    from tfdist.scratch import atomic_path

    for kind in ("file", "folder"):
        target = tmp_path / kind
        for version in ("old", "new"):
            with atomic_path(str(target)) as partial:
                if kind == "file":
                    Path(partial).write_text(version)
                else:  # a SavedModel-like folder: the new one replaces the old one whole
                    Path(partial).mkdir()
                    (Path(partial) / version).write_text(version)
        assert (target.read_text() if kind == "file" else
                sorted(p.name for p in target.iterdir())) == ("new" if kind == "file" else
                                                              ["new"])
    with pytest.raises(RuntimeError), atomic_path(str(tmp_path / "file")) as partial:
        Path(partial).write_text("half")
        raise RuntimeError("killed mid-write")
    assert (tmp_path / "file").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]


OWN_COPIES = {
    # name: (an element a generator yields, made from the array `a`)
    "an array": lambda a: a[2:4],
    "a tuple of views": lambda a: (a[:2], a[2:4]),
    "a dict in a list": lambda a: [{"x": a[1:], "name": "rows"}],
    "a namedtuple": lambda a: __import__("collections").namedtuple("B", "x y")(a[:1], 3),
}


@pytest.mark.parametrize("case", sorted(OWN_COPIES))
def test_a_generators_arrays_reach_tensorflow_as_copies(case):
    """TensorFlow may write a step's result into a split batch's memory in place: a generator's
    arrays must not be views of the user's (patch generator-copies)."""
    from tfdist.keras.fit_inputs import copying

    users = np.arange(12.0).reshape(6, 2)
    element = OWN_COPIES[case](users)
    (copied,) = list(copying(lambda n: iter([element] * n))(1))
    leaves, mine = _arrays(copied), _arrays(element)
    assert leaves and len(leaves) == len(mine)
    for leaf, view in zip(leaves, mine, strict=True):
        np.testing.assert_array_equal(leaf, view)
        assert not np.shares_memory(leaf, users)
    assert type(copied) is type(element)
    assert str(copied) == str(element)  # the same structure and values, other memory


def _arrays(element):
    if isinstance(element, np.ndarray):
        return [element]
    values = element.values() if isinstance(element, dict) else element
    if isinstance(element, list | tuple | dict):
        return [leaf for value in values for leaf in _arrays(value)]
    return []
