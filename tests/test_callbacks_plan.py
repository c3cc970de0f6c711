"""The plan of ``dist.callbacks()`` (tfdist/keras/plan.py): which callbacks, in which order, for
each Keras and backend; the options a Keras cannot honour, refused with the fix; how a user's
writer runs on each rank. Then the bodies every Keras shares (tfdist/keras/routing.py,
tfdist/keras/warmup.py) on stand-in Keras classes, and one real 2-process run of Keras 3 on JAX
(warm-up, chief_only, the user's writers routed, the backup per rank).

The tables are pure: no framework is imported.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import ROOT, WORKERS, clean_env, require

from tfdist.backend_facts import JAX, TF, backend
from tfdist.errors import ConfigError
from tfdist.keras import plan, routing
from tfdist.keras.plan import (
    BACKEND,
    BACKUP,
    BATCH_STATISTICS,
    CHECKPOINT,
    CHIEF_ONLY,
    KERAS3,
    KERAS3_JAX,
    PREEMPTION,
    PROGRESS,
    SILENT_PROGRESS_BAR,
    SYNC_CHECK,
    TENSORBOARD,
    TF_KERAS,
    THROUGHPUT,
    WARMUP,
    YOURS,
    Facts,
)
from tfdist.keras.warmup import Warmup


def facts(name: str = "mwms", keras: str = KERAS3, **given: object) -> Facts:
    """A rank's facts: rank 0 of 2 processes with a replica each, as the backend's handle says
    (MWMS and JAX save on every rank)."""
    row = backend(name, JAX if keras == KERAS3_JAX else TF)
    defaults = {"rank": 0, "world_size": 2, "num_replicas": 2,
                "save_on_every_rank": name in ("mwms", "jax"),
                "strategy_spans_workers": name == "mwms"}
    return Facts(row, keras, **{**defaults, **given})  # type: ignore[arg-type]


ENV: dict[str, str] = {}  # the settings' variables unset
MODEL_DIR = {"model_dir": "/m"}
WRITERS = [CHECKPOINT, TENSORBOARD, PREEMPTION]

PLANS: dict[str, tuple[dict[str, Any], Facts, list[str]]] = {
    # name: (options, facts, the kinds in order)
    "MWMS Keras 3": ({}, facts(), [PROGRESS, BACKEND, BATCH_STATISTICS, YOURS, SYNC_CHECK,
                                   THROUGHPUT]),
    "MWMS Keras 3, model_dir": (MODEL_DIR, facts(), [
        PROGRESS, BACKEND, BATCH_STATISTICS, YOURS, SYNC_CHECK, *WRITERS, THROUGHPUT]),
    "MWMS tf_keras (synced statistics), rank 1": (MODEL_DIR, facts(keras=TF_KERAS, rank=1), [
        PROGRESS, BACKEND, YOURS, SYNC_CHECK, *WRITERS, THROUGHPUT, SILENT_PROGRESS_BAR]),
    "Horovod tf_keras (each rank its statistics)": ({}, facts("horovod", TF_KERAS), [
        PROGRESS, BACKEND, BATCH_STATISTICS, YOURS, SYNC_CHECK, THROUGHPUT]),
    "fit's input not followed: Keras's backup": (MODEL_DIR, facts(input_tracked=False), [
        PROGRESS, BACKEND, BATCH_STATISTICS, BACKUP, YOURS, SYNC_CHECK, *WRITERS, THROUGHPUT]),
    "preempt=False: Keras's backup": ({**MODEL_DIR, "preempt": False}, facts(), [
        PROGRESS, BACKEND, BATCH_STATISTICS, BACKUP, YOURS, SYNC_CHECK, CHECKPOINT, TENSORBOARD,
        THROUGHPUT]),
    "warm-up and chief_only": ({"warmup_epochs": 2, "chief_only": [object()]}, facts(), [
        PROGRESS, BACKEND, BATCH_STATISTICS, WARMUP, YOURS, SYNC_CHECK, CHIEF_ONLY,
        THROUGHPUT]),
    "one replica: nothing to average or compare": (
        {}, facts("single", world_size=1, num_replicas=1), [PROGRESS, BACKEND, YOURS,
                                                            THROUGHPUT]),
    "mirrored, 2 replicas in one process": (
        {}, facts("mirrored", world_size=1), [PROGRESS, BACKEND, BATCH_STATISTICS, YOURS,
                                             SYNC_CHECK, THROUGHPUT]),
    "everything off": (
        {**MODEL_DIR, "checkpoint": False, "tensorboard": False, "backup": False,
         "preempt": False, "sync_check": False, "average_batch_statistics": False,
         "throughput": False}, facts(), [PROGRESS, BACKEND, YOURS]),
    "tensorboard not installed": (MODEL_DIR, facts(tensorboard_missing=("tensorboard",)), [
        PROGRESS, BACKEND, BATCH_STATISTICS, YOURS, SYNC_CHECK, CHECKPOINT, PREEMPTION,
        THROUGHPUT]),
    "Keras 3 on JAX": (MODEL_DIR, facts("jax", KERAS3_JAX), [
        BACKEND, YOURS, SYNC_CHECK, *WRITERS, THROUGHPUT]),
    "Keras 3 on JAX, rank 1, warm-up, chief_only": (
        {"warmup_epochs": 1, "chief_only": [object()]}, facts("jax", KERAS3_JAX, rank=1), [
            BACKEND, WARMUP, YOURS, SYNC_CHECK, CHIEF_ONLY, THROUGHPUT, SILENT_PROGRESS_BAR]),
    "Keras 3 on JAX, preempt=False: Keras's backup per rank": (
        {**MODEL_DIR, "preempt": False}, facts("jax", KERAS3_JAX), [
            BACKEND, BACKUP, YOURS, SYNC_CHECK, CHECKPOINT, TENSORBOARD, THROUGHPUT]),
    "Keras 3 on JAX without TensorFlow": (
        MODEL_DIR, facts("jax", KERAS3_JAX, sync_check_readable=False,
                         tensorboard_missing=("tensorflow",)), [
            BACKEND, YOURS, CHECKPOINT, PREEMPTION, THROUGHPUT]),
    "Keras 3 on JAX, average_batch_statistics=False": (
        {"average_batch_statistics": False}, facts("jax", KERAS3_JAX), [
            BACKEND, YOURS, SYNC_CHECK, THROUGHPUT]),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_which_callbacks_in_which_order(case):
    options, rank_facts, kinds = PLANS[case]
    assert list(plan.plan(plan.options(**options), rank_facts, environ=ENV).kinds) == kinds


def test_the_steps_carry_what_the_classes_take():
    extra = (object(),)
    chosen = plan.plan(plan.options(model_dir="/m", warmup_epochs=0.5, checkpoint_every="2min",
                                    sync_check_every=3, global_batch=64),
                       facts(input_tracked=False, num_replicas=4), extra, ENV)
    assert chosen[YOURS].args == {"callbacks": extra}
    assert chosen[BACKUP].args == {"path": os.path.join("/m", "backup")}
    assert chosen[WARMUP].args == {"epochs": 0.5, "replicas": 4}
    assert chosen[SYNC_CHECK].args == {"every": 3, "batch_statistics": True}
    assert chosen[CHECKPOINT].args == {"path": os.path.join("/m", "checkpoint.keras")}
    assert chosen[TENSORBOARD].args == {"path": os.path.join("/m", "logs")}
    # Keras's backup stands in for the exact state's saves at each epoch's end.
    assert chosen[PREEMPTION].args == {"model_dir": "/m", "every": "2min", "epoch_saves": False}
    assert chosen[THROUGHPUT].args == {"global_batch": 64, "model_dir": "/m"}
    exact = plan.plan(plan.options(model_dir="/m"), facts(), environ=ENV)
    assert exact[PREEMPTION].args["epoch_saves"] is True


@pytest.mark.parametrize(("environ", "left_out"), [
    ({"TFDIST_SYNC_CHECK": "0"}, SYNC_CHECK),
    ({"TFDIST_AVERAGE_BATCH_STATISTICS": "0"}, BATCH_STATISTICS),
])
def test_the_variables_turn_steps_off(environ, left_out):
    assert left_out in plan.plan(plan.options(), facts(), environ=ENV).kinds
    assert left_out not in plan.plan(plan.options(), facts(), environ=environ).kinds
    assert plan.plan(plan.options(), facts(), environ={"TFDIST_SYNC_CHECK_EVERY": "7"})[
        SYNC_CHECK].args["every"] == 7


@pytest.mark.parametrize("keras", [KERAS3, TF_KERAS, KERAS3_JAX])
def test_every_kind_a_keras_is_asked_for_is_in_the_table(keras):
    # Keras 3 on JAX has no class for two kinds: the plan never asks for them there.
    name = "jax" if keras == KERAS3_JAX else "horovod"
    chosen = plan.plan(plan.options(model_dir="/m", warmup_epochs=1, chief_only=[object()],
                                    preempt=False), facts(name, keras, rank=1), environ=ENV)
    assert set(chosen.kinds) <= set(plan.KINDS)
    absent = {BATCH_STATISTICS, PROGRESS} & set(chosen.kinds)
    assert (absent == set()) is (keras == KERAS3_JAX)


NOTES = {
    "TensorFlow's Keras, no tensorboard": (
        facts(tensorboard_missing=("tensorboard",)), logging.WARNING,
        "tfdist: TensorBoard logs are off: the `tensorboard` package is not installed (pip "
        "install tensorboard, or callbacks(tensorboard=False))"),
    "JAX, no TensorFlow": (
        facts("jax", KERAS3_JAX, tensorboard_missing=("tensorboard", "tensorflow"),
              sync_check_readable=False), logging.INFO,
        "tfdist: the replica sync check is off: it needs TensorFlow installed"),
}


@pytest.mark.parametrize("case", sorted(NOTES))
def test_what_is_left_out_by_default_is_said(case):
    rank_facts, level, line = NOTES[case]
    assert (level, line) in plan.plan(plan.options(**MODEL_DIR), rank_facts, environ=ENV).notes


JAX_NO_TF = facts("jax", KERAS3_JAX, sync_check_readable=False)
REFUSED: dict[str, tuple[dict[str, Any], Facts, str | None]] = {
    # name: (options, facts, words of the one line, or None: honoured)
    "JAX: average_batch_statistics=True": (
        {"average_batch_statistics": True}, facts("jax", KERAS3_JAX),
        r"average_batch_statistics=True\): on Keras 3 on JAX .* nothing to average\. Drop the "
        "argument"),
    "JAX: average_batch_statistics=False": (
        {"average_batch_statistics": False}, facts("jax", KERAS3_JAX), None),
    "JAX: the default statistics": ({}, facts("jax", KERAS3_JAX), None),
    "TensorFlow: average_batch_statistics=True": (
        {"average_batch_statistics": True}, facts(), None),
    "JAX without TensorFlow: sync_check=True": (
        {"sync_check": True}, JAX_NO_TF, r"sync_check=True\): .* not installed here. Install "
        "tensorflow, or drop the argument"),
    "JAX without TensorFlow: sync_check_every": (
        {"sync_check_every": 5}, JAX_NO_TF, r"sync_check_every=5\): .*through TensorFlow"),
    "JAX without TensorFlow: the default check": ({}, JAX_NO_TF, None),
    "JAX without TensorFlow: one device, sync_check=True": (
        {"sync_check": True}, replace(JAX_NO_TF, world_size=1, num_replicas=1), None),
    "sync_check_every with the check off": (
        {"sync_check_every": 4, "sync_check": False}, facts(),
        r"sync_check_every=4\) times the replica sync check, which sync_check=False turns "
        "off: drop one"),
    "global_batch with the meter off": (
        {"global_batch": 64, "throughput": False}, facts(),
        r"global_batch=64\) is the throughput meter's .* throughput=False turns off"),
    "checkpoint_every without model_dir": (
        {"checkpoint_every": 60}, facts(), r"checkpoint_every=60\) .* but no model_dir: pass "
        r"model_dir=\.\.\. with preempt on, or drop checkpoint_every"),
    "checkpoint_every with preempt=False": (
        {**MODEL_DIR, "checkpoint_every": "1min", "preempt": False}, facts("jax", KERAS3_JAX),
        r"checkpoint_every='1min'\) .* but preempt=False"),
    "checkpoint_every with model_dir": ({**MODEL_DIR, "checkpoint_every": 60}, facts(), None),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_option_that_cannot_be_honoured_is_refused_with_the_fix(case):
    options, rank_facts, words = REFUSED[case]
    if words is None:
        plan.plan(plan.options(**options), rank_facts, environ=ENV)
        return
    with pytest.raises(ConfigError, match=r"^dist\.callbacks\(" + words) as info:
        plan.plan(plan.options(**options), rank_facts, environ=ENV)
    assert "\n" not in str(info.value)


def test_a_variable_serving_every_backend_is_not_refused():
    # Only an argument is refused: a job's TFDIST_CHECKPOINT_EVERY may serve dist.callbacks()
    # without model_dir (an evaluate's) in the same script.
    plan.plan(plan.options(), facts(), environ={"TFDIST_CHECKPOINT_EVERY": "60"})
    plan.plan(plan.options(), facts("jax", KERAS3_JAX),
              environ={"TFDIST_AVERAGE_BATCH_STATISTICS": "1"})


def test_an_unknown_option_names_the_nearest():
    with pytest.raises(TypeError, match="no option 'chekpoint'; did you mean 'checkpoint'"):
        plan.options(chekpoint=False)
    with pytest.raises(TypeError, match=r"no option 'zzz'\. Its options: model_dir, "):
        plan.options(zzz=1)


ROUTES = {
    # name: (what the callback is, facts, how it runs)
    "anything else": (None, facts(), plan.AS_GIVEN),
    "a writer, one process": (plan.FILE_WRITER, facts(world_size=1), plan.AS_GIVEN),
    "a writer, MWMS (a save runs collectives)": (plan.FILE_WRITER, facts(), plan.CHIEF_WRITES),
    "a writer, Horovod": (plan.FILE_WRITER, facts("horovod"), plan.CHIEF_ALONE),
    "a writer, Keras 3 on JAX": (plan.FILE_WRITER, facts("jax", KERAS3_JAX), plan.CHIEF_WRITES),
    "a backup, Keras 3 under MWMS": (plan.BACKUP_WRITER, facts(), plan.PER_RANK),
    "a backup, tf_keras under MWMS (kept apart)": (plan.BACKUP_WRITER, facts(keras=TF_KERAS),
                                                   plan.AS_GIVEN),
    "a backup, tf_keras under Horovod": (plan.BACKUP_WRITER, facts("horovod", TF_KERAS),
                                         plan.PER_RANK),
    "a backup, Keras 3 on JAX": (plan.BACKUP_WRITER, facts("jax", KERAS3_JAX), plan.PER_RANK),
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_how_a_users_writer_runs(case):
    writer, rank_facts, how = ROUTES[case]
    assert plan.route(writer, rank_facts) == how


# --- the shared bodies on stand-in Keras classes ----------------------------------------------

class Callback:
    def __init__(self) -> None:
        self.model: Any = None
        self.params: Any = None

    def set_model(self, model: object) -> None:
        self.model = model

    def set_params(self, params: object) -> None:
        self.params = params


class ModelCheckpoint(Callback):
    def __init__(self, filepath: str) -> None:
        super().__init__()
        self.filepath = filepath


class BackupAndRestore(Callback):  # Keras 3's: the paths derived in __init__
    def __init__(self, backup_dir: str) -> None:
        super().__init__()
        self.backup_dir, self.delete_checkpoint = backup_dir, True
        self._weights_path = os.path.join(backup_dir, "latest.weights.h5")
        self._training_metadata_path = os.path.join(backup_dir, "training_metadata.json")


class WorkerBackupAndRestore(BackupAndRestore):
    pass


class ChiefOnly(routing.ChiefOnly, Callback):
    pass


class ChiefWrites(routing.ChiefWrites, Callback):
    pass


class PerRankFiles(routing.PerRankFiles, Callback):
    pass


CLASSES = routing.Classes(ChiefOnly, ChiefWrites, PerRankFiles)


def test_what_a_callback_is_is_read_off_its_classes():
    assert routing.writer_kind(ModelCheckpoint("/c.keras")) == plan.FILE_WRITER
    assert routing.writer_kind(BackupAndRestore("/b")) == plan.BACKUP_WRITER
    assert routing.writer_kind(WorkerBackupAndRestore("/b")) is None  # tfdist's, per rank
    assert routing.writer_kind(Callback()) is None
    assert routing.writer_kind(ChiefOnly(ModelCheckpoint("/c.keras"), True)) is None


def test_a_users_backup_moves_to_a_folder_per_rank():
    backup = BackupAndRestore("/b")
    routed = routing.route_writer(facts("jax", KERAS3_JAX, rank=1), backup, CLASSES)
    assert isinstance(routed, PerRankFiles) and routed.root == "/b"
    assert (backup.backup_dir, backup._weights_path) == (
        os.path.join("/b", "rank-1"), os.path.join("/b", "rank-1", "latest.weights.h5"))
    tf_keras = BackupAndRestore("/b")
    assert routing.route_writer(facts("horovod", TF_KERAS), tf_keras, CLASSES) is tf_keras
    assert tf_keras.backup_dir == os.path.join("/b", "rank-0")  # read when training begins


def test_a_writer_runs_on_the_chief_alone_where_a_save_runs_no_collective():
    writer = ModelCheckpoint("/c.keras")
    routed = routing.route_writer(facts("horovod", rank=1), writer, CLASSES)
    assert isinstance(routed, ChiefOnly) and not routed.is_chief
    assert routed.on_epoch_end(0) is None and writer.filepath == "/c.keras"
    assert routing.route_writer(facts(world_size=1), writer, CLASSES) is writer


class Rate:
    def __init__(self, value: float) -> None:
        self.value, self.assigned = value, list[float]()

    def __float__(self) -> float:
        return self.value

    def assign(self, value: float) -> None:
        self.value = value
        self.assigned.append(value)


class LearningRateSchedule:
    pass


class CosineDecay(LearningRateSchedule):
    pass


class LearningRateWarmup(Warmup, Callback):
    pass


def _warmup(epochs: float, steps: int | None, rate: object = None) -> LearningRateWarmup:
    callback = LearningRateWarmup(epochs, 4)
    learning_rate = Rate(0.8) if rate is None else rate
    optimizer = SimpleNamespace(learning_rate=learning_rate, _learning_rate=learning_rate)
    callback.set_model(SimpleNamespace(optimizer=optimizer))
    callback.set_params({"steps": steps})
    return callback


def test_the_warmup_ramps_by_step_and_sets_the_rate_only_when_it_changes():
    callback = _warmup(1, 2)
    callback.on_train_begin()
    for epoch in range(3):
        callback.on_epoch_begin(epoch)
        for batch in range(2):
            callback.on_train_batch_begin(batch)
    assigned = callback.model.optimizer.learning_rate.assigned
    assert assigned == pytest.approx([0.2, 0.5, 0.8])  # then 0.8 stands: set once


def test_the_warmup_ramps_by_epoch_when_steps_are_unknown():
    callback = _warmup(2, None)
    callback.on_train_begin()
    for epoch in range(3):
        callback.on_epoch_begin(epoch)
    assert callback.model.optimizer.learning_rate.assigned == pytest.approx([0.2, 0.5, 0.8])


def test_the_warmup_refuses_a_schedule_with_the_fix():
    callback = _warmup(1, 2, CosineDecay())
    with pytest.raises(ConfigError, match=r"CosineDecay schedule.*warmup_steps"):
        callback.on_train_begin()


# --- a real run: Keras 3 on JAX, 2 processes --------------------------------------------------

@pytest.mark.multiprocess
def test_keras_3_on_jax_honours_the_plan_on_two_processes(tmp_path):
    require("jax")
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2",
                          str(WORKERS / "jax_callbacks_worker.py"), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, check=False,
                         env=clean_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2"))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # The rate each step ran with (in fit's state, not the variable): from lr / replicas up to
    # lr over the first epoch's 4 steps, then lr, the same on both ranks.
    assert ranks[1]["classes"] == [
        "WorkerBackupAndRestore", "LearningRateWarmup", "ChiefWrites", "ChiefWrites",
        "PerRankFiles", "Probe", "ChiefOnly", "EpochCheckpoint", "SilentProgbar"]
    assert ranks[0]["classes"] == ranks[1]["classes"][:-1]
    expected = [0.04, 0.05, 0.06, 0.07, 0.08, 0.08, 0.08, 0.08]
    for record in ranks:
        assert record["rates"] == pytest.approx(expected, abs=1e-7)
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # chief_only: the chief alone ran it.
    assert [record["chief_only_epochs"] for record in ranks] == [[0, 1], []]
    # The user's writers: the chief wrote each file once, rank 1 wrote none of them.
    assert (tmp_path / "user.keras").is_file()
    assert (tmp_path / "log.csv").read_text().count("\n") == 3  # the header and 2 epochs
    assert sorted(os.listdir(tmp_path / "user-backup")) == ["rank-0", "rank-1"]
    # preempt=False: Keras's backup in model_dir/backup, a folder per rank during training.
    assert ranks[0]["backup_at_epoch_end"] == ["rank-0", "rank-1"]
    assert (tmp_path / "model" / "checkpoint.keras").is_file()
    assert "ModelCheckpoint writes from the chief only" in output
    assert "BackupAndRestore keeps one folder per rank" in output
    assert ranks[0]["refused"].startswith("dist.callbacks(average_batch_statistics=True)")
