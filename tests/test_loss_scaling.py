"""Keras 3's losses scaled for the replicas (tfdist/keras/loss_scaling.py), on 2 real MWMS
workers against one process with the same global batch, by ``tfdist verify``'s comparison: a
custom ``train_step`` that logs a ``keras.losses`` object's value, and a loss whose ``call``
returns one number. The control, the same script with the patch left out, must show the
defects (the logged loss halved, the gradient doubled), so the test knows it exercises them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import WORKERS, clean_env

from tfdist.verify.compare import DIFFERS, ROUNDING, Record, Run, compare
from tfdist.verify.run import run_once

WORKER = str(WORKERS / "loss_scaling_worker.py")
pytestmark = pytest.mark.multiprocess


def only(run: Run, call: str) -> Run:
    """``run`` with its records cut to one call (the calls are compared in order, the first
    difference wins: each call is asked on its own here)."""
    records = [None if r is None else Record(
        r.rank, {**r.meta, "models": []}, [c for c in r.calls if c["name"] == call], r.arrays)
        for r in run.records]
    return Run(run.returncode, run.output, records)


def test_logged_losses_and_one_number_losses_are_one_processs(tmp_path: Path) -> None:
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="0",
                    TFDIST_VERIFY_SEED="0", TFDIST_STEP_LOGS="global")
    one = run_once([sys.executable, WORKER], str(tmp_path / "one"), 1, env, 240)
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2", WORKER]
    fixed = run_once(launch, str(tmp_path / "fixed"), 2, env, 240)
    control = run_once(launch, str(tmp_path / "control"), 2,
                       {**env, "TFDIST_SKIP_PATCHES": "keras3-loss-scaling"}, 240)
    for run in (one, fixed, control):
        assert run.returncode == 0, run.output[-3000:]
    logged, one_number = compare(only(one, "fit1"), only(fixed, "fit1")), compare(
        only(one, "fit2"), only(fixed, "fit2"))
    assert logged.outcome == ROUNDING and logged.steps == 16, logged.line
    assert one_number.outcome == ROUNDING and one_number.steps == 16, one_number.line
    assert any("returns one number for the batch" in line for line in one_number.told)
    halved = compare(only(one, "fit1"), only(control, "fit1"))
    assert (halved.outcome, halved.where) == (DIFFERS, "fit1 step_loss"), halved.line
    assert "the logged loss is 1/2 of one process's" in halved.cause
    doubled = compare(only(one, "fit2"), only(control, "fit2"))
    assert doubled.outcome == DIFFERS and "the gradient is 2 times" in doubled.cause, doubled.line
