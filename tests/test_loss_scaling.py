"""Keras 3's losses and random draws on several replicas made one process's
(tfdist/keras/loss_scaling.py, tfdist/keras/random_draws.py, the symbolic build of a model
without ``call()``, Horovod's ``reduction="sum"``), on 2 real workers against one process with
the same global batch, by ``tfdist verify``'s comparison. The worker
(tests/workers/loss_scaling_worker.py) trains eight user-shaped models; the control, the same
script with the two patches left out, must show the defects (the logged loss halved, the
gradient doubled, the random draws per replica, the uneven split weighed 1:1), so the test
knows it exercises them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import HOROVOD_PYTHON, WORKERS, clean_env, require

from tfdist.verify.compare import DIFFERS, ROUNDING, Record, Run, compare
from tfdist.verify.run import run_once

WORKER = str(WORKERS / "loss_scaling_worker.py")
STEPS = 16  # each fit: 2 epochs of 8 batches
UNEVEN = 14  # fit8: 2 epochs of 7 batches (6 of 33 rows, then 1)
pytestmark = pytest.mark.multiprocess


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
    assert verdict.outcome == ROUNDING and verdict.steps == 7 * STEPS + UNEVEN, verdict.line
    assert any("returns one number for the batch" in line for line in verdict.told)
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
    equal_weights = compare(only(one, "fit8"), only(control, "fit8"))  # 17 and 16 rows as 1:1
    assert equal_weights.outcome == DIFFERS, equal_weights.line
    assert any("does not split over 2 replicas" in line for line in equal_weights.told)


def test_horovod_every_model_is_one_processs(tmp_path: Path) -> None:
    require("horovod", python=HOROVOD_PYTHON)
    env = _env()
    python = str(HOROVOD_PYTHON)
    one = run_once([python, WORKER], str(tmp_path / "one"), 1, env, 240)
    many = run_once([python, "-m", "tfdist", "launch", "--backend", "horovod", "-n", "2",
                     WORKER], str(tmp_path / "horovod"), 2, env, 300)
    assert one.returncode == 0 and many.returncode == 0, many.output[-3000:]
    verdict = compare(one, many)
    assert verdict.outcome == ROUNDING and verdict.steps == 7 * STEPS, verdict.line
