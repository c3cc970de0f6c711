"""The numbers a Keras script prints, on several workers and on one process (issue: "silently
wrong on many workers").

Run by ``keras_traps_worker.py`` in the same launch as the traps (one launch per backend and
Keras), and on its own as one plain process (``backend == "single"``): each case returns the
numbers a user sees (History, ``evaluate``, the ``*_on_batch`` results, ``predict``), and
``tests/test_keras_traps.py`` compares the two runs within float32 rounding. Every case uses
the same global batch on both: ``dist.shard`` splits it over the workers.

- ``metrics``: compiled metrics with a non-additive result (AUC) and an additive one, with
  validation: History, ``evaluate``, then ``train_on_batch``, ``test_on_batch`` and
  ``predict_on_batch`` on one batch.
- ``custom_step``: a model whose own ``train_step``/``test_step`` return a metric's result and
  a value computed by hand: History (with ``val_``) and ``evaluate`` must be one process's
  (tf_keras on MWMS sums the hand-made value over the replicas, as Keras does: named in a
  warning), and EarlyStopping on such a value stops every rank at the same epoch.
- ``loss_object``: a custom ``train_step`` that calls a ``keras.losses`` object with its default
  reduction (the DCGAN's and distillation's shape; tf_keras refuses it under any strategy),
  applies its gradients with an optimizer of its own (not the compiled one: a GAN's two; under
  Horovod they were not averaged) and logs the loss returned as it is and through a ``Mean``
  tracker: History and the final weights are one process's.
- ``own_metric``: a metric of the user's whose state is a running maximum (it does not add
  over workers): trains, and tfdist names it in one warning on the chief.
- ``metric_outside_scope``: a compiled metric object created before ``dist.scope()``: refused
  before the first step on several MWMS workers (its state would stay each worker's own;
  tf_keras refuses it itself), trains as one process's elsewhere.
- ``py_dataset``: a ``keras.utils.PyDataset`` (tf_keras: ``Sequence``) of global batches, with
  2 loader threads on Keras 3: unshuffled, History is one process's; shuffled (Keras's default)
  with the ranks' Python ``random`` seeded apart, every row is trained once an epoch over the
  ranks and at every step the ranks split one global batch; the control, Keras's own
  ``random`` below tfdist's patch, has the ranks split different batches at one step. Then
  one epoch with ``use_multiprocessing=True`` on several workers: loaded by threads (a forked
  loader can deadlock), one warning, its batches in order.
- ``generator``: ``fit`` on a Python generator trains, with one warning on the chief.
- ``saving``: ``save_weights``, ``model.save`` to ``.h5``, ``tf.saved_model.save``, a custom
  loop's ``tf.train.Checkpoint`` ``write`` and ``save`` and a ``CheckpointManager`` (tf_keras
  also a checkpoint prefix and a SavedModel folder) on every rank, twice: once each, from the
  chief, loadable; every rank gets the chief's paths back (the numbering agrees) and reads the
  checkpoint they name.
- ``short_last_batch``: 100 rows in global batches of 32 (a last batch of 4, even) and 99 rows
  (a last batch of 3, uneven on 2 replicas): one warning on the chief for the uneven one only;
  then ``fit`` on those 99 rows as arrays: one warning naming the arrays' fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ROWS, GLOBAL_BATCH, EPOCHS = 256, 32, 2


def cases(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    """The cases by name, each a function of no arguments returning its numbers."""
    return {
        # First: on 2 MWMS workers a PyDataset's labels were overwritten in place on one worker
        # in about 4 runs of 10 (TensorFlow wrote a step's result into the split batch, a view
        # of the arrays), so its second epoch trained on other labels: patch generator-copies.
        "py_dataset": lambda: _py_dataset(dist, keras, tf),
        "metrics": lambda: _metrics(dist, keras, tf),
        "custom_step": lambda: _custom_step(dist, keras, tf),
        "loss_object": lambda: _loss_object(dist, keras, tf),
        "own_metric": lambda: _own_metric(dist, keras, tf),
        "metric_outside_scope": lambda: _metric_outside_scope(dist, keras, tf),
        "short_last_batch": lambda: _short_last_batch(dist, keras, tf),
        "generator": lambda: _generator(dist, keras, tf),
        "saving": lambda: _saving(dist, keras, tf, out_dir),
    }


def _data(tf: Any, rows: int = ROWS) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x[:, 0] + 0.5 * rng.normal(size=rows) > 0).astype("float32")  # noisy: AUC below 1
    return tf.data.Dataset.from_tensor_slices((x, y)), x, y


def _model(dist: Any, keras: Any, model_class: Any = None, metrics: Any = list) -> Any:
    """A fresh model from seed 3, compiled in the scope with the metrics ``metrics()`` makes
    there (a metric object made outside the scope is refused by tf_keras)."""
    keras.utils.set_random_seed(3)
    with dist.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        outputs = keras.layers.Dense(1, activation="sigmoid")(hidden)
        model = (model_class or keras.Model)(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                      metrics=metrics())
    return model


def _history(history: Any) -> dict[str, list[float]]:
    return {key: [float(v) for v in values] for key, values in history.history.items()}


def _numbers(value: Any) -> Any:
    """Keras results as plain floats (dicts and lists kept)."""
    if isinstance(value, dict):
        return {key: _numbers(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_numbers(v) for v in value]
    return np.asarray(value, "float64").tolist()


def _metrics(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    dataset, x, y = _data(tf)
    model = _model(dist, keras, metrics=lambda: [keras.metrics.AUC(name="auc"),
                                                 "binary_accuracy"])
    history = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=EPOCHS, verbose=0,
                        validation_data=dist.shard(dataset.take(96).batch(GLOBAL_BATCH)))
    evaluated = model.evaluate(dist.shard(dataset.batch(GLOBAL_BATCH)), verbose=0,
                               return_dict=True)
    trained = model.train_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], return_dict=True)
    tested = model.test_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], return_dict=True)
    predicted = model.predict_on_batch(x[:10])
    return {"history": _history(history), "evaluate": _numbers(evaluated),
            "train_on_batch": _numbers(trained), "test_on_batch": _numbers(tested),
            "predict_on_batch": _numbers(predicted)}


def _own_step_model(keras: Any, tf: Any) -> Any:
    class OwnSteps(keras.Model):
        """Its own steps return ``tracked`` (a metric's result: the mean loss so far) and
        ``last`` (this step's mean loss, computed by hand: not scaled for the replicas)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tracked = keras.metrics.Mean(name="tracked")

        @property
        def metrics(self) -> list[Any]:
            return [self.tracked]

        def _both_losses(self, x: Any, y: Any, training: bool) -> tuple[Any, Any]:
            predicted = self(x, training=training)
            mine = tf.reduce_mean(keras.losses.binary_crossentropy(y[:, None], predicted))
            return self.compute_loss(x=x, y=y, y_pred=predicted), mine

        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss, mine = self._both_losses(x, y, True)
            variables = self.trainable_variables
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # noqa: B905
            self.tracked.update_state(mine)
            return {"tracked": self.tracked.result(), "last": mine}

        def test_step(self, data: Any) -> Any:
            _, mine = self._both_losses(*data, False)
            self.tracked.update_state(mine)
            return {"tracked": self.tracked.result(), "last": mine}

    return OwnSteps


def _custom_step(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    dataset, _, _ = _data(tf)
    own_steps = _own_step_model(keras, tf)
    model = _model(dist, keras, own_steps)
    history = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=EPOCHS, verbose=0,
                        validation_data=dist.shard(dataset.take(96).batch(GLOBAL_BATCH)))
    evaluated = model.evaluate(dist.shard(dataset.take(96).batch(GLOBAL_BATCH)), verbose=0,
                               return_dict=True)
    stopper = _model(dist, keras, own_steps)
    stop = keras.callbacks.EarlyStopping(monitor="val_last", mode="min", patience=0,
                                         min_delta=0.02)
    stopped = stopper.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=8, verbose=0,
                          validation_data=dist.shard(dataset.take(96).batch(GLOBAL_BATCH)),
                          callbacks=[stop])
    return {"history": _history(history), "evaluate": _numbers(evaluated),
            "stopped_after": len(stopped.history["last"])}


def _loss_object(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    class LossObject(keras.Model):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loss_fn = keras.losses.BinaryCrossentropy()  # default reduction
            self.tracked = keras.metrics.Mean(name="tracked")

        @property
        def metrics(self) -> list[Any]:
            return [self.tracked]

        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.loss_fn(y[:, None], self(x, training=True))
            variables = self.trainable_variables
            self.own_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # noqa: B905
            self.tracked.update_state(loss)
            return {"tracked": self.tracked.result(), "step_loss": loss}

    dataset, _, _ = _data(tf)
    model = _model(dist, keras, LossObject)
    with dist.scope():
        model.own_optimizer = keras.optimizers.SGD(0.1)  # a GAN's own, beside compile's
    history = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=EPOCHS, verbose=0)

    class OwnMean(LossObject):
        """Its train_step averages its loss over the rows itself (the VAE's, WGAN-GP's shape:
        no loss object, no compute_loss) and applies the gradients with compile's optimizer."""

        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                errors = keras.losses.binary_crossentropy(y[:, None], self(x, training=True))
                loss = tf.reduce_mean(errors)
            variables = self.trainable_variables
            self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))  # noqa: B905
            self.tracked.update_state(loss)
            return {"tracked": self.tracked.result()}

    own = _model(dist, keras, OwnMean)
    own_history = own.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=EPOCHS, verbose=0)
    return {"history": _history(history), "weights": _trainable(model),
            "own_mean": {"history": _history(own_history), "weights": _trainable(own)}}


def _trainable(model: Any) -> Any:
    """The trainable weights (a tracker's state, also a weight on tf_keras, is per rank)."""
    return _numbers(np.concatenate([np.ravel(w.numpy()) for w in model.trainable_weights]))


def _own_metric(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    class LargestPrediction(keras.metrics.Metric):
        """The largest prediction so far: a state that does not add over workers."""

        def __init__(self, name: str = "largest", **kwargs: Any) -> None:
            super().__init__(name=name, **kwargs)
            self.largest = self.add_weight(name="largest", shape=(), initializer="zeros")

        def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
            self.largest.assign(tf.maximum(self.largest, tf.reduce_max(y_pred)))

        def result(self) -> Any:
            return self.largest

    dataset, _, _ = _data(tf)
    model = _model(dist, keras, metrics=lambda: [LargestPrediction()])
    history = model.fit(dist.shard(dataset.batch(GLOBAL_BATCH)), epochs=1, verbose=0)
    return {"history": _history(history)}


def _metric_outside_scope(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    import tfdist

    auc = keras.metrics.AUC(name="outside")  # before the scope: not the strategy's variables
    dataset = _data(tf)[0].batch(GLOBAL_BATCH)
    try:
        model = _model(dist, keras, metrics=lambda: [auc])
        history = model.fit(dist.shard(dataset), epochs=1, verbose=0)
    except (tfdist.ConfigError, ValueError) as error:  # tfdist's refusal; tf_keras's own
        return {"refused": f"{type(error).__name__}: {error}"}
    return {"refused": None, "history": _history(history)}


def _short_last_batch(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    from tfdist.sharding import last_batch_rows

    found = {}
    for rows in (100, 99):
        dataset = _data(tf, rows)[0].batch(GLOBAL_BATCH)
        found[str(rows)] = last_batch_rows(dataset)
        dist.shard(dataset)  # looked at: the warning for an uneven last batch
    _, x, y = _data(tf, 99)
    history = _model(dist, keras).fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    found["arrays_epochs"] = len(history.history["loss"])
    return found


def row_recorder(keras: Any, tf: Any, seen: list[float]) -> Any:
    """A layer that appends feature 0 of every training row its replica sees to ``seen``."""
    def record(batch: Any) -> Any:
        seen.extend(float(v) for v in batch.numpy()[:, 0])
        return np.float32(0)

    class RowRecorder(keras.layers.Layer):
        def call(self, inputs: Any, training: Any = None) -> Any:
            if not training:
                return inputs
            zero = tf.py_function(record, [inputs], tf.float32)
            zero.set_shape(())
            return inputs + zero

    return RowRecorder()


def _recording_model(dist: Any, keras: Any, tf: Any, seen: list[float]) -> Any:
    """A model whose first layer notes feature 0 of every training row its replica sees."""
    keras.utils.set_random_seed(3)
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), row_recorder(keras, tf, seen),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                      jit_compile=False)
    return model


def _batches(keras: Any, x: Any, y: Any, processes: bool = False) -> Any:
    """``x``, ``y`` as a PyDataset (Keras 3, 2 loader threads, or processes) or Sequence
    (tf_keras) of global batches."""
    base = getattr(keras.utils, "PyDataset", None) or keras.utils.Sequence

    class Batches(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            if base.__name__ == "PyDataset":
                super().__init__(workers=2, use_multiprocessing=processes)

        def __len__(self) -> int:
            return len(x) // GLOBAL_BATCH

        def __getitem__(self, index: int) -> Any:
            rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
            return x[rows], y[rows]

    return Batches()


def _batch_of_each_step(seen: list[float], x: Any, replicas: int) -> list[int]:
    """Which global batch of ``x`` each step's rows (``seen``, this replica's) came from."""
    batch_of = {float(row): index // GLOBAL_BATCH for index, row in enumerate(x[:, 0])}
    return [batch_of[row] for row in seen[::GLOBAL_BATCH // replicas]]


def _py_dataset(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    import random

    _, x, y = _data(tf)
    given = (x.copy(), y.copy())
    seen: list[float] = []
    model = _recording_model(dist, keras, tf, seen)
    history = model.fit(_batches(keras, x, y), epochs=EPOCHS, verbose=0, shuffle=False)
    found: dict[str, Any] = {"history": _history(history),
                             "steps": _batch_of_each_step(seen, x, dist.world_size),
                             "arrays_untouched": [bool(np.array_equal(a, b))
                                                  for a, b in zip(given, (x, y), strict=True)]}
    random.seed(7 + dist.rank)  # the ranks' Python random apart, as scripts seed per rank
    seen.clear()
    model.fit(_batches(keras, x, y), epochs=EPOCHS, verbose=0)
    found["seen_shuffled"] = list(seen)
    found["steps_shuffled"] = _batch_of_each_step(seen, x, dist.world_size)
    if dist.world_size > 1:  # use_multiprocessing=True: loader threads instead, one warning
        seen.clear()
        options = {} if hasattr(keras.utils, "PyDataset") else {"workers": 2,
                                                               "use_multiprocessing": True}
        model.fit(_batches(keras, x, y, processes=True), epochs=1, verbose=0, shuffle=False,
                  **options)
        found["steps_processes"] = _batch_of_each_step(seen, x, dist.world_size)
    if dist.world_size > 1:  # the control: Keras's own random, below tfdist's patch
        from tfdist.keras.fit_inputs import _sequence_modules

        modules = [m for m in _sequence_modules() if hasattr(m.random, "_module")]
        agreed = [m.random for m in modules]
        for module in modules:
            module.random = module.random._module
        try:
            seen.clear()
            model.fit(_batches(keras, x, y), epochs=1, verbose=0)
            found["steps_control"] = _batch_of_each_step(seen, x, dist.world_size)
        finally:
            for module, patched in zip(modules, agreed, strict=True):
                module.random = patched
    return found


def _generator(dist: Any, keras: Any, tf: Any) -> dict[str, Any]:
    _, x, y = _data(tf)

    def batches() -> Any:
        for start in range(0, len(x), GLOBAL_BATCH):
            yield x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]

    model = _model(dist, keras)
    history = model.fit(batches(), steps_per_epoch=ROWS // GLOBAL_BATCH - 1, epochs=1,
                        verbose=0)
    return {"epochs": len(history.history["loss"])}



def _saving(dist: Any, keras: Any, tf: Any, out_dir: str) -> dict[str, Any]:
    """Every save a Keras script makes after fit, called on every rank, twice (the second
    replaces the first): each lands once, from the chief, and loads with the final weights."""
    import functools
    import os

    from tfdist.keras.versions import is_keras3
    from tfdist.sync import digest, model_variables

    folder = os.path.join(out_dir, "saving")
    os.makedirs(folder, exist_ok=True)
    model = _model(dist, keras)
    model.fit(dist.shard(_data(tf)[0].batch(GLOBAL_BATCH)), epochs=1, verbose=0)
    weights = "w.weights.h5" if is_keras3(keras) else "w.h5"
    checkpoint = tf.train.Checkpoint(model=model)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(folder, "tfm"), max_to_keep=1)
    returned: list[str] = []
    saves = {"save_weights": lambda: model.save_weights(os.path.join(folder, weights)),
             "save_h5": lambda: model.save(os.path.join(folder, "m.h5")),
             "saved_model": lambda: tf.saved_model.save(model, os.path.join(folder, "sm")),
             "tf_checkpoint_write": lambda: returned.append(
                 checkpoint.write(os.path.join(folder, "tfw", "c"))),
             "tf_checkpoint_save": lambda: returned.append(
                 checkpoint.save(os.path.join(folder, "tfs", "c"))),
             "tf_checkpoint_manager": lambda: returned.append(manager.save())}
    if not is_keras3(keras):  # tf_keras's own formats: a checkpoint prefix, a SavedModel
        saves["checkpoint"] = lambda: model.save_weights(os.path.join(folder, "ckpt", "w"))
        saves["save_folder"] = lambda: model.save(os.path.join(folder, "folder"))
    for save in saves.values():
        save()
        save()
    # Under Horovod a save runs no collective, so the other ranks return before the chief's
    # file is complete: wait for it, as a script that reads the chief's files must.
    dist.sum_over_ranks([1.0])
    loaded = _model(dist, keras)  # on every rank: a model made in the scope runs collectives
    loaded.load_weights(os.path.join(folder, weights))
    read = _model(dist, keras)
    tf.train.Checkpoint(model=read).read(returned[-1]).assert_existing_objects_matched()
    here = functools.partial(os.path.relpath, start=folder)
    return {"digest": digest(model_variables(model)), "saves": sorted(saves),
            "loaded": digest(model_variables(loaded)), "files": sorted(os.listdir(folder)),
            "returned": [here(path) for path in returned], "read": digest(model_variables(read)),
            "tfs": sorted(os.listdir(os.path.join(folder, "tfs"))),
            "tfm": sorted(os.listdir(os.path.join(folder, "tfm"))),
            "latest": here(tf.train.latest_checkpoint(os.path.join(folder, "tfs"))),
            "manager": [here(path) for path in manager.checkpoints]}
