"""Real 2-process training on loopback: the distribution is proven, not assumed.

Each run compares both ranks' final weights bit for bit; the control run trains the same steps
without gradient averaging and must end with different weights on the two ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORKERS, launch, load_result, load_weights

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


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_control_without_averaging_diverges(tmp_path, loop):
    weights, results = _train(tmp_path, loop, "control", {})
    assert {r["backend"] for r in results} == {"single"}
    differing = [not np.array_equal(a, b) for a, b in zip(weights[0], weights[1], strict=True)]
    assert all(differing), "without averaging the ranks must end with different weights"
