"""Keras 3's losses and random draws on several replicas made one process's
(tfdist/keras/loss_scaling.py, tfdist/keras/random_draws.py, the symbolic build of a model
without ``call()``, Horovod's ``reduction="sum"``), on 2 real workers against one process with
the same global batch, by ``tfdist verify``'s comparison. The worker
(tests/workers/loss_scaling_worker.py) trains nine user-shaped models; the control, the same
script with the two patches left out, must show the defects (the logged loss halved, the
gradient doubled by a loss object's scalar or a train_step's own mean, the random draws per
replica, the uneven split weighed 1:1), so the test knows it exercises them. How a
train_step's own loss reduces the rows is tested on traced graphs, in one process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import HOROVOD_PYTHON, WORKERS, clean_env, require

from tfdist.verify.compare import DIFFERS, ROUNDING, Record, Run, compare
from tfdist.verify.run import run_once

WORKER = str(WORKERS / "loss_scaling_worker.py")
STEPS = 16  # each fit: 2 epochs of 8 batches
UNEVEN = 14  # fit9: 2 epochs of 7 batches (6 of 33 rows, then 1)



def only(run: Run, call: str) -> Run:
    """``run`` with its records cut to one call (the calls are compared in order, the first
    difference wins: each call is asked on its own here)."""
    records = [None if r is None else Record(
        r.rank, {**r.meta, "models": []}, [c for c in r.calls if c["name"] == call], r.arrays)
        for r in run.records]
    return Run(run.returncode, run.output, records)


def _env() -> dict[str, str]:
    return clean_env(TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="0", TFDIST_VERIFY_SEED="0",
                     TFDIST_STEP_LOGS="global")


# How a train_step's own loss reduces the rows (tfdist/keras/loss_scaling.py): each loss is
# traced over a batch of unknown rows (an input in fit's step) and walked back on 2 replicas.
def _mean(x: Any, tf: Any) -> Any:
    return tf.reduce_mean(tf.square(x))


REDUCTIONS: list[tuple[str, Callable[[Any, Any], Any], str]] = [
    ("a mean (the VAE, WGAN-GP)", _mean, "mean"),
    ("a mean of per-row sums", lambda x, tf: tf.reduce_mean(tf.reduce_sum(x, axis=1)), "mean"),
    ("compute_average_loss", lambda x, tf: tf.nn.compute_average_loss(
        tf.reduce_sum(x, axis=1), global_batch_size=32), "sum"),
    ("a mean divided by the replicas", lambda x, tf: _mean(x, tf) / 2, "sum"),
    ("a mean times their inverse", lambda x, tf: 0.5 * _mean(x, tf), "sum"),
    ("a mean beside a divided one", lambda x, tf: _mean(x, tf) + _mean(x, tf) / 2, "mixed"),
    ("a mean beside a sum", lambda x, tf: _mean(x, tf) + tf.reduce_sum(x), "mean and sum"),
    ("a weight penalty only", lambda x, tf: tf.reduce_sum(tf.ones((4, 3))), "unknown"),
    ("a mean beside a weight penalty", lambda x, tf: _mean(x, tf) + tf.reduce_sum(
        tf.ones((4, 3))), "mean"),
    ("statistics over the rows, then a sum", lambda x, tf: tf.reduce_sum(
        x - tf.reduce_mean(x, axis=0)), "sum"),
]


@pytest.mark.parametrize("loss, expected", [(f, e) for _, f, e in REDUCTIONS],
                         ids=[name for name, _, _ in REDUCTIONS])
def test_a_train_steps_own_loss_is_classed_by_how_it_reduces_the_rows(
        loss: Callable[[Any, Any], Any], expected: str) -> None:
    import tensorflow as tf

    from tfdist.keras.loss_scaling import _batch_reduction

    found = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x: Any) -> Any:
        target = loss(x, tf)
        found.append(_batch_reduction(target, None, 2, set()))
        return target

    step.get_concrete_function()
    assert found == [expected]


def test_a_loss_keras_scaled_is_left_to_keras_and_a_mean_beside_it_named() -> None:
    import tensorflow as tf

    from tfdist.keras.loss_scaling import _batch_reduction

    found = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x: Any) -> Any:
        scaled = _mean(x, tf) * 0.5  # as Keras scales its loss objects' means
        made = {scaled.ref()}
        found.append(_batch_reduction(scaled + 1.0, None, 2, made))
        found.append(_batch_reduction(scaled + _mean(x, tf), None, 2, made))
        found.append(_batch_reduction(scaled + _mean(x, tf) / 2, None, 2, made))
        return scaled

    step.get_concrete_function()
    assert found == ["keras", "mixed", "keras"]


@pytest.mark.multiprocess
def test_mwms_every_model_is_one_processs_and_the_control_is_not(tmp_path: Path) -> None:
    env = _env()
    one = run_once([sys.executable, WORKER, "uneven"], str(tmp_path / "one"), 1, env, 240)
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2", WORKER, "uneven"]
    fixed = run_once(launch, str(tmp_path / "fixed"), 2, env, 240)
    control = run_once(launch, str(tmp_path / "control"), 2, {
        **env, "TFDIST_SKIP_PATCHES": "keras3-loss-scaling,keras3-global-draws"}, 240)
    for run in (one, fixed, control):
        assert run.returncode == 0, run.output[-3000:]
    verdict = compare(one, fixed)
    assert verdict.outcome == ROUNDING and verdict.steps == 8 * STEPS + UNEVEN, verdict.line
    assert any("returns one number for the batch" in line for line in verdict.told)
    assert any("averages over the rows itself" in line for line in verdict.told)
    assert not any("split" in line for line in verdict.told), verdict.told  # nothing to tell
    halved = compare(only(one, "fit1"), only(control, "fit1"))
    assert (halved.outcome, halved.where) == (DIFFERS, "fit1 step_loss"), halved.line
    assert "the logged loss is 1/2 of one process's" in halved.cause
    doubled = compare(only(one, "fit2"), only(control, "fit2"))
    assert doubled.outcome == DIFFERS and "the gradient is 2 times" in doubled.cause, doubled.line
    drawn = compare(only(one, "fit4"), only(control, "fit4"))
    assert drawn.outcome == DIFFERS and "random draws are made per replica" in drawn.cause, (
        drawn.line)
    penalty = compare(only(one, "fit7"), only(control, "fit7"))  # compute_loss's own term
    assert penalty.outcome == DIFFERS, penalty.line
    own_mean = compare(only(one, "fit8"), only(control, "fit8"))  # its own mean, summed
    assert own_mean.outcome == DIFFERS and "the gradient is 2 times" in own_mean.cause, (
        own_mean.line)
    equal_weights = compare(only(one, "fit9"), only(control, "fit9"))  # 17 and 16 rows as 1:1
    assert equal_weights.outcome == DIFFERS, equal_weights.line
    assert any("does not split over 2 replicas" in line for line in equal_weights.told)


@pytest.mark.multiprocess
def test_horovod_every_model_is_one_processs(tmp_path: Path) -> None:
    require("horovod", python=HOROVOD_PYTHON)
    env = _env()
    python = str(HOROVOD_PYTHON)
    one = run_once([python, WORKER], str(tmp_path / "one"), 1, env, 240)
    many = run_once([python, "-m", "tfdist", "launch", "--backend", "horovod", "-n", "2",
                     WORKER], str(tmp_path / "horovod"), 2, env, 300)
    assert one.returncode == 0 and many.returncode == 0, many.output[-3000:]
    verdict = compare(one, many)
    assert verdict.outcome == ROUNDING and verdict.steps == 8 * STEPS, verdict.line
