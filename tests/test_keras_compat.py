"""Guards for the Keras 3 multi-worker fix (keras-team/keras#20585).

If one of these fails after a Keras upgrade, Keras changed underneath tfdist: check whether
upstream fixed the defects (then narrow ``tfdist.keras.versions.AFFECTED``) or moved the patched
functions (then update the wrappers).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys

import pytest
from helpers import WORKERS, clean_env, launch

from tfdist.keras import checks, keras3, versions

keras = pytest.importorskip("keras")
KERAS3 = versions.is_keras3(keras)
# The TensorFlow 2.15 lane's `keras` is Keras 2.15: there is nothing of Keras 3's to patch.
keras3_only = pytest.mark.skipif(not KERAS3, reason=f"keras {keras.__version__} is Keras 2")


@pytest.mark.skipif(KERAS3, reason="Keras 3: the next test checks its range")
def test_keras2_gets_no_fix():
    assert not versions.needs_fix()
    assert not keras3.apply()


@keras3_only
def test_pinned_keras_is_in_the_affected_range():
    assert versions.needs_fix(), (
        f"Keras {keras.__version__} is outside tfdist.keras.versions.AFFECTED={versions.AFFECTED}"
        ": re-run tests/test_multiworker.py with TFDIST_KERAS_FIX=0 and adjust the range")


@keras3_only
def test_patched_functions_still_have_the_upstream_defects():
    from keras.src.backend.tensorflow import trainer

    symbolic_build = versions.trainer_class()._maybe_symbolic_build
    build = inspect.getsource(getattr(symbolic_build, "__wrapped__", symbolic_build))
    reduce = inspect.getsource(getattr(trainer.reduce_per_replica, "__wrapped__",
                                       trainer.reduce_per_replica))
    assert list(inspect.signature(trainer.reduce_per_replica).parameters) == [
        "values", "strategy", "reduction"]
    assert "maybe_distributed_data_batch," in build and "axis=None" in build, (
        "Keras changed _maybe_symbolic_build: defect 1 of keras#20585 may be fixed upstream")
    assert 'strategy.reduce("MEAN", v, axis=0)' in reduce, (
        "Keras changed reduce_per_replica: defect 2 of keras#20585 may be fixed upstream")
    make = versions.trainer_class()._make_function
    steps = inspect.getsource(getattr(make, "__wrapped__", make))
    assert "get_next_as_optional" in steps and "tf.cond(" in steps, (
        "Keras changed multi_step_on_iterator: steps_per_execution may work on several workers "
        "upstream now (tests/test_keras_traps.py checks it with the fix)")


@pytest.mark.parametrize(("begin", "epoch_steps", "expected"), [
    (0, 8, 3), (3, 8, 3), (6, 8, 2),  # 8 steps in chunks of 3: the last has 2
    (9, 8, 0),  # past the end: nothing to run (the epoch ends)
    (30, None, 3),  # unknown length: always full chunks
])
def test_an_execution_runs_what_the_epoch_has_left(begin, epoch_steps, expected):
    assert keras3.steps_in_chunk(begin, epoch_steps, 3) == expected


def test_legacy_keras_needs_no_fix(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert not versions.needs_fix()


@keras3_only
@pytest.mark.multiprocess
def test_without_the_fix_two_worker_fit_still_fails_upstream(tmp_path):
    run = launch([str(WORKERS / "train_worker.py"), str(tmp_path), "fit", "dist"],
                 env={"TFDIST_KERAS_FIX": "0"})
    assert run.returncode != 0
    assert "Attempt to convert a value (PerReplica" in run.stdout + run.stderr, (
        "Keras 3 multi-worker fit no longer fails without tfdist's fix: keras#20585 may be "
        "fixed upstream; narrow tfdist.keras.versions.AFFECTED")


def _callbacks() -> dict[str, object]:
    import keras

    from tfdist.keras.callbacks import AtomicCheckpoint, ChiefOnly, ChiefWrites

    class StopOnLoss(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.model.stop_training = logs["loss"] < 0.1

    class EpochsOnly(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
            pass

    class EarlierStopping(keras.callbacks.EarlyStopping):
        def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
            self.model.stop_training = bool(logs)

    return {
        "none": None,
        "Keras's epoch callbacks": [keras.callbacks.EarlyStopping(), keras.callbacks.History(),
                                    keras.callbacks.ReduceLROnPlateau(),
                                    keras.callbacks.CSVLogger("/tmp/x.csv")],
        "progress bar and TensorBoard": [keras.callbacks.ProgbarLogger(),
                                         keras.callbacks.TensorBoard("/tmp/tb")],
        "ModelCheckpoint per epoch": [keras.callbacks.ModelCheckpoint("/tmp/m.keras")],
        "ModelCheckpoint every 5 steps": [keras.callbacks.ModelCheckpoint("/tmp/m.keras",
                                                                          save_freq=5)],
        "TerminateOnNaN": [keras.callbacks.TerminateOnNaN()],
        "LambdaCallback": [keras.callbacks.LambdaCallback(on_train_batch_end=print)],
        "yours, on batches": [StopOnLoss()],
        "yours, on epochs": [EpochsOnly()],
        "a subclass of a safe one, on batches": [EarlierStopping()],
        "tfdist's own": [AtomicCheckpoint("/tmp/a.keras")],
        "yours, behind ChiefOnly": [ChiefOnly(StopOnLoss(), True)],
        "per-step ModelCheckpoint behind ChiefWrites": [
            ChiefWrites(keras.callbacks.ModelCheckpoint("/tmp/m.keras", save_freq=5), 0)],
        "a CallbackList": keras.callbacks.CallbackList([StopOnLoss()]),
    }


STEP_LOGS = {  # callbacks -> (global under "auto", the callback named in the reason)
    "none": (False, None),
    "Keras's epoch callbacks": (False, None),
    "progress bar and TensorBoard": (False, None),
    "ModelCheckpoint per epoch": (False, None),
    "ModelCheckpoint every 5 steps": (True, "ModelCheckpoint"),
    "TerminateOnNaN": (True, "TerminateOnNaN"),
    "LambdaCallback": (True, "LambdaCallback"),
    "yours, on batches": (True, "StopOnLoss"),
    "yours, on epochs": (False, None),
    "a subclass of a safe one, on batches": (True, "EarlierStopping"),
    "tfdist's own": (False, None),
    "yours, behind ChiefOnly": (True, "StopOnLoss"),
    "per-step ModelCheckpoint behind ChiefWrites": (True, "ModelCheckpoint"),
    "a CallbackList": (True, "StopOnLoss"),
}


@pytest.mark.parametrize("case", sorted(STEP_LOGS))
def test_step_logs_are_global_only_when_a_callback_reads_them(case):
    expected, named = STEP_LOGS[case]
    is_global, why = keras3.step_logs_global("auto", _callbacks()[case])
    assert is_global is expected, why
    if named:
        assert f"the callback {named} reads each step's logs" == why


def test_a_model_with_its_own_step_has_global_step_logs():
    """What an own train_step/test_step returns need not be a compiled metric, which Keras
    reads over all workers at the epoch's end: its last step's value is the epoch's."""
    import keras

    class OwnTrain(keras.Model):
        def train_step(self, data):  # type: ignore[no-untyped-def]
            return {}

    class OwnTest(keras.Sequential):
        def test_step(self, data):  # type: ignore[no-untyped-def]
            return {}

    class Plain(keras.Sequential):
        pass

    assert keras3.step_logs_global("auto", None, OwnTrain()) == (
        True, "OwnTrain has its own train_step, whose results Keras logs")
    assert checks.own_step(OwnTest()) == "test_step"
    assert checks.own_step(Plain()) is None
    assert keras3.step_logs_global("auto", None, Plain())[0] is False
    assert keras3.step_logs_global("local", None, OwnTrain())[0] is False


@pytest.mark.parametrize("mode", ["global", "local"])
def test_step_logs_setting_overrides_the_callbacks(mode):
    for callbacks in _callbacks().values():
        assert keras3.step_logs_global(mode, callbacks) == (
            mode == "global", f"TFDIST_STEP_LOGS={mode}")


@pytest.mark.skipif(KERAS3 and importlib.util.find_spec("tf_keras") is None,
                    reason="no Keras 2 here: tf.keras is Keras 3 and tf_keras is not installed "
                           "(the TensorFlow 2.22 lane: no tf_keras 2.22 yet)")
def test_init_repairs_keras2_after_tensorflow_214_started_inside_absl(tmp_path):
    """TensorFlow <= 2.14 imported inside absl's app.run (tfdist's examples, any absl-flags
    script importing TensorFlow in main) creates its eager context before eager execution is on;
    Keras 2 then builds graph placeholders and no model can be built. Checked by hand on
    TensorFlow 2.14.1 with examples/keras_train.py (2 workers, equal digests once repaired);
    here, where TensorFlow starts well, the worker makes that state itself, and the first build
    must fail as on 2.14 (the control) before init repairs it."""
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="2")
    if KERAS3:  # tf.keras is Keras 3 here: Keras 2 is tf_keras
        env["TF_USE_LEGACY_KERAS"] = "1"
    run = subprocess.run([sys.executable, str(WORKERS / "eager_record_worker.py")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["whole_record_repaired"] is False
    assert "must be the output of a TensorFlow `Layer`" in result["broken"], result["broken"]
    assert result["entries_after_init"] == 1
    assert result["params"] == 4 * 3 + 3 + 3 * 2 + 2


@pytest.mark.parametrize(("layout", "found"), [
    ({"src/__init__.py": "", "src/engine/__init__.py": "",
      "src/engine/training.py": "where = 'src'"}, "src"),  # Keras 2.13 on (tf_keras, TF 2.15)
    ({"engine/__init__.py": "", "engine/training.py": "where = 'top'"}, "top"),  # Keras 2.12
])
def test_keras2_internals_are_found_with_or_without_src(tmp_path, monkeypatch, layout, found):
    package = f"oldkeras_{found}"
    for name, text in {"__init__.py": "__version__ = '2.12.0'", **layout}.items():
        (tmp_path / package / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / package / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(versions, "keras2_package", lambda: package)
    assert versions.keras2_module("engine.training").where == found


def test_a_keras2_module_that_fails_inside_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "brokenkeras" / "src").mkdir(parents=True)
    for name in ("__init__.py", "src/__init__.py"):
        (tmp_path / "brokenkeras" / name).write_text("")
    (tmp_path / "brokenkeras" / "src" / "backend.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(versions, "keras2_package", lambda: "brokenkeras")
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        versions.keras2_module("backend")
