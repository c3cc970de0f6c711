"""tfdist's Keras callbacks on 2 real workers: one writer, per-rank backups, resumption."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WORKERS, launch, load_result, load_weights, tensorboard_logs

from tfdist.keras_compat import keras2_package

pytestmark = pytest.mark.multiprocess
RESUME = str(WORKERS / "resume_worker.py")


def test_preempted_job_resumes_where_it_stopped_and_matches_an_uninterrupted_one(tmp_path):
    straight, resumed, model_dir = tmp_path / "straight", tmp_path / "resumed", tmp_path / "model"
    straight.mkdir(), resumed.mkdir()
    assert launch([RESUME, str(straight), str(tmp_path / "model0"), "4", "-1"]).returncode == 0

    crashed = launch([RESUME, str(resumed), str(model_dir), "4", "1"])
    assert crashed.returncode == 17, crashed.stdout + crashed.stderr
    # Each rank backed up into its own directory; only the chief wrote the checkpoint. Keras 2
    # (TensorFlow 2.15's tf.keras, tf_keras) keeps the workers apart itself: the others' backups
    # go to temporary folders.
    backups = ["chief"] if keras2_package() else ["rank-0", "rank-1"]
    assert sorted(p.name for p in (model_dir / "backup").iterdir()) == backups
    assert [p.name for p in model_dir.glob("**/*.keras")] == ["checkpoint.keras"]
    assert [p.name for p in model_dir.glob("logs")] == tensorboard_logs()

    run = launch([RESUME, str(resumed), str(model_dir), "4", "-1"])
    assert run.returncode == 0, run.stdout + run.stderr
    assert [load_result(resumed, r)["epochs_seen"] for r in (0, 1)] == [[2, 3], [2, 3]]
    assert not (model_dir / "backup").exists(), "backups are removed after a finished run"
    for rank in (0, 1):
        for a, b in zip(load_weights(straight, rank), load_weights(resumed, rank), strict=True):
            np.testing.assert_array_equal(a, b)


def test_checkpoint_is_a_loadable_model(tmp_path):
    model_dir = tmp_path / "model"
    assert launch([RESUME, str(tmp_path), str(model_dir), "2", "-1"]).returncode == 0
    import subprocess
    import sys

    code = ("import keras, sys; m = keras.models.load_model(sys.argv[1]); "
            "print(m.count_params())")
    loaded = subprocess.run([sys.executable, "-c", code, str(model_dir / "checkpoint.keras")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert loaded.returncode == 0, loaded.stderr
    assert int(loaded.stdout.split()[-1]) == 8 * 8 + 8 + 8 * 2 + 2
