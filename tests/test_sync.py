"""The replica sync check: exact fingerprints, its error message, and real 2-process runs.

The multi-process runs train examples/keras_train.py's digits CNN (plus BatchNormalization)
through ``tfdist launch``; a run whose ranks are made to differ by one ulp must stop on BOTH
ranks with an error naming rank 1, and never hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import ROOT, WORKERS, launch, load_result

from tfdist import ClusterEnvironment, sync
from tfdist.backends.mwms import MultiWorkerDistributed
from tfdist.backends.single import SingleDistributed
from tfdist.errors import ConfigError, ReplicaMismatchError
from tfdist.keras.versions import keras2_package
from tfdist.sync import ReplicaSyncCheck, fingerprint, mismatch_error, sync_check_callback

SYNC = str(WORKERS / "sync_worker.py")
KERAS2 = keras2_package() is not None  # tf.keras is Keras 2 (TensorFlow 2.15, or tf_keras)


def _variable_name(path: str) -> str:
    """A variable of the workers' Sequential model as the check names it: Keras 3's path, or
    Keras 2's variable name (no model prefix, a ``:0`` suffix)."""
    return f"{path.split('/', 1)[1]}:0" if KERAS2 else path


# --- fingerprints: pure -------------------------------------------------------------------------

def _one_ulp_up(array: np.ndarray, index: int = 0) -> np.ndarray:
    changed = array.copy()
    flat = changed.reshape(-1)
    flat[index] = np.nextafter(flat[index], np.array(np.inf, dtype=array.dtype))
    return changed


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_one_ulp_anywhere_changes_the_fingerprint(dtype):
    weights = np.random.default_rng(0).normal(size=(64, 33)).astype(dtype)
    base = fingerprint([weights])
    for index in (0, 1000, weights.size - 1):
        assert fingerprint([_one_ulp_up(weights, index)]) != base


def test_identical_values_give_identical_fingerprints():
    rng = np.random.default_rng(1)
    weights = [rng.normal(size=(3, 4)).astype("float32"), np.arange(5, dtype="int64")]
    again = [w.copy() for w in weights]
    np.testing.assert_array_equal(fingerprint(weights), fingerprint(again))
    assert fingerprint(weights).dtype == np.uint64 and fingerprint(weights).shape == (2,)


def test_swapped_elements_shapes_and_dtypes_are_told_apart():
    weights = np.arange(12, dtype="float32").reshape(3, 4)
    swapped = weights.copy().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    variants = [weights, swapped.reshape(3, 4), weights.reshape(4, 3), weights.reshape(-1),
                weights.view("int32"), weights.T]
    digests = fingerprint(variants).tolist()
    assert len(set(digests)) == len(variants), digests


def test_one_digest_per_variable_in_order():
    a, b = np.zeros(3, "float32"), np.ones(3, "float32")
    assert fingerprint([a, b]).tolist() == fingerprint([b, a]).tolist()[::-1]
    assert fingerprint([]).shape == (0,)


def test_fingerprint_reads_tensorflow_and_keras_variables():
    import tensorflow as tf

    value = np.random.default_rng(2).normal(size=(5, 2)).astype("float32")
    variables = [tf.Variable(value)]
    if hasattr(tf.keras, "Variable"):  # Keras 3; Keras 2's variables are tf.Variables
        variables.append(tf.keras.Variable(value))
    assert fingerprint(variables).tolist() == fingerprint([value] * len(variables)).tolist()


def test_fingerprint_of_100_mb_takes_well_under_a_second():
    weights = np.random.default_rng(3).normal(size=25_000_000).astype("float32")  # 100 MB
    start = time.perf_counter()
    fingerprint([weights])
    assert time.perf_counter() - start < 1.0  # ~0.1 s measured: about 1 ms per MB


# --- the error message: pure table ----------------------------------------------------------

NAMES = ["dense/kernel", "dense/bias"]


def _table(rows: list[list[int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint64)


def test_error_names_the_ranks_and_variables_that_differ_from_rank_0():
    header = _table([[0, 0, 2, 11], [1, 0, 2, 22], [2, 0, 2, 11], [3, 0, 2, 22]])
    detail = _table([[0, 0, 5, 6], [1, 0, 5, 7], [2, 0, 5, 6], [3, 0, 5, 7]])
    message = str(mismatch_error(header, detail, NAMES, step=1))
    assert "after step 1: rank 1, rank 3 hold different weights from rank 0" in message
    assert "rank 1: 1 of 2 variables differ: dense/bias" in message
    assert "groups of identical replicas" not in message  # only two groups: nothing to add
    assert "sync_check=False" in message and "TFDIST_SYNC_CHECK=0" in message
    assert "DistributedOptimizer" in message  # Horovod's silent Keras 3 failure is named


def test_error_lists_groups_when_there_are_more_than_two():
    header = _table([[2, 0, 2, 33], [0, 0, 2, 11], [1, 0, 2, 22], [3, 0, 2, 22]])
    detail = _table([[2, 0, 8, 6], [0, 0, 5, 6], [1, 0, 5, 7], [3, 0, 5, 7]])
    message = str(mismatch_error(header, detail, NAMES, step=None))
    assert "failed: rank 1, rank 2, rank 3 hold" in message  # rows are sorted by rank
    assert "rank 2: 1 of 2 variables differ: dense/kernel" in message
    assert "groups of identical replicas: rank 0 | rank 1, rank 3 | rank 2" in message


def test_error_names_replicas_when_a_rank_has_several():
    header = _table([[0, 0, 2, 11], [0, 1, 2, 22], [1, 0, 2, 11], [1, 1, 2, 11]])
    detail = _table([[0, 0, 5, 6], [0, 1, 9, 6], [1, 0, 5, 6], [1, 1, 5, 6]])
    message = str(mismatch_error(header, detail, NAMES, step=7))
    assert "rank 0 replica 1 holds different weights from rank 0 replica 0" in message
    assert "1 of 2 variables differ: dense/kernel" in message


@pytest.mark.parametrize(("step", "first"), [
    (1, "initial weights that differ: the model was built outside the strategy scope"),
    (None, "initial weights that differ"),
    (7, "weights changed on some ranks only"),
])
def test_the_likeliest_cause_comes_first(step, first):
    header = _table([[0, 0, 2, 11], [1, 0, 2, 22]])
    detail = _table([[0, 0, 5, 6], [1, 0, 5, 7]])
    message = str(mismatch_error(header, detail, NAMES, step=step))
    assert f"Likeliest cause: {first}" in message, message
    assert message.count("DistributedOptimizer") == 1  # every cause named, once


@pytest.mark.parametrize(("rank", "verbose", "printed"), [
    (0, "", ["tfdist: ReplicaMismatchError: Replica sync check failed after step 1: rank 1 "
             "holds different weights from rank 0"]),  # the whole report, once
    (1, "", ["tfdist: rank 1: the replica sync check failed; rank 0 prints the report "
             "(TFDIST_VERBOSE=1: every rank's traceback)"]),  # one line
    (1, "1", ["traceback"]),  # Python's own printing, on every rank
])
def test_the_report_is_printed_once_by_rank_0(monkeypatch, capsys, rank, verbose, printed):
    from tfdist import failures

    shown: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: shown.append("traceback"))
    monkeypatch.setattr(failures, "_environment", None)
    monkeypatch.setenv("TFDIST_VERBOSE", verbose)
    failures.install(ClusterEnvironment("tf_config", rank=rank, world_size=2))
    header = _table([[0, 0, 2, 11], [1, 0, 2, 22]])
    error = mismatch_error(header, _table([[0, 0, 5, 6], [1, 0, 5, 7]]), NAMES, step=1)
    sys.excepthook(type(error), error, None)
    err = capsys.readouterr().err
    if verbose:  # Python's traceback, and no tfdist line
        assert (shown, err) == (printed, ""), err
    else:  # tfdist's one print, no traceback
        assert shown == [] and err.startswith(printed[0]) and err.count("tfdist:") == 1, err
        assert err.count("\n") == (1 if rank else len(str(error).splitlines())), err


def test_different_variable_counts_mean_different_models():
    header = _table([[0, 0, 2, 11], [1, 0, 3, 22]])
    message = str(mismatch_error(header, None, NAMES, step=1))
    assert "different numbers of variables (rank 0: 2)" in message
    assert "rank 1: 3 variables" in message
    assert isinstance(mismatch_error(header, None, NAMES, 1), ReplicaMismatchError)


# --- settings: argument > environment > default ---------------------------------------------

# A handle that is never used to train: settings and build() only read its attributes.
MWMS = MultiWorkerDistributed(ClusterEnvironment("local", world_size=2, local_world_size=2),
                              SimpleNamespace(num_replicas_in_sync=2), "ring", 0)


@pytest.mark.parametrize(("enabled", "every", "env", "expected"), [
    (None, None, {}, "first"),
    (None, None, {"TFDIST_SYNC_CHECK": "0"}, None),
    (None, None, {"TFDIST_SYNC_CHECK": "off"}, None),
    (True, None, {"TFDIST_SYNC_CHECK": "0"}, "first"),  # the argument wins
    (False, 5, {}, None),
    (None, None, {"TFDIST_SYNC_CHECK_EVERY": "50"}, 50),
    (None, 10, {"TFDIST_SYNC_CHECK_EVERY": "50"}, 10),  # the argument wins
    (None, None, {"TFDIST_SYNC_CHECK_EVERY": " "}, "first"),
])
def test_settings_and_their_precedence(enabled, every, env, expected):
    check = sync_check_callback(MWMS, enabled, every, env)
    if expected is None:
        assert check is None
    else:
        assert isinstance(check, ReplicaSyncCheck)
        assert check.every_n_steps == (None if expected == "first" else expected)


@pytest.mark.parametrize(("every", "env", "named"), [
    (0, {}, "sync_check_every"),
    (None, {"TFDIST_SYNC_CHECK_EVERY": "-2"}, "TFDIST_SYNC_CHECK_EVERY"),
    (None, {"TFDIST_SYNC_CHECK_EVERY": "ten"}, "TFDIST_SYNC_CHECK_EVERY"),
    (None, {"TFDIST_SYNC_CHECK": "maybe"}, "TFDIST_SYNC_CHECK"),
])
def test_bad_settings_name_the_setting(every, env, named):
    with pytest.raises(ConfigError, match=named):
        sync_check_callback(MWMS, None, every, env)


def test_one_process_has_nothing_to_compare():
    single = SingleDistributed(ClusterEnvironment("local"),
                               SimpleNamespace(num_replicas_in_sync=1), "none", 0)
    assert sync_check_callback(single, True, 3, {}) is None


def test_dist_callbacks_add_the_check_after_yours_unless_turned_off(monkeypatch):
    monkeypatch.delenv("TFDIST_SYNC_CHECK", raising=False)
    monkeypatch.delenv("TFDIST_SYNC_CHECK_EVERY", raising=False)
    from tfdist.keras.callbacks import build

    mine = object()
    callbacks = build(MWMS, mine, sync_check_every=4)
    checks = [c for c in callbacks if isinstance(c, ReplicaSyncCheck)]
    assert len(checks) == 1 and checks[0].every_n_steps == 4
    assert callbacks.index(checks[0]) > callbacks.index(mine)
    assert not any(isinstance(c, ReplicaSyncCheck)
                   for c in build(MWMS, sync_check=False))
    monkeypatch.setenv("TFDIST_SYNC_CHECK", "0")
    assert not any(isinstance(c, ReplicaSyncCheck) for c in build(MWMS))


# --- real processes -------------------------------------------------------------------------

def _run(tmp_path, mode: str, env: dict[str, str] | None = None):
    return launch([SYNC, str(tmp_path), mode], env=env, timeout=180)


@pytest.mark.multiprocess
def test_fit_passes_after_the_first_step_and_at_the_end(tmp_path):
    run = _run(tmp_path, "fit")
    assert run.returncode == 0, run.stdout + run.stderr
    results = [load_result(tmp_path, r) for r in (0, 1)]
    assert [r["checked_steps"] for r in results] == [[1, 8], [1, 8]]
    # Keras 3 keeps each replica's own BatchNormalization statistics: the step checks skip
    # them; tfdist averages them at each epoch's end, and the check at the end compares them.
    assert results[0]["moving_mean"] == results[1]["moving_mean"]
    assert max(results[0]["seconds"][1:]) < 1.0  # ~10 ms; the first check traces (~0.3 s)


@pytest.mark.multiprocess
def test_every_n_steps_from_the_environment_under_tf_keras(tmp_path):
    pytest.importorskip("tf_keras", reason="tf_keras is not installed")
    run = _run(tmp_path, "fit", {"TF_USE_LEGACY_KERAS": "1", "TFDIST_SYNC_CHECK_EVERY": "3"})
    assert run.returncode == 0, run.stdout + run.stderr
    # 8 steps: the first, every 3rd, and the last.
    assert [load_result(tmp_path, r)["checked_steps"] for r in (0, 1)] == [[1, 3, 6, 8]] * 2


@pytest.mark.multiprocess
def test_one_ulp_on_one_rank_stops_both_ranks_naming_rank_1(tmp_path):
    run = _run(tmp_path, "desync")
    assert run.returncode != 0, run.stdout + run.stderr
    for rank in (0, 1):
        message = (tmp_path / f"error-{rank}.txt").read_text()
        assert message.startswith("Replica sync check failed after step 1: rank 1 holds "
                                  "different weights from rank 0"), message
        assert ("rank 1: 1 of 10 variables differ: "
                + _variable_name("sequential/conv2d/kernel")) in message
    assert not (tmp_path / "result-0.json").exists()  # training stopped at the first step
    # The report once, from rank 0, with no traceback of tfdist's error on either rank.
    output = run.stdout + run.stderr
    assert output.count("Replica sync check failed") == 1, output[-4000:]
    assert "[0] tfdist: ReplicaMismatchError: Replica sync check failed" in output, output[-4000:]
    assert "[1] tfdist: rank 1: the replica sync check failed; rank 0 prints the report" in \
        output, output[-4000:]
    # (TensorFlow 2.15 adds its own "Exception ignored in AtomicFunction.__del__" as it exits)
    assert output.count("ReplicaMismatchError") == 1, output[-4000:]


@pytest.mark.multiprocess
def test_custom_loop_check_passes_fails_and_times_out(tmp_path):
    run = _run(tmp_path, "custom")
    output = run.stdout + run.stderr
    results = [load_result(tmp_path, r) for r in (0, 1)]
    # 10 weights + SGD's variables: Keras 3's iterations and learning rate; Keras 2's
    # iterations and a momentum slot per weight
    assert [r["variables"] for r in results] == ([21, 21] if KERAS2 else [12, 12])
    for result in results:
        assert "after step 2: rank 1 holds different weights from rank 0" in result["mismatch"]
        assert _variable_name("sequential/dense_1/bias") in result["mismatch"]
    timeout = tmp_path / "timeout-0.json"
    crashed = "TensorFlow crashed while aborting it" in output
    if crashed:
        # TensorFlow 2.21 sometimes crashes in its own thread while it aborts the timed-out
        # collective: before Python sees the error (SIGABRT, "Mutex corrupt") or after the
        # worker handled it (SIGSEGV as the process ends, after abseil's "Lock blocking"
        # lines); each seen once in a full run on 2 loaded cores. The launcher then names the
        # timed-out collective (tfdist.timeouts.crashed) instead of the worker.
        assert "tfdist launch: worker 0 was killed by signal" in output, output
    else:
        assert run.returncode == 0, output
    if timeout.exists():  # the check's own message, whenever the worker got to write it
        message = json.loads(timeout.read_text())["timeout"]
        assert "not every rank reached it within 3 s" in message, output
        assert "on every rank" in message
    else:
        assert crashed, output


def test_several_replicas_per_rank_are_compared_and_named(tmp_path):
    # One process, 2 replicas (a worker with 2 GPUs): replica 1's copy moved by one ulp.
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    run = subprocess.run([sys.executable, SYNC, str(tmp_path), "replicas"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    message = json.loads((tmp_path / "result-0.json").read_text())["mismatch"]
    assert "rank 0 replica 1 holds different weights from rank 0 replica 0" in message
    assert _variable_name("sequential/batch_normalization/gamma") in message


def test_digest_is_equal_only_for_identical_values():
    a = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4)]
    b = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4)]
    assert sync.digest(a) == sync.digest(b)
    assert len(sync.digest(a)) == 16
    b[1][2] = np.nextafter(1.0, 2.0)
    assert sync.digest(a) != sync.digest(b)
