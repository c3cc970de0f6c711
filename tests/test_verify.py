"""``tfdist verify``: the comparison's verdicts on made-up records (pure), then the command on a
real script, correct and with a planted defect (a doubled gradient, a halved loss) on 2 workers
against one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import ROOT, WORKERS, clean_env

from tfdist.verify import REPLICAS, replicas_for_scaling
from tfdist.verify.compare import (
    CRASHED,
    DIFFERS,
    EQUAL,
    ROUNDING,
    RTOL,
    Record,
    Run,
    compare,
    diagnose,
    relative_difference,
    update_ratio,
)
from tfdist.verify.run import last_lines

W0 = [np.array([[1.0, -2.0], [0.5, 0.25]], np.float32), np.array([0.0, 0.1], np.float32)]
GRADIENT = [np.array([[0.2, 0.1], [-0.3, 0.05]], np.float32), np.array([0.1, -0.2], np.float32)]


def _sgd(weights: list[np.ndarray], scale: float = 1.0, lr: float = 0.1) -> list[np.ndarray]:
    return [w - lr * scale * g for w, g in zip(weights, GRADIENT, strict=True)]


def record(rank: int = 0, *, steps: int = 3, scale: float = 1.0, loss_scale: float = 1.0,
           noise: float = 0.0, initial: list[np.ndarray] | None = None, replicas: int = 2,
           step_logs: str = "global", losses: list[float] | None = None,
           extra_calls: list[dict[str, Any]] | None = None) -> Record:
    """A record of one fit of ``steps`` SGD steps on :data:`GRADIENT` (``scale`` times it)."""
    weights = [w.copy() for w in (initial or W0)]
    arrays: dict[str, np.ndarray] = {}
    names = ["dense/kernel", "dense/bias"]
    variables: dict[str, list[str]] = {}

    def put(key: str, values: list[np.ndarray]) -> None:
        variables[key] = names
        for i, value in enumerate(values):
            arrays[f"{key}/{i}"] = value + np.float32(noise)

    put("fit1/initial", weights)
    logs = []
    for step in range(1, steps + 1):
        weights = _sgd(weights, scale)
        put(f"fit1/step{step}", weights)
        loss = (losses[step - 1] if losses else 1.0 / step) * loss_scale
        logs.append({"loss": loss})
    put("fit1/end", weights)
    put("final/model", weights)
    # the epoch's logs are the job's on every backend (Horovod: tfdist's epoch-results)
    epoch = {"loss": logs[-1]["loss"] / (loss_scale if step_logs == "own" else 1.0)}
    calls = [{"name": "fit1", "kind": "fit", "steps": logs, "epochs": [epoch],
              "weights": ["initial", *[f"step{s}" for s in range(1, steps + 1)], "end"],
              "random_layers": []}, *(extra_calls or [])]
    meta = {"replicas": replicas, "step_logs": step_logs, "variables": variables,
            "models": ["model"], "random_layers": []}
    return Record(rank, meta, calls, arrays)


def run(*records: Record | None, code: int = 0, output: str = "") -> Run:
    return Run(code, output, list(records))


ONE = run(record(replicas=1))


def test_equal_bit_for_bit() -> None:
    verdict = compare(ONE, run(record(0), record(1)))
    assert (verdict.outcome, verdict.steps) == (EQUAL, 3)
    assert verdict.line.startswith("equal: 3 steps")


def test_within_rounding_names_the_bound_and_why() -> None:
    verdict = compare(ONE, run(record(0, noise=1e-6), record(1, noise=1e-6)))
    assert verdict.outcome == ROUNDING
    assert 0 < verdict.largest <= RTOL
    assert f"bound {RTOL:g}" in verdict.line and "another order" in verdict.line


def test_doubled_gradient_is_named_with_the_fix() -> None:
    verdict = compare(ONE, run(record(0, scale=2.0), record(1, scale=2.0)))
    assert (verdict.outcome, verdict.step) == (DIFFERS, 1)
    assert "the gradient is 2 times one process's" in verdict.line
    assert "dist.num_replicas" in verdict.cause


def test_halved_gradient_is_named() -> None:
    verdict = compare(ONE, run(record(0, scale=0.5), record(1, scale=0.5)))
    assert "the gradient is 1/2 of one process's" in verdict.line


def test_halved_logged_loss_is_named() -> None:
    verdict = compare(ONE, run(record(0, loss_scale=0.5), record(1, loss_scale=0.5)))
    assert (verdict.outcome, verdict.where) == (DIFFERS, "fit1 loss")
    assert "the logged loss is 1/2 of one process's" in verdict.line


def test_other_batch_is_named_when_nothing_else_explains() -> None:
    many = run(record(0, losses=[0.9, 0.5, 0.3]), record(1, losses=[0.9, 0.5, 0.3]))
    verdict = compare(run(record(replicas=1, losses=[0.7, 0.5, 0.3])), many)
    assert "the batch differs from one process's" in verdict.line


def test_other_initial_weights_are_named() -> None:
    other = [w + 1 for w in W0]
    many = run(record(0, initial=other), record(1, initial=other))
    assert "the initial weights differ" in compare(ONE, many).line


def test_ranks_apart_come_first() -> None:
    verdict = compare(ONE, run(record(0), record(1, scale=2.0)))
    assert verdict.where == "ranks"
    assert "rank 1's dense/kernel is not rank 0's at fit1 end" in verdict.line


def test_horovods_own_step_logs_are_averaged_over_the_ranks() -> None:
    # each rank logs the loss over its own rows; their average is the job's
    low, high = record(0, loss_scale=0.5, step_logs="own"), record(1, loss_scale=1.5,
                                                                     step_logs="own")
    assert compare(ONE, run(low, high)).outcome == EQUAL


def test_a_crash_names_the_run_and_its_line() -> None:
    many = run(record(0), None, code=1, output="[1] Traceback ...\n[1] ValueError: no rows\n")
    verdict = compare(ONE, many)
    assert verdict.outcome == CRASHED
    assert verdict.line == ("the 2-worker run failed (exit 1) (no record from rank 1): "
                            "ValueError: no rows")
    own = compare(run(None, code=2, output="SyntaxError: bad\n"), run(record(0), record(1)))
    assert own.line.startswith("the one-process run failed (exit 2): SyntaxError")


def test_a_tfdist_line_is_the_reason_shown() -> None:
    output = ("[0] tfdist: each step's logs are averaged\n[0] Traceback (most recent call)\n"
              "[0] tfdist: InitOrderError: make the dataset after strategy_scope(); fix: ...\n")
    assert run(code=1, output=output).last_line().startswith("tfdist: InitOrderError")
    # Exit 78: tfdist's own error, its one line (tfdist.uncaught) the last of tfdist's.
    own = "[0] tfdist: global batch 64\n[0] tfdist: model_dir m is in use by another run\n"
    assert run(code=78, output=own).last_line() == "tfdist: model_dir m is in use by another run"


def test_other_steps_and_calls_differ() -> None:
    verdict = compare(ONE, run(record(0, steps=2), record(1, steps=2)))
    assert "fit1 ran 2 steps on 2 workers, 3 in one process" in verdict.line
    evaluate = {"name": "evaluate1", "kind": "evaluate", "result": {"0": 0.5}, "steps": [],
                "epochs": [], "weights": []}
    verdict = compare(ONE, run(record(0, extra_calls=[evaluate]), record(1)))
    assert verdict.where == "calls"


def test_evaluate_and_predict_results_are_compared() -> None:
    def evaluate(value: float) -> dict[str, Any]:
        return {"name": "evaluate1", "kind": "evaluate", "result": {"0": value}, "steps": [],
                "epochs": [], "weights": []}

    one = run(record(replicas=1, extra_calls=[evaluate(0.5)]))
    assert compare(one, run(record(0, extra_calls=[evaluate(0.5)]),
                            record(1, extra_calls=[evaluate(0.5)]))).outcome == EQUAL
    verdict = compare(one, run(record(0, extra_calls=[evaluate(0.25)]),
                               record(1, extra_calls=[evaluate(0.25)])))
    assert verdict.where == "evaluate1 0" and "0.25 on the workers, 0.5 in one" in verdict.line
    predict = {"name": "predict1", "kind": "predict", "steps": [], "epochs": [], "weights": [],
               "outputs": [{"shape": [1, 10], "sum": 1.0, "digest": "a"}]}
    fewer = dict(predict, outputs=[{"shape": [0, 10], "sum": 0.0, "digest": "b"}])
    verdict = compare(run(record(replicas=1, extra_calls=[predict])),
                      run(record(0, extra_calls=[fewer]), record(1, extra_calls=[fewer])))
    assert "rows lost or repeated" in verdict.line


@pytest.mark.parametrize(("a", "b", "expected"), [
    (np.ones(3), np.ones(3), 0.0),
    (np.array([1.0, 2.0]), np.array([1.0, 4.0]), 0.5),  # over the larger scale, b's
    (np.zeros(2), np.zeros(3), float("inf")),
    (np.array([np.nan]), np.array([np.nan]), 0.0),
    (np.array([np.nan]), np.array([1.0]), float("inf")),
    (np.array([1e-9]), np.array([0.0]), 1e-3),  # scales below 1e-6 count as 1e-6
])
def test_relative_difference(a: np.ndarray, b: np.ndarray, expected: float) -> None:
    assert relative_difference(a, b) == pytest.approx(expected)


def test_update_ratio_by_projection() -> None:
    one, many = _sgd(W0), _sgd(W0, 2.0)
    assert update_ratio(W0, one, many) == pytest.approx(2.0)
    assert update_ratio(W0, W0, many) is None  # one process did not move


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"update": 2.0}, "the gradient is 2 times"),
    ({"update": 0.5}, "the gradient is 1/2"),
    ({"loss_ratio": 0.5}, "the logged loss is 1/2"),
    ({"loss_ratio": 2.0}, "the logged loss is 2 times"),
    ({"random_layers": ["Dropout 'dropout'"]}, "random draws are made per replica"),
    ({"random_layers": ["Dropout 'd'", "BatchNormalization 'bn' (batch statistics)"]},
     "BatchNormalization normalises over each replica's rows"),
    ({"loss_ratio": 0.8}, "the batch differs"),
    # another batch from the same weights: an update that happens to look halved means nothing
    ({"loss_ratio": 0.8, "update": 0.5}, "the batch differs"),
    ({"loss_ratio": 1.0, "update": 0.5}, "the gradient is 1/2"),
    ({"weights_before_equal": False, "first_step": True}, "the initial weights differ"),
    ({}, "the cause is none tfdist recognises"),
])
def test_diagnose(kwargs: dict[str, Any], start: str) -> None:
    arguments: dict[str, Any] = {"loss_ratio": None, "update": None,
                                 "weights_before_equal": True, "random_layers": [],
                                 "first_step": False}
    assert diagnose(2, **{**arguments, **kwargs}).startswith(start)


def test_scale_lr_uses_the_compared_runs_replicas() -> None:
    assert replicas_for_scaling(1, {}) == 1
    assert replicas_for_scaling(1, {REPLICAS: "4"}) == 4
    assert replicas_for_scaling(2, {REPLICAS: "x"}) == 2


PLANT = str(WORKERS / "verify_plant.py")


@pytest.mark.multiprocess
def test_verify_passes_a_correct_script_and_names_planted_defects(tmp_path: Path) -> None:
    """The command on a correct script (exit 0, within rounding), then the same reference run
    against 2 workers of the script with a planted defect: a doubled gradient, a halved loss."""
    from tfdist.verify.run import run_once

    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-m", "tfdist", "verify", "--steps", "4", "--keep",
                           str(tmp_path), PLANT], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("tfdist verify:")]
    assert done.returncode == 0, done.stdout[-3000:]
    assert lines[-1].startswith("tfdist verify: within rounding: 4 steps"), done.stdout[-3000:]
    reference = Record.load(tmp_path / "one", 0)  # kept by --keep
    assert reference is not None and len(reference.calls[0]["steps"]) == 4  # stopped at 4
    one = Run(0, "", [reference])
    launch = [sys.executable, "-m", "tfdist", "launch", "-n", "2", PLANT]
    base = {**env, "TFDIST_VERIFY_STEPS": "4", "TFDIST_VERIFY_SEED": "0",
            "TFDIST_STEP_LOGS": "global"}
    for plant, expected in (("double", "the gradient is 2 times one process's"),
                            ("half", "the logged loss is 1/2 of one process's")):
        many = run_once(launch, str(tmp_path / plant), 2, {**base, "PLANT": plant}, 300)
        verdict = compare(one, many)
        assert (verdict.outcome, verdict.step) == (DIFFERS, 1), (plant, verdict, many.output)
        assert expected in verdict.cause, (plant, verdict.line)
    assert not os.path.exists(tmp_path / "one" / "record-1.json")


def test_a_missing_script_is_one_line_with_the_fix(tmp_path: Path) -> None:
    import contextlib
    import io

    from tfdist import cli

    missing = str(tmp_path / "trian.py")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = cli.main(["verify", missing])
    assert code == 2
    assert said.getvalue() == (f"tfdist: verify: no script {missing!r}: give the path of a .py "
                               "file\n")


def test_a_failed_runs_last_lines_come_per_rank_the_failed_rank_first() -> None:
    # The rank that failed first holds the cause; the others' last lines are the framework's
    # traceback of a collective that lost its peer, and they came last in the joined output.
    output = "\n".join(["[0] start", "[1] start", "[1] ValueError: the cause",
                        *[f"[0] frame {i}" for i in range(50)],
                        "tfdist launch: worker 1 exited with code 1; stopping the other workers"])
    parts = last_lines(output, 3)
    assert parts == [("rank 1", ["start", "ValueError: the cause"]),
                     ("rank 0", ["frame 47", "frame 48", "frame 49"]),
                     ("", ["tfdist launch: worker 1 exited with code 1; stopping the other "
                           "workers"])]
    assert last_lines("one\ntwo\nthree", 2) == [("", ["two", "three"])]  # one process
