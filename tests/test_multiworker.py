"""Real 2-process training on loopback: the distribution is proven, not assumed.

Each run compares both ranks' final weights bit for bit; the control run trains the same steps
without gradient averaging and must end with different weights on the two ranks. Each run also
installed exactly the patches tfdist's inventory plans for it, in its order (tests/patch_plan.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORKERS, launch, load_result, load_weights
from patch_plan import assert_installed_as_planned

pytestmark = pytest.mark.multiprocess
KERAS = {"keras3": {}, "tf_keras": {"TF_USE_LEGACY_KERAS": "1"}}


def _train(tmp_path, loop: str, mode: str, env: dict[str, str]):
    run = launch([str(WORKERS / "train_worker.py"), str(tmp_path), loop, mode], env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    return [load_weights(tmp_path, r) for r in (0, 1)], [load_result(tmp_path, r) for r in (0, 1)]


@pytest.mark.parametrize("keras", sorted(KERAS))
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_two_workers_end_bit_identical(tmp_path, loop, keras):
    if keras == "tf_keras":
        pytest.importorskip("tf_keras", reason="tf_keras is not installed")
    weights, results = _train(tmp_path, loop, "dist", KERAS[keras])
    assert [r["size"] for r in results] == [2, 2]
    assert {r["launcher"] for r in results} == {"local"}
    for a, b in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(a, b)
    # Losses are averaged over the workers: every rank logs the same numbers.
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    if loop == "fit":
        _one_iterator_an_epoch_and_keras_own_orders(results)
    for result in results:  # fit reads datasets here: no shuffled arrays to fix the seed of
        assert_installed_as_planned(result["patches"], not_reached=["arrays-shuffle-seed"])
        planned = result["patches"]["planned"]
        assert planned["create"] == ["mwms-heartbeat"], planned
        assert {"arrays-one-order", "failure-line", "user-writers",
                "keras3-step-logs" if result["keras3"] else "keras2-step-results"
                } <= set(planned["start"]), planned


def _one_iterator_an_epoch_and_keras_own_orders(results):
    """Each rank fitted 3 epochs of a reshuffled dataset from the same weights three ways
    (train_worker._three_ways): tfdist's way trains the very batches of Keras's own, makes one
    distributed iterator an epoch instead of two, and frees every one it made, on tfdist's
    thread (tfdist.keras.iterators). Each CPU worker reads a plain tf.data iterator (no multi-device
    iterator to make and free every epoch), while the same strategy keeps TensorFlow's for a
    dataset distributed with options of one's own (the control)."""
    for result in results:
        ways = result["iterators"]
        tfdist, keras, control = ways["tfdist"], ways["keras"], ways["no-seeds"]
        assert tfdist["kinds"] == keras["kinds"] == ["OwnedIterator"], ways
        assert ways["your-options"]["kinds"] == ["OwnedMultiDeviceIterator"], ways
        assert tfdist["weights"] == keras["weights"], "other shuffle orders than Keras's"
        if result["keras3"]:  # tf_keras makes no iterator it does not read: nothing to spare
            assert control["weights"] != tfdist["weights"], "the control must draw other orders"
            # one more before the first epoch in both (Keras's build reads a batch)
            assert keras["made"] - tfdist["made"] == 3, ways
        else:
            assert keras["made"] == tfdist["made"] >= 3, ways
        for way in (tfdist, keras):  # nothing kept alive after fit: every one made is freed
            assert len(way["freed_on"]) == way["made"], way
            # and off the training thread: no epoch waits for tf.data's autotuning to wake
            assert way["freed_elsewhere"] >= way["made"], way
    assert results[0]["iterators"]["tfdist"]["weights"] == (
        results[1]["iterators"]["tfdist"]["weights"])


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_control_without_averaging_diverges(tmp_path, loop):
    weights, results = _train(tmp_path, loop, "control", {})
    assert {r["backend"] for r in results} == {"single"}
    for result in results:
        assert_installed_as_planned(result["patches"])
    differing = [not np.array_equal(a, b) for a, b in zip(weights[0], weights[1], strict=True)]
    assert all(differing), "without averaging the ranks must end with different weights"
