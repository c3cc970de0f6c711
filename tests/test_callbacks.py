"""tfdist's Keras callbacks on 2 real workers: one writer, the epoch's exact state, resumption."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORKERS, launch, load_result, load_weights, tensorboard_logs

pytestmark = pytest.mark.multiprocess
RESUME = str(WORKERS / "resume_worker.py")


def test_preempted_job_resumes_where_it_stopped_and_matches_an_uninterrupted_one(tmp_path):
    straight, resumed, model_dir = tmp_path / "straight", tmp_path / "resumed", tmp_path / "model"
    straight.mkdir(), resumed.mkdir()
    assert launch([RESUME, str(straight), str(tmp_path / "model0"), "4", "-1"]).returncode == 0

    crashed = launch([RESUME, str(resumed), str(model_dir), "4", "1"])
    assert crashed.returncode == 17, crashed.stdout + crashed.stderr
    # The exact state of epoch 2's end, in place of Keras's BackupAndRestore: the model from
    # the chief, each rank's random generators, where the input stands. Only the chief wrote
    # the checkpoint.
    assert sorted(p.name for p in (model_dir / "preempted").iterdir()) == [
        "model.keras", "rank-0.npz", "rank-1.npz", "state.json"]
    assert not (model_dir / "backup").exists()
    assert sorted(p.name for p in model_dir.glob("**/*.keras")) == ["checkpoint.keras",
                                                                     "model.keras"]
    assert [p.name for p in model_dir.glob("logs")] == tensorboard_logs()
    _loads(model_dir / "checkpoint.keras")  # the chief's checkpoint of a run that crashed

    run = launch([RESUME, str(resumed), str(model_dir), "4", "-1"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "resuming at step 8 of epoch 2 (its end)" in run.stdout, run.stdout[-3000:]
    assert [load_result(resumed, r)["epochs_seen"] for r in (0, 1)] == [[2, 3], [2, 3]]
    assert not (model_dir / "preempted").exists(), "the state is removed after a finished run"
    for rank in (0, 1):
        for a, b in zip(load_weights(straight, rank), load_weights(resumed, rank), strict=True):
            np.testing.assert_array_equal(a, b)


def _loads(checkpoint):
    """The checkpoint is a model Keras loads, in a process of its own."""
    import subprocess
    import sys

    code = ("import keras, sys; m = keras.models.load_model(sys.argv[1]); "
            "print(m.count_params())")
    loaded = subprocess.run([sys.executable, "-c", code, str(checkpoint)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert loaded.returncode == 0, loaded.stderr
    assert int(loaded.stdout.split()[-1]) == 8 * 8 + 8 + 8 * 2 + 2
