"""What ported public Keras scripts do, on 2 real workers, both backends, both Keras versions.

One launch per (backend, Keras) runs every case of tests/workers/keras_traps_worker.py in the
same two processes; the tests below read its results and files. Each case compares the ranks'
final weights by digest, and a control (the old chief-only checkpoint) must still break, so the
cases are known to exercise the defect they guard against.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    HOROVOD_PYTHON,
    ROOT,
    WORKERS,
    clean_env,
    full_matrix_only,
    require,
    tensorboard_logs,
)

WORKER = str(WORKERS / "keras_traps_worker.py")
HVD_PY = HOROVOD_PYTHON
ROWS = 256
# Keras 2 under MWMS runs in the TensorFlow 2.15 lane of `make test`, where "mwms-keras3" is
# TensorFlow 2.15's own Keras 2 as tf.keras (the tf_keras package is a copy of that Keras);
# here it would cost CI about 2 more minutes for the same Keras code.
COMBOS = {
    "mwms-keras3": (sys.executable, "mwms", "0"),
    "horovod-keras3": (str(HVD_PY), "horovod", "0"),
    "horovod-tf_keras": (str(HVD_PY), "horovod", "1"),
}

pytestmark = pytest.mark.multiprocess


class Run:
    """One 2-worker launch: its output, each rank's results, its folders."""

    def __init__(self, combo: str, out: Path) -> None:
        python, backend, legacy = COMBOS[combo]
        self.combo, self.backend, self.out, self.tmp = combo, backend, out, out / "tmp"
        self.python = python
        self.tmp.mkdir(parents=True)
        env = clean_env()
        env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS=legacy, TMPDIR=str(self.tmp))
        launch = ["--backend", "horovod"] if backend == "horovod" else []
        try:
            self.job = subprocess.run([python, "-m", "tfdist", "launch", *launch, "-n", "2",
                                       WORKER, str(out), backend], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      timeout=300, check=False)
        except subprocess.TimeoutExpired as error:  # the worker's faulthandler said where
            said = error.output or b""
            text = said.decode(errors="replace") if isinstance(said, bytes) else said
            raise AssertionError(f"the {combo} launch did not end in 300 s:\n{text[-8000:]}"
                                 ) from None
        self.results = [json.loads((out / f"result-{rank}.json").read_text())
                        for rank in (0, 1) if (out / f"result-{rank}.json").exists()]

    def case(self, name: str) -> list[dict[str, Any]]:
        """Both ranks' results of case ``name``; fails with the output if a rank failed."""
        assert len(self.results) == 2, self.job.stdout[-4000:]
        found = [result.get(name, {"error": "not reached"}) for result in self.results]
        errors = [f"rank {r}: {f['error']}" for r, f in enumerate(found) if "error" in f]
        assert not errors, "\n".join(errors) + "\n" + self.job.stdout[-4000:]
        return found


# Keras 3 under Horovod: in the full matrix only (tests/helpers.py). make test runs these cases
# on Keras 3 under MWMS and on tf_keras under Horovod, and Keras 3 under Horovod in
# test_horovod.py, test_loss_scaling.py and test_preemption.py.
FULL_ONLY = {"horovod-keras3": "Keras 3 runs them under MWMS and Horovod runs them on tf_keras"}


@pytest.fixture(scope="module", params=[
    pytest.param(combo, marks=full_matrix_only(FULL_ONLY[combo])) if combo in FULL_ONLY
    else combo for combo in sorted(COMBOS)])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    if COMBOS[request.param][1] == "horovod":
        require("horovod", python=HVD_PY)
    return Run(request.param, tmp_path_factory.mktemp(request.param))


def _same_on_both_ranks(found: list[dict[str, Any]], key: str = "digest") -> None:
    assert found[0][key] == found[1][key], found


def _valid_zip(path: Path) -> None:
    assert path.is_file(), path
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None, path


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_model_dir_saves_once_from_the_chief_with_fit_outside_or_inside_the_scope(run, where):
    found = run.case("model_dir" if where == "outside" else "inside_scope")
    _same_on_both_ranks(found)
    assert [f["wrote_final"] for f in found] == [True, False]
    model_dir = run.out / where
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "checkpoint.keras", "final.keras", *tensorboard_logs(run.python), "throughput.jsonl"]
    for name in ("checkpoint.keras", "final.keras"):
        _valid_zip(model_dir / name)
    # The meter: one line per epoch, from the chief only, with the global batch dist.shard saw
    records = [json.loads(line) for line in (model_dir / "throughput.jsonl").read_text()
               .splitlines()]
    assert [r["epoch"] for r in records] == [0, 1], records
    for record in records:
        assert (record["workers"], record["global_batch"], record["steps"]) == (2, 32, 8)
        assert record["timed_steps"] == 7 and record["step_time_s"]["median"] > 0
        assert record["examples_per_s"]["total"] == pytest.approx(
            32 / record["step_time_s"]["median"], rel=1e-3)
        assert record["backend"] == run.backend


def test_a_saved_model_reloaded_with_load_model_trains_on(run):
    # keras.models.load_model in the scope, as the Keras guide resumes: compiled from its saved
    # config with the optimizer's state (2 epochs of 8 steps), then one more epoch trains it
    # on both ranks alike. Before the fix (tfdist's compile wrapper set on keras.Model) Keras 3
    # warned the compile was custom and left the model without an optimizer.
    found = run.case("reload")
    for rank, result in enumerate(found):
        assert (result["compiled"], result["custom_compile_warned"]) == (True, False), (rank,
                                                                                         found)
        assert (result["iterations"], result["iterations_after"]) == (16, 24), (rank, found)
        assert result["trained"], found
    _same_on_both_ranks(found)


def test_the_other_ranks_scratch_directories_are_gone(run):
    run.case("model_dir")
    assert not list(run.tmp.glob("tfdist-rank*")), list(run.tmp.iterdir())


def test_users_own_writers_land_once_from_the_chief(run):
    _same_on_both_ranks(run.case("user_writers"))
    user = run.out / "user"
    assert sorted(p.name for p in user.iterdir()) == ["log.csv", "user.keras"]
    _valid_zip(user / "user.keras")
    rows = (user / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch") and [r.split(",")[0] for r in rows[1:]] == ["0", "1"]


def _no_files_under(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.is_file()], list(folder.rglob("*"))


def test_writers_passed_straight_to_fit_and_saves_on_every_rank_land_once(run):
    # A Keras tutorial's script: its writers straight to fit, no dist.callbacks, then
    # model.save and save_weights on every rank. Every file loads, on every rank, with the
    # final weights; the CSV log has one writer; the backups were one folder per rank.
    found = run.case("fit_writers")
    _same_on_both_ranks(found)
    folder = run.out / "fit_writers"
    for result in found:
        assert result["files"] == dict.fromkeys(
            ["checkpoint.keras", "final.keras", "final.weights.h5"], found[0]["digest"]), found
    kept = {p.name for p in folder.iterdir()} - {"backup"}
    assert kept == {"checkpoint.keras", "final.keras", "final.weights.h5", "log.csv",
                    *tensorboard_logs(run.python)}, kept
    if (folder / "backup").exists():  # removed by whichever rank ends last, or left empty
        _no_files_under(folder / "backup")
    rows = (folder / "log.csv").read_text().splitlines()
    assert rows[0].startswith("epoch") and [r.split(",")[0] for r in rows[1:]] == ["0", "1"]
    # Where each rank's checkpoint wrote: the chief the given path at both epochs; rank 1 a
    # scratch copy (MWMS: the save runs collectives) or nothing (Horovod).
    chief, other = found[0]["given"], found[1]["given"]
    assert chief == [str(folder / "recorded.keras")] * 2, found
    if run.backend == "mwms":
        assert len(other) == 2 and all("tfdist-rank1-" in path for path in other), found
    else:
        assert other == [], found
    for line in ("tfdist: ModelCheckpoint writes from the chief only",
                 "tfdist: CSVLogger writes from the chief only",
                 "tfdist: BackupAndRestore keeps one folder per rank",
                 "tfdist: model.save(", "tfdist: model.save_weights("):
        assert (line in run.job.stdout) or (line.startswith("tfdist: BackupAndRestore") and
                                            run.backend == "mwms" and not run.results[0]["keras3"]
                                            ), (line, run.job.stdout[-4000:])


def test_writers_with_fit_inside_the_scope_and_files_per_rank_on_purpose(run):
    found = run.case("fit_writers_inside")
    _same_on_both_ranks(found)
    for result in found:  # the chief's checkpoint; each rank's own file, written as given
        assert result["files"] == dict.fromkeys(
            ["w.weights.h5", "rank-0.keras", "rank-1.keras"], found[0]["digest"]), found


def test_a_checkpoint_on_the_chief_alone_is_refused_where_a_save_runs_collectives(run):
    found = run.case("chief_only_writer")
    if run.backend == "mwms":  # refused on every rank before the first step, with the fix
        for result in found:
            assert result["steps"] == 0, found
            assert "Pass the same callbacks on every rank" in result["refused"], found
        assert "rank 0: ModelCheckpoint" in found[0]["refused"], found
        assert "rank 1: none" in found[1]["refused"], found
    else:  # Horovod: a save runs no collective, so the chief's checkpoint just works
        _same_on_both_ranks(found)
        assert [r["refused"] for r in found] == [None, None], found
        assert all(r["files"] == {"c.keras": found[0]["digest"]} for r in found), found


def test_control_without_the_routing_every_rank_writes_the_one_path(run):
    found = run.case("control_writers_unrouted")
    path = str(run.out / "unrouted" / "r.keras")
    assert [r["given"] for r in found] == [[path], [path]], found


def test_optimizer_options_train_alike_or_are_refused_or_warned(run):
    found = run.case("optimizer_options")
    _same_on_both_ranks(found)  # clipnorm: trained to the same weights on both ranks
    keras3_mwms = run.backend == "mwms" and run.results[0]["keras3"]
    clipping = "clips each replica's gradients before they are averaged"
    assert run.job.stdout.count(clipping) == (1 if keras3_mwms else 0), run.job.stdout[-3000:]
    if not run.results[0]["keras3"]:
        return  # gradient_accumulation_steps is Keras 3's
    accumulation = [f["accumulation"] for f in found]
    if keras3_mwms:  # fails upstream: refused on every rank before the first step, with a fix
        for result in accumulation:
            assert "gradient_accumulation_steps=2) fails in Keras 3" in result["refused"]
            assert result["steps"] == 0, found
    else:
        assert [a["refused"] for a in accumulation] == [None, None], found
        _same_on_both_ranks(accumulation)


def test_lazily_built_and_subclassed_models_start_from_rank_0(run):
    found = run.case("lazy_model")
    _same_on_both_ranks(found, "sequential")
    _same_on_both_ranks(found, "subclassed")


def test_numpy_inputs_are_split_by_rank(run):
    found = run.case("numpy")
    _same_on_both_ranks(found)
    seen = [np.array(f["seen"]) for f in found]
    per_epoch = ROWS // 2  # each rank's share of every epoch
    assert [len(s) for s in seen] == [2 * per_epoch, 2 * per_epoch]
    everything = np.sort(np.random.default_rng(0).normal(size=(ROWS, 8)).astype("float32")[:, 0])
    for key in ("seen", "seen_shuffled"):  # shuffle=False, then Keras's default shuffle=True
        seen = [np.array(f[key]) for f in found]
        assert [len(s) for s in seen] == [2 * per_epoch, 2 * per_epoch], key
        for epoch in (0, 1):
            parts = [s[epoch * per_epoch:(epoch + 1) * per_epoch] for s in seen]
            np.testing.assert_array_equal(np.sort(np.concatenate(parts)), everything, key)
    _same_on_both_ranks(found, "shuffled_digest")
    # shuffled: each epoch is a new permutation, the same on every rank
    assert found[0]["seen_shuffled"] != found[0]["seen"], found[0]
    # dist.shard of a dataset shuffled without a seed: warned once, by the chief
    assert run.job.stdout.count("tfdist: the dataset given to dist.shard shuffles without a "
                                "seed") == 1, run.job.stdout[-3000:]
    if run.backend == "mwms":  # the control: each worker's own permutation misses rows
        parts = [np.array(f["seen_control"]) for f in found]
        assert [len(p) for p in parts] == [per_epoch, per_epoch], found
        assert not np.array_equal(np.sort(np.concatenate(parts)), everything)


def test_steps_per_execution_trains_as_one_step_at_a_time(run):
    found = run.case("steps_per_execution")
    _same_on_both_ranks(found)
    assert found[0]["digest"] == found[0]["one_step"]


def test_batch_norm_statistics_end_identical_on_every_rank(run):
    found = run.case("batch_norm")
    _same_on_both_ranks(found)  # moving statistics included
    # The control: without the average, Keras leaves each rank its own statistics (tf_keras
    # under MWMS averages them itself, on read).
    assert (found[0]["control"] != found[1]["control"]) == found[0]["averaged"], found
    # Keras 2 (tf_keras, or TensorFlow 2.15's tf.keras) under MWMS averages them itself
    assert found[0]["averaged"] == (run.backend != "mwms" or run.results[0]["keras3"])
    # A replica left without rows by the last batch: refused everywhere before a step
    assert {f["steps_after"] for f in found} == {found[0]["steps_after"]}, found
    for result in found:
        assert "holds 1 row(s) for 2 replicas" in (result["empty_replica"] or ""), found


FEATURES = ["validation", "weights", "dropout", "callbacks", "initial_epoch",
            "custom_train_step", "mixed_precision", "evaluate_predict"]


@pytest.mark.parametrize("feature", FEATURES)
def test_keras_features_end_with_identical_weights_on_every_rank(run, feature):
    found = run.case(feature)
    _same_on_both_ranks(found)
    check = {
        "validation": lambda f: (_same_on_both_ranks(f, "val_loss"), len(f[0]["val_loss"]) == 4),
        "callbacks": lambda f: (_same_on_both_ranks(f, "epochs"),
                                _same_on_both_ranks(f, "learning_rate"),
                                f[0]["epochs"] < 8 and f[0]["learning_rate"] < 0.01),
        "initial_epoch": lambda f: f[0]["epochs"] == 2,
        "mixed_precision": lambda f: f[0]["compute_dtype"] == "bfloat16",
        "evaluate_predict": lambda f: (
            _same_on_both_ranks(f, "loss"),
            abs(f[0]["loss"] - f[0]["direct"]) < 1e-5 and f[0]["rows"] == 100
            and f[0]["predict_error"] < 1e-5 and f[0]["sharded_rows"] == 100
            and f[0]["sharded_error"] < 1e-5),
    }.get(feature)
    if check is not None:
        result = check(found)
        assert (result[-1] if isinstance(result, tuple) else result), found


def test_dropout_drawn_per_replica_is_named_once_on_tf_keras(run):
    # Keras 3 draws the global batch's mask (tests/test_loss_scaling.py: one process's);
    # tf_keras draws each replica's own: one warning on the chief, none on Keras 3
    run.case("dropout")
    named = "Dropout in a training step (tf_keras) draws each replica's own values"
    expected = 0 if run.results[0]["keras3"] else 1
    assert run.job.stdout.count(named) == expected, run.job.stdout[-3000:]


def test_two_workers_train_as_one_process_with_the_global_batch(run):
    found = run.case("one_process")
    _same_on_both_ranks(found)
    # Equal up to summation order; summed (not averaged) gradients or a rank's half batch
    # alone would differ by about as much as the weights moved.
    assert found[0]["max_difference"] < 1e-5 < found[0]["moved"], found


def test_each_steps_logs_are_global_when_a_callback_reads_them(run):
    found = run.case("step_logs")
    _same_on_both_ranks(found)
    auto, local = [f["auto"] for f in found], [f["local"] for f in found]
    assert auto[0]["epoch"] == auto[1]["epoch"] and local[0]["epoch"] == local[1]["epoch"]
    assert auto[0]["digest"] == local[0]["digest"]  # the logs change nothing else
    if run.backend == "mwms":  # Horovod's step logs are each rank's own, as upstream
        assert auto[0]["steps"] == auto[1]["steps"]
        # Keras 3 keeps each rank's own on request; Keras 2 (tf_keras, TF 2.15) has no such mode
        assert (local[0]["steps"] != local[1]["steps"]) == run.results[0]["keras3"], found


def test_jit_compile_trains_without_xla_where_xla_cannot_all_reduce(run):
    found = run.case("jit_compile")
    _same_on_both_ranks(found)
    assert found[0]["digest"] == found[0]["without_xla"]
    assert "compile(jit_compile=True) trains without XLA here" in run.job.stdout


def test_a_keras3_model_under_tf_use_legacy_keras_is_refused_with_the_fix(run):
    found = run.case("mixed_keras")
    if "skipped" in found[0]:
        pytest.skip(found[0]["skipped"])
    for f in found:
        assert f["refused"] and f["refused"].startswith("ConfigError: this model is a Keras 3"), f
        assert "Build the model with `tf.keras`" in f["refused"], f
        assert "unset TF_USE_LEGACY_KERAS" in f["refused"], f


def test_control_the_old_chief_only_checkpoint_still_breaks(run):
    found = run.case("control_chief_only_save")
    if run.backend != "mwms":
        pytest.skip(found[0]["skipped"])
    assert any(f["failed"] and "Collective" in f["failed"] for f in found), found


# float32 sums in another order, compounded over 2 epochs of SGD (measured: below 1e-6)
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
_alone_runs: dict[tuple[str, str], dict[str, Any]] = {}


@pytest.fixture(scope="module")
def alone(run: Run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The numbers cases (tests/workers/keras_numbers.py) run by one plain process with the same
    Python and Keras as ``run``: no launcher, tfdist's one-process handle."""
    python, _, legacy = COMBOS[run.combo]
    if (python, legacy) not in _alone_runs:
        out = tmp_path_factory.mktemp(f"alone-{run.combo}")
        env = clean_env()
        env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS=legacy)
        job = subprocess.run([python, WORKER, str(out), "single"], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
                             check=False)
        result = out / "result-0.json"
        assert result.exists(), job.stdout[-4000:]
        _alone_runs[python, legacy] = {**json.loads(result.read_text()), "stdout": job.stdout}
    found = _alone_runs[python, legacy]
    errors = {k: v["error"] for k, v in found.items() if isinstance(v, dict) and "error" in v}
    assert not errors, f"{errors}\n{found['stdout'][-4000:]}"
    return found


def _close(got: Any, expected: Any, where: str) -> None:
    """``got`` equals ``expected`` within :data:`TOLERANCE`, key by key."""
    if isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            _close(got[key], expected[key], f"{where}.{key}")
        return
    np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=where)


def test_history_evaluate_and_on_batch_results_equal_one_process(run, alone):
    found = run.case("metrics")
    for rank, mine in enumerate(found):  # compiled metrics, AUC too, and the *_on_batch calls
        _close(mine, alone["metrics"], f"{run.combo} rank {rank}")


def test_a_custom_steps_own_values_equal_one_process_or_are_named(run, alone):
    found = run.case("custom_step")
    expected = alone["custom_step"]
    summed = run.backend == "mwms" and not run.results[0]["keras3"]  # tf_keras sums them
    # Horovod with tf_keras read the first epoch's running mean 1e-3 off one process's while
    # Horovod's own broadcast callback ran after the first step: it copied rank 0's metric
    # states over rank 1's (tfdist's broadcast leaves metrics alone, before the first step).
    for rank, mine in enumerate(found):
        where = f"{run.combo} rank {rank}"
        _close({k: v for k, v in mine["history"].items() if not k.endswith("last")},
               {k: v for k, v in expected["history"].items() if not k.endswith("last")},
               where)
        _close(mine["evaluate"]["tracked"], expected["evaluate"]["tracked"], where)
        factor = 2.0 if summed else 1.0  # 2 replicas
        _close(np.array(mine["history"]["last"]) / factor, expected["history"]["last"], where)
        _close(mine["evaluate"]["last"] / factor, expected["evaluate"]["last"], where)
    assert found[0]["stopped_after"] == found[1]["stopped_after"], found
    if not summed:
        assert found[0]["stopped_after"] == expected["stopped_after"] < 8, (found, expected)
    named = "OwnSteps's own train_step returns values that are not its metrics' results"
    assert (run.job.stdout.count(named) == 1) == (run.backend == "mwms"), run.job.stdout[-3000:]
    assert named not in alone["stdout"]


def test_a_loss_object_called_in_a_custom_step_trains_and_logs_as_one_process(run, alone):
    # tf_keras refused it on several workers (its own ValueError); Keras 3 logged half the loss
    for rank, mine in enumerate(run.case("loss_object")):
        _close(mine, alone["loss_object"], f"{run.combo} rank {rank}")
    # tf_keras on MWMS sums a step's own values over the replicas: this loss, scaled for them,
    # reads one process's, so no warning that it does not (elsewhere the warning is true: the
    # values are averaged, a mean one process's)
    if run.backend == "mwms" and not run.results[0]["keras3"]:
        assert "LossObject's own train_step" not in run.job.stdout, run.job.stdout[-3000:]
    # Beside it (own_mean), a train_step's own mean over the rows: its gradient, summed over
    # MWMS's replicas, is scaled by tfdist (said once); Horovod averages it
    said = "a train_step of yours takes gradients of a loss it averages over the rows itself"
    assert run.job.stdout.count(said) == (1 if run.backend == "mwms" else 0), (
        run.job.stdout[-3000:])
    assert said not in alone["stdout"]


def test_a_metric_whose_state_does_not_add_is_named_once(run, alone):
    run.case("own_metric")
    line = "the metric largest (LargestPrediction) is read from its state added over the workers"
    assert run.job.stdout.count(line) == 1, run.job.stdout[-3000:]
    assert line not in alone["stdout"]


def test_a_metric_made_outside_the_scope_is_refused_where_its_state_would_stay_per_worker(
        run, alone):
    found = run.case("metric_outside_scope")
    assert alone["metric_outside_scope"]["refused"] is None
    if run.backend == "mwms":  # its state would stay each worker's own: refused on every rank
        said = ("ConfigError: the metric outside (AUC) was created outside `with dist.scope():`"
                if run.results[0]["keras3"] else "ValueError: ")  # tf_keras refuses it itself
        assert all(f["refused"].startswith(said) for f in found), found
    else:  # Horovod: no strategy; tfdist sums the metric's state over the ranks
        assert [f["refused"] for f in found] == [None, None], found
        _close(found[0]["history"], alone["metric_outside_scope"]["history"], run.combo)
        _same_on_both_ranks(found, "history")


def test_a_last_batch_that_does_not_split_evenly_is_warned_once(run, alone):
    found = run.case("short_last_batch")
    assert found[0] == alone["short_last_batch"] == {"100": 4, "99": 3, "arrays_epochs": 1}
    line = "each epoch's last batch holds 3 rows, which do not split evenly over 2 replicas"
    datasets = line + " (1 replica(s) get 2 rows, the others 1): if fit trains on it, that " \
        "step's gradient is not one process's (evaluate's and predict's numbers are). Batch " \
        "with drop_remainder=True"
    arrays = line + " (1 replica(s) get 2 rows, the others 1): that step's gradient is not " \
        "one process's. Pass a number of rows that the global batch divides"
    # Keras 3 on MWMS: fit weighs each replica's loss by its rows, so the step is one
    # process's: nothing to warn of
    weighted = run.backend == "mwms" and run.results[0]["keras3"]
    for said in (datasets, arrays):  # dist.shard of a dataset; fit on arrays
        assert run.job.stdout.count(said) == (0 if weighted else 1), run.job.stdout[-3000:]
    assert "last batch holds 4 rows" not in run.job.stdout
    assert line not in alone["stdout"]


def test_a_py_dataset_trains_each_row_once_an_epoch_and_as_one_process(run, alone):
    found = run.case("py_dataset")
    # Unshuffled: one process's batches, and its History over both epochs; the arrays the
    # batches were views of are untouched (MWMS once wrote into a worker's labels in epoch 1).
    for rank, mine in enumerate(found):
        assert mine["steps"] == alone["py_dataset"]["steps"] == list(range(8)) * 2, mine
        assert mine["arrays_untouched"] == [True, True], f"{run.combo} rank {rank}"
        _close(mine["history"], alone["py_dataset"]["history"], f"{run.combo} rank {rank}")
    everything = np.sort(np.array(alone["py_dataset"]["seen_shuffled"][:ROWS]))
    per_epoch = ROWS // 2
    seen = [np.array(f["seen_shuffled"]) for f in found]
    assert [len(s) for s in seen] == [2 * per_epoch, 2 * per_epoch]
    for epoch in (0, 1):  # shuffled with the ranks' random apart: each row once an epoch
        parts = [s[epoch * per_epoch:(epoch + 1) * per_epoch] for s in seen]
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), everything)
    steps = [f["steps_shuffled"] for f in found]  # each step: one global batch split
    assert steps[0] == steps[1], steps
    for epoch in (0, 1):
        assert sorted(steps[0][epoch * 8:(epoch + 1) * 8]) == list(range(8)), steps
    assert steps[0][:8] != list(range(8)) and steps[0][:8] != steps[0][8:], steps  # shuffled
    control = [f["steps_control"] for f in found]  # each rank's own order: batches mixed
    assert len(control[0]) == 8 and control[0] != control[1], control
    # use_multiprocessing=True: threads instead of forked loaders (one of which once hung the
    # launch on a futex), said once; the batches in order.
    assert [f["steps_processes"] for f in found] == [list(range(8))] * 2, found
    line = "fit(use_multiprocessing=True) would fork Keras's loader processes"
    assert run.job.stdout.count(line) == 1, run.job.stdout[-3000:]


def test_a_generator_trains_with_one_warning(run, alone):
    found = run.case("generator")
    assert found[0]["epochs"] == found[1]["epochs"] == 1
    line = "fit reads a Python generator on several workers"
    assert run.job.stdout.count(line) == 1, run.job.stdout[-3000:]
    assert line not in alone["stdout"]


def test_every_save_on_every_rank_lands_once_from_the_chief(run, alone):
    found = run.case("saving")
    _same_on_both_ranks(found)
    chief = found[0]
    assert chief["loaded"] == chief["digest"], chief
    expected = {"save_weights": ("w.weights.h5", "w.h5"), "save_h5": ("m.h5",),
                "saved_model": ("sm",), "checkpoint": ("ckpt",), "save_folder": ("folder",),
                "tf_checkpoint_write": ("tfw",), "tf_checkpoint_save": ("tfs",),
                "tf_checkpoint_manager": ("tfm",)}
    names = sorted(name for save in chief["saves"] for name in expected[save]
                   if name in chief["files"])
    assert chief["files"] == names and len(names) == len(chief["saves"]), chief
    assert alone["saving"]["saves"] == chief["saves"]
    # tf.train.Checkpoint and a CheckpointManager (max_to_keep=1) on every rank: the chief's
    # paths returned everywhere, numbered alike (one save_counter: c-1, c-2, then ckpt-3 and
    # ckpt-4 from the manager), and the checkpoint read back on every rank.
    for key in ("returned", "tfs", "tfm", "latest", "manager", "read"):
        _same_on_both_ranks(found, key)
    assert chief["returned"] == ["tfw/c", "tfw/c", "tfs/c-1", "tfs/c-2", "tfm/ckpt-3",
                                 "tfm/ckpt-4"], chief
    assert chief["manager"] == ["tfm/ckpt-4"], chief
    assert chief["tfm"] == ["checkpoint", "ckpt-4.data-00000-of-00001", "ckpt-4.index"], chief
    assert chief["latest"] == "tfs/c-2" and chief["read"] == chief["digest"], chief
    assert chief["tfs"] == ["c-1.data-00000-of-00001", "c-1.index", "c-2.data-00000-of-00001",
                            "c-2.index", "checkpoint"], chief
    assert alone["saving"]["returned"] == chief["returned"]


def test_the_readme_table_names_every_case_the_worker_runs():
    import re

    worker = "".join((ROOT / "tests" / "workers" / name).read_text()
                     for name in ("keras_traps_worker.py", "keras_numbers.py"))
    cases = {case for case in re.findall(r'^        "(\w+)": lambda', worker, re.M)
             if not case.startswith("control_")}
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- keras features table")[1].split("<!-- end of keras features")[0]
    named = set(re.findall(r"^\| `(\w+)`", table, re.M)) | set(
        re.findall(r"`(\w+)` and `(\w+)`", table)[0])
    assert cases <= named, sorted(cases - named)
