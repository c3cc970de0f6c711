"""One worker of the Keras traps test: what public scripts do that used to break on 2 workers.

    python keras_traps_worker.py OUT_DIR {mwms,horovod,single}

Runs every case below in this one process, in order, on every rank (so one launch covers
them all), and writes ``result-RANK.json``: per case either its observations or
``{"error": ...}``. Each case builds a fresh model; all share the strategy.

- ``model_dir``: ``fit`` outside the scope with ``dist.callbacks(model_dir=...)`` for 2 epochs
  (the chief's checkpoint, TensorBoard logs, per-rank backups), then ``dist.save`` of the final
  model on every rank.
- ``inside_scope``: the same with ``fit`` called inside ``dist.scope()``, as the Keras guide does.
- ``reload``: the final model of ``model_dir`` loaded with ``keras.models.load_model`` in the
  scope on every rank, as the Keras guide resumes: compiled, its optimizer's step count kept,
  and one more epoch trains it to the same weights on every rank.
- ``user_writers``: the user's own ModelCheckpoint and CSVLogger passed to every rank
  (``dist.callbacks(checkpoint, logger)``): they must land once, from the chief, loadable.
- ``fit_writers``: a Keras tutorial's writers passed straight to ``fit`` (no
  ``dist.callbacks``), outside the scope: ModelCheckpoint, BackupAndRestore, CSVLogger and
  TensorBoard (where installed), then ``model.save`` and ``save_weights`` on every rank. Every
  file must land once, loadable, holding the final weights; a recording checkpoint notes the
  path each rank's save was given.
- ``fit_writers_inside``: ``[ModelCheckpoint(weights only)] + dist.callbacks()`` with ``fit``
  inside the scope; ``model.save`` inside ``tfdist.per_rank_files()`` writes each rank's own
  file.
- ``chief_only_writer``: Horovod's habit, a ModelCheckpoint on rank 0 alone: under MWMS
  refused on every rank before the first step (a save runs collectives there); under Horovod
  it trains and the chief's file loads.
- ``control_writers_unrouted``: the recording checkpoint passed to ``fit`` as Keras has it,
  without tfdist's routing: every rank's save is given the one path (the race the routing
  removes).
- ``optimizer_options``: Keras 3's ``gradient_accumulation_steps``, refused on MWMS before
  the first step (it fails upstream) and trained elsewhere; ``clipnorm`` trains everywhere,
  with one warning on Keras 3 under MWMS (each replica is clipped before the average).
- ``lazy_model``: a Sequential model without ``keras.Input`` (Horovod's MNIST example), and a
  subclassed one: built lazily, yet every rank must start from rank 0's weights.
- ``numpy``: ``fit(x, y, batch_size=...)`` on arrays: each rank must train on its share; a layer
  records the rows each rank's replica sees; then with Keras's default ``shuffle=True`` and the
  ranks' random states apart: still each row once an epoch over the ranks.
- ``steps_per_execution``: ``compile(steps_per_execution=3)`` over 8 steps an epoch (chunks
  of 3, 3 and 2) must end with the weights of ``steps_per_execution=1`` from the same start.
- ``batch_norm``: a model with BatchNormalization; with tfdist's callbacks every rank ends
  with the same moving statistics, and without the average (the control) they differ where
  Keras leaves them per rank (all but tf_keras under MWMS). Then a fit whose last batch of one
  row would leave rank 1 without rows: refused on every rank before its first step.
- The feature matrix, each a short ``fit`` whose weights must be equal on both ranks:
  ``validation`` (``validation_data`` and ``validation_split``: equal validation losses too),
  ``weights`` (``class_weight`` and ``sample_weight``), ``dropout``, ``callbacks``
  (EarlyStopping and ReduceLROnPlateau stop and lower the rate at the same epoch on every rank),
  ``initial_epoch``, ``custom_train_step`` (a subclassed model with its own ``train_step``),
  ``mixed_precision`` (``mixed_bfloat16``), ``evaluate_predict`` (an uneven last batch: the
  same loss on every rank, equal to the loss computed directly over all rows; ``predict``
  returns every row).
- ``one_process``: 2 epochs on 2 workers against the same 2 epochs run here without any
  strategy (the whole global batch in one replica, as one process would): equal up to float
  summation order, which is the one exact comparison (the mean of two half-batch gradients is
  the full batch's gradient, summed in another order). This proves the gradients are averaged
  over the global batch, not summed or left per rank.
- ``step_logs``: one epoch with a callback that reads each step's logs (so they must be the
  same on every rank), then one with ``TFDIST_STEP_LOGS=local`` (Keras 3 on MWMS then keeps
  each rank's own, without a collective per step); the epoch's logs are global both times.
- ``jit_compile``: ``compile(jit_compile=True)`` trains (without XLA, which cannot compile the
  all-reduce on CPUs or Horovod's) and ends where ``jit_compile=False`` ends.
- ``mixed_keras`` (tf_keras lanes): a Keras 3 model (``import keras``) while
  ``TF_USE_LEGACY_KERAS=1`` makes tf.keras tf_keras: ``fit`` must refuse with tfdist's
  message on every rank, before any collective, rather than fail inside TensorFlow or (under
  Horovod) train without averaging.
- ``control_chief_only_save`` (MWMS): the old way, the checkpoint on the chief only
  (``ChiefOnly(AtomicCheckpoint)``) with ``fit`` inside the scope, must still break: it shows
  that the cases above exercise the defect.

- The numbers a script prints (``keras_numbers.py``), compared by the test with one plain
  process's (``single``: the worker runs only those).

Weights are compared across ranks by digest (``tfdist.sync.digest``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import keras_numbers
import numpy as np

import tfdist

ROWS = 256  # training rows; a multiple of every global batch below
GLOBAL_BATCH = 32


def main(out_dir: str, backend: str) -> None:
    keras3 = None
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        import keras as keras3  # the mix: Keras 3 imported beside tf.keras = tf_keras
    # A hang shows where, before the test's 300 s timeout ends the launch without a word.
    faulthandler.dump_traceback_later(270, exit=True)
    dist = tfdist.init(backend=backend)
    import tensorflow as tf

    from tfdist.keras import versions

    keras = tf.keras
    result: dict[str, Any] = {"rank": dist.rank, "keras3": versions.is_keras3(keras)}
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "model_dir": lambda: _model_dir(dist, keras, tf, out_dir, inside_scope=False),
        "inside_scope": lambda: _model_dir(dist, keras, tf, out_dir, inside_scope=True),
        "reload": lambda: _reload(dist, keras, tf, out_dir),
        "user_writers": lambda: _user_writers(dist, keras, tf, out_dir),
        "fit_writers": lambda: _fit_writers(dist, keras, tf, out_dir),
        "fit_writers_inside": lambda: _fit_writers_inside(dist, keras, tf, out_dir),
        "chief_only_writer": lambda: _chief_only_writer(dist, keras, tf, out_dir),
        "control_writers_unrouted": lambda: _control_unrouted(dist, keras, tf, out_dir),
        "lazy_model": lambda: _lazy_model(dist, keras, tf),
        "optimizer_options": lambda: _optimizer_options(dist, keras, tf),
        "numpy": lambda: _numpy(dist, keras),
        "steps_per_execution": lambda: _steps_per_execution(dist, keras, tf),
        "batch_norm": lambda: _batch_norm(dist, keras, tf),
        "validation": lambda: _validation(dist, keras, tf),
        "weights": lambda: _weights(dist, keras, tf),
        "dropout": lambda: _dropout(dist, keras, tf),
        "callbacks": lambda: _callbacks(dist, keras, tf),
        "initial_epoch": lambda: _initial_epoch(dist, keras, tf),
        "custom_train_step": lambda: _custom_train_step(dist, keras, tf),
        "mixed_precision": lambda: _mixed_precision(dist, keras, tf),
        "evaluate_predict": lambda: _evaluate_predict(dist, keras, tf),
        "one_process": lambda: _one_process(dist, keras, tf),
        "step_logs": lambda: _step_logs(dist, keras, tf),
        "jit_compile": lambda: _jit_compile(dist, keras, tf),
        "mixed_keras": lambda: _mixed_keras(dist, keras3),
        **keras_numbers.cases(dist, keras, tf, out_dir),  # compared with one process's: see there
        # Last: when it shows the old defect, the ranks' collectives are aborted.
        "control_chief_only_save": lambda: _control(dist, keras, tf, out_dir),
    }
    if backend == "single":  # one plain process: the numbers the others must equal
        cases = keras_numbers.cases(dist, keras, tf, out_dir)
    failed = False
    seconds: dict[str, float] = {}  # each case's time: where a launch's minutes go
    result["seconds"] = seconds
    for name, case in cases.items():
        start = time.monotonic()
        try:
            result[name] = case()
        except Exception as error:  # recorded per case, so one failure shows all the others
            traceback.print_exc()
            result[name] = {"error": f"{type(error).__name__}: {error}"}
            failed = True
            if dist.world_size > 1:
                break  # the ranks may be out of step now: stop rather than hang
        finally:
            seconds[name] = round(time.monotonic() - start, 2)
    with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(3 if failed else 0)


def _data(tf: Any) -> Any:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)), x, y


def _model(keras: Any, *, lazy: bool = False) -> Any:
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    return keras.Sequential(layers if lazy else [keras.Input((8,)), *layers])


def _compile(model: Any, keras: Any, **options: Any) -> None:
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **options)


def _digest(model: Any) -> str:
    from tfdist.sync import digest, model_variables

    return digest(model_variables(model))


def _model_dir(dist: Any, keras: Any, tf: Any, out_dir: str, *, inside_scope: bool
               ) -> dict[str, Any]:
    keras.utils.set_random_seed(1 + dist.rank)  # rank 0's weights must win
    model_dir = os.path.join(out_dir, "inside" if inside_scope else "outside")
    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
        dataset = dist.shard(_data(tf)[0].batch(GLOBAL_BATCH))
        if inside_scope:
            model.fit(dataset, epochs=2, verbose=0,
                      callbacks=dist.callbacks(model_dir=model_dir))
    if not inside_scope:
        model.fit(dataset, epochs=2, verbose=0, callbacks=dist.callbacks(model_dir=model_dir))
    final = os.path.join(model_dir, "final.keras")
    wrote = dist.save(model, final)
    return {"digest": _digest(model), "wrote_final": wrote}


def _reload(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    """The model ``model_dir`` saved (2 epochs of 8 steps), loaded with Keras's own
    ``load_model`` in the strategy's scope on every rank (the Keras guide's resume pattern),
    then trained one more epoch with ``fit`` outside the scope: compiled from its saved config,
    its optimizer's state restored, the same weights on every rank after."""
    final = os.path.join(out_dir, "outside", "final.keras")
    dataset = dist.shard(_data(tf)[0].batch(GLOBAL_BATCH))
    import warnings

    with warnings.catch_warnings(record=True) as caught, dist.scope():
        warnings.simplefilter("always")
        model = keras.models.load_model(final)
    optimizer = getattr(model, "optimizer", None)
    loaded = _digest(model)
    result: dict[str, Any] = {
        "compiled": optimizer is not None,
        "iterations": int(optimizer.iterations.numpy()) if optimizer is not None else None,
        # Keras's warning when it skips compiling: tfdist's wrapper looked like a custom compile
        "custom_compile_warned": any("is custom" in str(w.message) for w in caught)}
    model.fit(dataset, epochs=1, verbose=0)
    result.update(digest=_digest(model), trained=_digest(model) != loaded,
                  iterations_after=int(model.optimizer.iterations.numpy()))
    return result


def _user_writers(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    keras.utils.set_random_seed(1)
    user_dir = os.path.join(out_dir, "user")
    os.makedirs(user_dir, exist_ok=True)  # CSVLogger opens its file without making folders
    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(user_dir, "user.keras"))
    logger = keras.callbacks.CSVLogger(os.path.join(user_dir, "log.csv"))
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
              callbacks=dist.callbacks(checkpoint, logger))
    return {"digest": _digest(model)}


def _recording_checkpoint(keras: Any, path: str) -> Any:
    """A ModelCheckpoint that writes nothing: it notes the path each save was given."""
    class Recording(keras.callbacks.ModelCheckpoint):
        def __init__(self, filepath: str) -> None:
            super().__init__(filepath)
            self.given: list[str] = []

        def _save_model(self, *args: Any, **kwargs: Any) -> None:
            self.given.append(str(self.filepath))

    return Recording(path)


def _digests_of_files(dist: Any, keras: Any, folder: str, *names: str) -> dict[str, str]:
    """Each file loaded by Keras on this rank, after every rank's saves: the digest of its
    weights (``*.keras``: load_model; ``*.weights.h5``: load_weights into a new model)."""
    dist.sum_over_ranks([1.0])  # every rank has saved: the chief's renames are done
    found = {}
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".keras"):
            found[name] = _digest(keras.models.load_model(path))
        else:
            model = _model(keras)
            model.load_weights(path)
            found[name] = _digest(model)
    return found


def _fit_writers(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    import importlib.util

    keras.utils.set_random_seed(1 + dist.rank)  # rank 0's weights must win
    folder = os.path.join(out_dir, "fit_writers")
    os.makedirs(folder, exist_ok=True)  # CSVLogger opens its file without making folders
    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
    writers = [keras.callbacks.ModelCheckpoint(os.path.join(folder, "checkpoint.keras")),
               keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
               keras.callbacks.CSVLogger(os.path.join(folder, "log.csv"))]
    if importlib.util.find_spec("tensorboard") is not None:
        writers.append(keras.callbacks.TensorBoard(os.path.join(folder, "logs")))
    recorder = _recording_checkpoint(keras, os.path.join(folder, "recorded.keras"))
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
              callbacks=[*writers, recorder])
    model.save(os.path.join(folder, "final.keras"))
    model.save_weights(os.path.join(folder, "final.weights.h5"))
    return {"digest": _digest(model), "given": recorder.given,
            "files": _digests_of_files(dist, keras, folder, "checkpoint.keras", "final.keras",
                                       "final.weights.h5")}


def _fit_writers_inside(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    keras.utils.set_random_seed(1 + dist.rank)
    folder = os.path.join(out_dir, "fit_writers_inside")
    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
        checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(folder, "w.weights.h5"),
                                                     save_weights_only=True)
        model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
                  callbacks=[checkpoint, *dist.callbacks()])
    with tfdist.per_rank_files():  # each rank's own file, written as given
        model.save(os.path.join(folder, f"rank-{dist.rank}.keras"))
    return {"digest": _digest(model),
            "files": _digests_of_files(dist, keras, folder, "w.weights.h5", "rank-0.keras",
                                       "rank-1.keras")}


def _chief_only_writer(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    keras.utils.set_random_seed(1)
    folder = os.path.join(out_dir, "chief_only")
    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
    mine = ([keras.callbacks.ModelCheckpoint(os.path.join(folder, "c.keras"))]
            if dist.rank == 0 else [])
    try:
        model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
                  callbacks=mine)
    except tfdist.ConfigError as error:
        return {"refused": str(error), "steps": int(model.optimizer.iterations.numpy())}
    return {"refused": None, "digest": _digest(model),
            "files": _digests_of_files(dist, keras, folder, "c.keras")}


def _control_unrouted(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    """fit as Keras has it, below tfdist's routing (the patch's original)."""
    from tfdist import patches

    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
    routed = type(model).fit
    original = getattr(routed, patches._MARK)[1]
    assert getattr(routed, patches._MARK)[0] == "user-writers", getattr(routed, patches._MARK)
    recorder = _recording_checkpoint(keras, os.path.join(out_dir, "unrouted", "r.keras"))
    original(model, dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=1, verbose=0,
             callbacks=[recorder])
    return {"given": recorder.given}


def _optimizer_options(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    """Keras 3's ``gradient_accumulation_steps`` (refused on MWMS, where it fails upstream;
    trains elsewhere) and ``clipnorm`` (trains everywhere; warned on Keras 3 MWMS)."""
    from tfdist.keras import versions

    result: dict[str, Any] = {}
    dataset = dist.shard(_data(tf)[0].batch(GLOBAL_BATCH))
    if versions.is_keras3(keras):
        keras.utils.set_random_seed(1)
        with dist.scope():
            model = _model(keras)
            model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        try:
            model.fit(dataset, epochs=1, verbose=0, callbacks=dist.callbacks())
            result["accumulation"] = {"refused": None, "digest": _digest(model)}
        except tfdist.ConfigError as error:
            result["accumulation"] = {"refused": str(error),
                                      "steps": int(model.optimizer.iterations.numpy())}
    keras.utils.set_random_seed(1)
    with dist.scope():
        model = _model(keras)
        model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset, epochs=1, verbose=0, callbacks=dist.callbacks())
    result["digest"] = _digest(model)
    return result


def _lazy_model(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    digests = {}
    for kind in ("sequential", "subclassed"):
        keras.utils.set_random_seed(1 + dist.rank)  # different on every rank until broadcast
        with dist.scope():
            model = _model(keras, lazy=True) if kind == "sequential" else _Subclassed(keras)
            _compile(model, keras)
        model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=1, verbose=0,
                  callbacks=dist.callbacks())
        digests[kind] = _digest(model)
    return digests


def _Subclassed(keras: Any) -> Any:  # noqa: N802 (a class factory: keras is known at run time)
    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(2)

        def call(self, inputs: Any) -> Any:
            return self.out(self.hidden(inputs))

    return Subclassed()


def _numpy(dist: Any, keras: Any) -> dict[str, Any]:
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    _, x, y = _data(tf)
    seen: list[float] = []  # feature 0 of every training row this rank's replica saw
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras_numbers.row_recorder(keras, tf, seen),
                                  keras.layers.Dense(2)])
        _compile(model, keras, jit_compile=False)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                        callbacks=dist.callbacks())
    result = {"digest": _digest(model), "seen": list(seen),
              "epochs": len(history.history["loss"])}
    # Keras's default, shuffle=True, with the ranks' random states apart (no common seed):
    # every epoch must still train each row once over the ranks.
    keras.utils.set_random_seed(7 + dist.rank)
    seen.clear()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=dist.callbacks())
    result.update(seen_shuffled=list(seen), shuffled_digest=_digest(model))
    tf.random.set_seed(None)  # no seed at all: the shuffle below draws its own order per rank
    dist.shard(tf.data.Dataset.range(8).shuffle(8).batch(4))  # a warning; never iterated
    if dist.backend == "mwms":  # the control: Keras's own shuffle, below tfdist's patch
        seen.clear()
        _below(type(model).fit, "arrays-one-order")(model, x, y, batch_size=GLOBAL_BATCH,
                                                     epochs=1, verbose=0)
        result["seen_control"] = list(seen)
    return result


def _below(function: Any, key: str) -> Any:
    """The function that tfdist's patch ``key`` replaced, under any later wrappers."""
    from tfdist import patches

    while getattr(function, patches._MARK)[0] != key:
        function = getattr(function, patches._MARK)[1]
    return getattr(function, patches._MARK)[1]


def _steps_per_execution(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    return {"digest": _trained(dist, keras, tf, steps_per_execution=3),
            "one_step": _trained(dist, keras, tf, steps_per_execution=1)}


def _trained(dist: Any, keras: Any, tf: Any, **options: Any) -> str:
    """The digest of a fresh model compiled with ``options`` after 2 epochs of ``fit``."""
    model = _fresh(dist, keras, **options)
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
              callbacks=dist.callbacks())
    return _digest(model)


def _batch_norm(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    from tfdist.keras.batch_statistics import averages_batch_statistics
    from tfdist.sync import digest, model_variables

    found: dict[str, Any] = {"averaged": averages_batch_statistics(dist)}
    for average in (True, False):
        keras.utils.set_random_seed(1)
        with dist.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                      keras.layers.BatchNormalization(),
                                      keras.layers.Activation("relu"), keras.layers.Dense(2)])
            _compile(model, keras)
        model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
                  callbacks=dist.callbacks(average_batch_statistics=average))
        found["digest" if average else "control"] = digest(
            model_variables(model, include_batch_statistics=True))
    # A last batch of one row leaves rank 1 without rows: refused before the first step
    # (BatchNormalization's statistics on an empty batch, then every weight, would be NaN).
    _, x, y = _data(tf)
    try:
        model.fit(x[:GLOBAL_BATCH + 1], y[:GLOBAL_BATCH + 1], batch_size=GLOBAL_BATCH,
                  epochs=1, verbose=0, shuffle=False)
        found["empty_replica"] = None
    except tfdist.ConfigError as error:
        found["empty_replica"] = str(error)
    found["steps_after"] = int(model.optimizer.iterations.numpy())
    return found


def _fresh(dist: Any, keras: Any, layers: list[Any] | None = None, *, alone: bool = False,
           **options: Any) -> Any:
    """A model from seed 1, in the strategy's scope, or outside any (``alone``)."""
    import contextlib

    keras.utils.set_random_seed(1)
    with contextlib.nullcontext() if alone else dist.scope():
        model = keras.Sequential([keras.Input((8,)), *(layers or [
            keras.layers.Dense(16, activation="relu")]), keras.layers.Dense(2)])
        _compile(model, keras, **options)
    return model


def _history(history: Any) -> dict[str, list[float]]:
    return {key: [float(v) for v in values] for key, values in history.history.items()}


def _validation(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    dataset, x, y = _data(tf)
    model = _fresh(dist, keras)
    given = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=2, verbose=0,
                      validation_data=dist.shard(dataset.take(96).batch(GLOBAL_BATCH)),
                      callbacks=dist.callbacks())
    split = _fresh(dist, keras)
    held = split.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                     validation_split=0.25, callbacks=dist.callbacks())
    return {"digest": _digest(model) + _digest(split),
            "val_loss": _history(given)["val_loss"] + _history(held)["val_loss"]}


def _weights(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    _, x, y = _data(tf)
    by_class = _fresh(dist, keras)
    by_class.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                 class_weight={0: 1.0, 1: 3.0}, callbacks=dist.callbacks())
    by_row = _fresh(dist, keras)
    rows = np.linspace(0.5, 2.0, len(x)).astype("float32")
    by_row.fit(x, y, sample_weight=rows, batch_size=GLOBAL_BATCH, epochs=2, verbose=0,
               shuffle=False, callbacks=dist.callbacks())
    return {"digest": _digest(by_class) + _digest(by_row)}


def _dropout(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    model = _fresh(dist, keras, [keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dropout(0.5)])
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
              callbacks=dist.callbacks())
    return {"digest": _digest(model)}


def _callbacks(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    model = _fresh(dist, keras)
    # The loss of this tiny problem falls for a few epochs, then creeps: min_delta makes both
    # callbacks act within 8 epochs.
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=0.05)
    lower = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, factor=0.5,
                                              min_delta=0.05)
    history = model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=8, verbose=0,
                        callbacks=dist.callbacks(stop, lower))
    rate = model.optimizer.learning_rate
    return {"digest": _digest(model), "epochs": len(history.history["loss"]),
            "learning_rate": float(rate.numpy() if hasattr(rate, "numpy") else rate)}


def _initial_epoch(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    model = _fresh(dist, keras)
    history = model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=3,
                        initial_epoch=1, verbose=0, callbacks=dist.callbacks())
    return {"digest": _digest(model), "epochs": len(history.history["loss"])}


def _custom_train_step(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    class OwnStep(keras.Model):
        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            variables = self.trainable_variables
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # noqa: B905
            return {"loss": loss}

    keras.utils.set_random_seed(1)
    with dist.scope():
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs))
        model = OwnStep(inputs, outputs)
        _compile(model, keras)
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
              callbacks=dist.callbacks())
    return {"digest": _digest(model)}


def _mixed_precision(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = _fresh(dist, keras)
        model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=2, verbose=0,
                  callbacks=dist.callbacks())
        compute = str(model.layers[0].compute_dtype)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {"digest": _digest(model), "compute_dtype": compute}


def _evaluate_predict(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    dataset, x, y = _data(tf)
    model = _fresh(dist, keras)
    model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=1, verbose=0,
              callbacks=dist.callbacks())
    rows = 100  # 3 global batches of 32 and one of 4: uneven on every rank
    loss, _ = model.evaluate(dist.shard(dataset.take(rows).batch(GLOBAL_BATCH)), verbose=0,
                             callbacks=dist.callbacks())
    direct = model(x[:rows], training=False)
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[:rows], direct)
    predicted = model.predict(x[:rows], batch_size=GLOBAL_BATCH, verbose=0)
    # predict on the split dataset, as the example does: every row, in order, on every rank
    sharded = model.predict(dist.shard(dataset.take(rows).batch(GLOBAL_BATCH)), verbose=0)
    return {"digest": _digest(model), "loss": float(loss), "direct": float(expected),
            "rows": len(predicted),
            "predict_error": float(np.max(np.abs(np.asarray(predicted) - np.asarray(direct)))),
            "sharded_rows": len(sharded),
            "sharded_error": float(np.max(np.abs(np.asarray(sharded) - np.asarray(direct))))}


def _one_process(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    distributed = _fresh(dist, keras)
    alone = _fresh(dist, keras, alone=True)
    dataset = _data(tf)[0].batch(GLOBAL_BATCH)
    distributed.fit(dist.shard(dataset), epochs=2, verbose=0, callbacks=dist.callbacks())
    alone.fit(dataset, epochs=2, verbose=0)
    pairs = zip(distributed.get_weights(), alone.get_weights(), strict=True)
    return {"digest": _digest(distributed),
            "max_difference": max(float(np.max(np.abs(a - b))) for a, b in pairs),
            "moved": float(np.max(np.abs(distributed.get_weights()[0]
                                         - _fresh(dist, keras, alone=True).get_weights()[0])))}


def _step_logs(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    class Record(keras.callbacks.Callback):  # reads each step's logs
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[float] = []
            self.epoch: float | None = None

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.steps.append(float(logs["loss"]))

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epoch = float(logs["loss"])

    found: dict[str, Any] = {}
    for mode in ("auto", "local"):
        os.environ["TFDIST_STEP_LOGS"] = mode
        try:
            model, record = _fresh(dist, keras), Record()
            model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=1, verbose=0,
                      callbacks=[*dist.callbacks(), record])
        finally:
            del os.environ["TFDIST_STEP_LOGS"]
        found[mode] = {"steps": record.steps, "epoch": record.epoch, "digest": _digest(model)}
    return {"digest": found["local"]["digest"], **found}


def _jit_compile(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    # XLA cannot compile the all-reduce on CPUs or under Horovod: the script runs unchanged,
    # compiled without XLA, and ends where jit_compile=False ends.
    return {"digest": _trained(dist, keras, tf, jit_compile=True),
            "without_xla": _trained(dist, keras, tf, jit_compile=False)}


def _mixed_keras(dist: Any, keras3: Any) -> dict[str, Any]:
    from tfdist.keras.versions import is_keras3

    if keras3 is None:
        return {"skipped": "tf.keras is Keras 3 here: nothing to mix"}
    if not is_keras3(keras3):
        return {"skipped": "`import keras` is Keras 2 here (TensorFlow 2.15): nothing to mix"}
    model = keras3.Sequential([keras3.Input((8,)), keras3.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(np.zeros((8, 8), "float32"), np.zeros((8, 2), "float32"), verbose=0)
    except Exception as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    return {"refused": None}


def _control(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    if dist.backend != "mwms":
        return {"skipped": "a save runs no collective under Horovod"}
    from tfdist.keras.callbacks import AtomicCheckpoint, ChiefOnly

    with dist.scope():
        model = _model(keras)
        _compile(model, keras)
        writer = ChiefOnly(AtomicCheckpoint(os.path.join(out_dir, "control", "c.keras")),
                           dist.is_chief)
        try:
            model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=3, verbose=0,
                      callbacks=[writer])
        except Exception as error:
            return {"failed": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"failed": None}


if __name__ == "__main__":
    main(*sys.argv[1:3])
