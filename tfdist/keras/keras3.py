"""Fixes for Keras 3's ``fit``/``evaluate`` under multi-worker MultiWorkerMirroredStrategy.

Upstream keras-team/keras#20585 (tensorflow/tensorflow#72388), open on every Keras 3 release up
to the one tfdist pins. Two defects, both only with more than one worker:

1. ``TensorFlowTrainer._maybe_symbolic_build`` averages the first *data* batch across replicas
   with ``strategy.reduce("MEAN", batch, axis=None)`` to learn its shapes; the collective
   all-reduce cannot reduce a nested structure ("Attempt to convert a value (PerReplica...)").
   Only the shapes matter there, so one local replica's batch does.
2. ``reduce_per_replica(..., "mean")`` calls ``strategy.reduce("MEAN", v, axis=0)`` on scalar
   losses and metrics ("Invalid reduction dimension 0 for input with 0 dimensions"). The
   single-worker path means across replicas, which is ``axis=None``.

Speed (not a defect): Keras averages each step's logs over the workers, one collective per
step beside the gradients' (about 3 ms a step on 2 CPU workers on loopback). Only the epoch's
logs, which Keras reads from the metrics themselves, steer callbacks such as EarlyStopping, so
tfdist keeps each worker's own per-step logs unless a callback reads them
(:func:`step_logs_global`; setting ``TFDIST_STEP_LOGS``).

3. ``compile(steps_per_execution=N)`` runs N steps in one ``tf.while_loop`` that draws each
   batch with ``get_next_as_optional`` inside a ``tf.cond``; a multi-worker distributed iterator
   agrees on "has a next batch" with a collective, which fails there ("You must feed a value
   for placeholder tensor ... has_next"). tfdist runs the N steps unrolled in one
   ``tf.function`` instead, each drawing its batch with ``get_next``: it knows from the epoch
   iterator how many steps the epoch has left, so the last, shorter chunk gets its own trace.

4. Under any tf.distribute strategy Keras builds the model from a batch before the first step,
   which a model without ``call()`` (a VAE or GAN that calls the models it holds in its own
   ``train_step``) cannot do: "Unable to automatically build the model". One process defers
   the build and trains; :func:`build_without_call` builds what the step cannot create
   itself, the optimizer, and leaves the rest to the first step, as one process does.

All fixes wrap the upstream functions and defer to them everywhere else (they act on a
multi-worker strategy only). tfdist.init installs them under MWMS on the Keras versions in
``AFFECTED``, one installer per row of :data:`tfdist.patches.INVENTORY`;
``tests/test_keras_compat.py`` fails loudly when the pinned Keras no longer has the defects or
moved the patched functions. ``TFDIST_SKIP_PATCHES=keras3-symbolic-build,...`` leaves rows out
(to reproduce the bug; ``TFDIST_KERAS_FIX=0``, deprecated, leaves all five out).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras.checks import check_metrics, check_optimizer, own_step
from tfdist.keras.optimizers import optimizers
from tfdist.keras.versions import needs_fix, trainer_class
from tfdist.settings import resolve, skipped_patches

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["LOG_SAFE_CALLBACKS", "apply", "build_without_call", "built_or_deferred",
           "install_epoch_chunks", "install_reduce_per_replica", "install_step_logs",
           "install_steps_per_execution", "install_symbolic_build", "lacks_call",
           "peeked_batch", "reads_step_logs", "spec_batch", "step_logs_global",
           "steps_in_chunk"]

logger = logging.getLogger("tfdist")


def apply() -> bool:
    """Installs every fix, once, for a strategy made without :func:`tfdist.init` (which
    installs them by the inventory: :mod:`tfdist.patches`); those ``TFDIST_SKIP_PATCHES`` names
    are left out. Returns whether the Keras in use needs them."""
    if not needs_fix():
        return False
    skipped = skipped_patches()
    for key, install in _INSTALLERS.items():
        if key not in skipped:
            install(None, None)
    return True


def install_symbolic_build(where: Where | None, dist: Any) -> None:
    """Patch ``keras3-symbolic-build``'s installer (:func:`tfdist.patches.install`)."""
    patches.apply("keras3-symbolic-build", trainer_class(), "_maybe_symbolic_build",
                  _wrap_symbolic_build)


def install_reduce_per_replica(where: Where | None, dist: Any) -> None:
    """Patch ``keras3-reduce-per-replica``'s installer."""
    from keras.src.backend.tensorflow import trainer

    patches.apply("keras3-reduce-per-replica", trainer, "reduce_per_replica",
                  _wrap_reduce_per_replica)


def install_steps_per_execution(where: Where | None, dist: Any) -> None:
    """Patch ``keras3-steps-per-execution``'s installer."""
    patches.apply("keras3-steps-per-execution", trainer_class(), "_make_function",
                  _wrap_make_function)


def install_epoch_chunks(where: Where | None, dist: Any) -> None:
    """Patch ``keras3-epoch-chunks``'s installer."""
    from keras.src.backend.tensorflow import trainer

    patches.apply("keras3-epoch-chunks", trainer.TFEpochIterator, "_enumerate_iterator",
                  _wrap_enumerate)


def install_step_logs(where: Where | None, dist: Any) -> None:
    """Patch ``keras3-step-logs``'s installer."""
    for name in ("fit", "evaluate"):
        patches.apply("keras3-step-logs", trainer_class(), name, _wrap_logs_mode)


# Each row's installer, in the inventory's order.
_INSTALLERS = {"keras3-symbolic-build": install_symbolic_build,
               "keras3-reduce-per-replica": install_reduce_per_replica,
               "keras3-steps-per-execution": install_steps_per_execution,
               "keras3-epoch-chunks": install_epoch_chunks,
               "keras3-step-logs": install_step_logs}


def _is_multi_worker(strategy: Any) -> bool:
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def lacks_call(model: Any) -> bool:
    """Whether ``model`` is a Keras 3 model without a ``call()`` of its own (a VAE or GAN that
    only calls the models it holds, in its own ``train_step``)."""
    import keras

    return getattr(type(model), "call", None) is getattr(keras.Model, "call", object())


def build_without_call(model: Any) -> None:
    """What Keras's symbolic build would do for a model without ``call()``, which it cannot
    build from a batch (under any tf.distribute strategy it stops with "Unable to automatically
    build the model"; one process defers the build to the first step and trains): the optimizer
    is built over the trainable variables, in the strategy's scope. The models it holds are
    built by the script (its ``train_step`` calls them), as in one process."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", True):
        return
    strategy = getattr(model, "_distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        optimizer.build(model.trainable_variables)


def _wrap_symbolic_build(original: Any) -> Any:
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if strategy is not None and lacks_call(self):
            return build_without_call(self)
        if iterator is None or strategy is None or not _is_multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        import tensorflow as tf
        from keras.src import tree

        data_batch = peeked_batch(iterator)
        if data_batch is None:
            data_batch = spec_batch(iterator)
        if data_batch is None:
            for _, _, it in iterator:
                # No batch: nothing to build from; the epoch ends as in one process.
                with contextlib.suppress(StopIteration, tf.errors.OutOfRangeError):
                    data_batch = next(it)
                break
            if data_batch is None:
                return None

        def local(value: Any) -> Any:
            if isinstance(value, tf.distribute.DistributedValues):
                return strategy.experimental_local_results(value)[0]
            return value

        return built_or_deferred(lambda: original(
            self, iterator=None, data_batch=tree.map_structure(local, data_batch)), self)

    return _maybe_symbolic_build


def built_or_deferred(build: Any, model: Any) -> Any:
    """``build()``, Keras's symbolic build from a batch; for a model with its own
    ``train_step`` whose batch Keras cannot read as ``(x, y, sample_weight)`` (three inputs and
    no targets: ``x`` would be the first only), what one process does instead: the optimizer
    built, the rest at the first step, which reads the batch its own way."""
    try:
        return build()
    except (ValueError, RuntimeError, TypeError):
        if not own_step(model):
            raise
        logger.debug("tfdist: %s is built at its first step, as in one process",
                     type(model).__name__)
        return build_without_call(model)


def spec_batch(iterator: Any) -> Any:
    """The shapes and dtypes of a tf.data input's batches (``tf.TensorSpec`` leaves, the batch
    dimension unknown), for the symbolic build, or None for another input. Reading a batch
    would make an iterator before training's: a shuffle that reshuffles each pass would then
    train epoch 1 on its second order, where one process trains on its first."""
    import tensorflow as tf

    adapter = getattr(iterator, "data_adapter", None)
    try:
        dataset = adapter.get_tf_dataset() if adapter is not None else None
    except Exception:  # an adapter that makes no dataset: read a batch instead
        return None
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def leaf(value: Any) -> Any:
        components = getattr(value, "_component_specs", None)
        if components and not isinstance(value, tf.TensorSpec):  # a replica's of several
            value = components[0]
        if not isinstance(value, tf.TensorSpec) or value.shape.rank in (None, 0):
            raise TypeError(value)
        return tf.TensorSpec([None, *value.shape[1:]], value.dtype)

    try:
        return tf.nest.map_structure(leaf, spec)
    except (TypeError, ValueError):
        return None


def peeked_batch(iterator: Any) -> Any:
    """The first batch of the PyDataset or Python generator that Keras 3's epoch ``iterator``
    reads, taken without drawing from the iterator, or ``None`` for other input. Drawing would
    start a PyDataset's loader a batch ahead (every epoch after it is read from another start
    than one process reads) or use up a generator's first batch."""
    adapter: Any = getattr(iterator, "data_adapter", None)
    first = getattr(adapter, "_first_batches", None)  # a generator's, peeked and put back
    if first:
        return first[0]
    dataset = getattr(adapter, "py_dataset", None)
    if dataset is not None and hasattr(adapter, "_standardize_batch"):
        return adapter._standardize_batch(dataset[0])
    return None


def _wrap_reduce_per_replica(original: Any) -> Any:
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        import tensorflow as tf

        if (reduction in ("auto", "mean") and _is_multi_worker(strategy)
                and not isinstance(strategy, tf.distribute.TPUStrategy)):
            from keras.src import tree

            if _global_step_logs[-1]:
                return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None),
                                          values)
            return tree.map_structure(lambda v: _local_mean(strategy, v), values)
        return original(values, strategy, reduction)

    return reduce_per_replica


def _local_mean(strategy: Any, value: Any) -> Any:
    """The mean of ``value`` over this worker's own replicas: no collective."""
    import tensorflow as tf

    if not isinstance(value, tf.distribute.DistributedValues):
        return value
    local = strategy.experimental_local_results(value)
    return local[0] if len(local) == 1 else tf.reduce_mean(tf.stack(local), axis=0)


# Callbacks whose batch hooks take no decision from the logs they are given: they show or
# write them (on the chief), or act on epochs only. A callback of yours that overrides a batch
# hook (TerminateOnNaN, a LambdaCallback) may stop or branch on a step's logs, which must then
# be the same on every worker.
LOG_SAFE_CALLBACKS = frozenset({
    "ProgbarLogger", "History", "TensorBoard", "BackupAndRestore", "CSVLogger",
    "EarlyStopping", "ReduceLROnPlateau", "LearningRateScheduler"})


_BATCH_HOOKS = ("on_train_batch_end", "on_batch_end", "on_test_batch_end")


def step_logs_global(mode: str, callbacks: Any, model: Any = None) -> tuple[bool, str]:
    """Whether each step's logs must be averaged over the workers, and why (pure).

    Args:
        mode: the ``step_logs`` setting: ``"global"``, ``"local"`` or ``"auto"``.
        callbacks: the ``callbacks`` of a ``fit``/``evaluate`` call: a list, a Keras
            ``CallbackList`` or ``None``. tfdist's wrappers (``ChiefOnly``, ``ChiefWrites``)
            are looked through.
        model: the model trained or evaluated, or ``None``.

    Returns:
        ``(global, reason)``; under ``"auto"`` a model with its own ``train_step`` or
        ``test_step`` makes them global (what such a step returns need not be a compiled
        metric, which Keras reads over all workers at the epoch's end: the last step's value
        is the epoch's), then the first callback that reads per-step logs.
    """
    if mode != "auto":
        return mode == "global", f"TFDIST_STEP_LOGS={mode}"
    step = own_step(model)
    if step:
        return True, f"{type(model).__name__} has its own {step}, whose results Keras logs"
    reader = reads_step_logs(callbacks)
    if reader:
        return True, f"the callback {reader} reads each step's logs"
    return False, "no callback reads each step's logs"


def reads_step_logs(callbacks: Any) -> str | None:
    """The name of the first callback (tfdist's wrappers looked through) that reads each step's
    logs, or None."""
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        inner = callback
        while type(inner).__module__.startswith("tfdist.") and hasattr(inner, "callback"):
            inner = inner.callback
        if _reads_step_logs(inner):
            return type(inner).__name__
    return None


def _reads_step_logs(callback: Any) -> bool:
    cls = type(callback)
    if cls.__module__.startswith("tfdist."):
        return False
    if any(c.__name__ == "ModelCheckpoint" for c in cls.__mro__):
        # save_freq=N picks the best model from a step's logs, and saves run collectives.
        return getattr(callback, "save_freq", "epoch") != "epoch"
    if any(hook in vars(callback) for hook in _BATCH_HOOKS):
        return True  # set on the instance: a LambdaCallback
    for hook in _BATCH_HOOKS:
        owner = next((c for c in cls.__mro__ if hook in vars(c)), None)
        if owner is None or owner.__name__ == "Callback":
            continue  # not overridden
        if not (owner.__name__ in LOG_SAFE_CALLBACKS and owner.__module__.startswith("keras")):
            return True  # yours, or a subclass's override of a safe one
    return False


# What the step functions traced now reduce their logs to; the top is the fit/evaluate call
# running. Outside any (a function traced elsewhere) Keras's own behaviour: global.
_global_step_logs: list[bool] = [True]


def tracing_global_logs() -> bool:
    """Whether the step function traced now reduces its logs over the workers (a collective a
    step), not each worker's own."""
    return _global_step_logs[-1]


_logged_modes: set[bool] = set()


def _wrap_logs_mode(original: Any) -> Any:
    import inspect

    signature = inspect.signature(original)

    training = original.__name__ == "fit"

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_multi_worker(self.distribute_strategy):
            return original(self, *args, **kwargs)
        if training:  # every optimizer the model holds: a GAN's two
            for optimizer in optimizers(self):
                check_optimizer(optimizer, self.distribute_strategy.extended.should_checkpoint)
        check_metrics(self)
        try:
            callbacks = signature.bind_partial(self, *args, **kwargs).arguments.get("callbacks")
        except TypeError:  # a wrong argument: Keras's own call below says which
            callbacks = kwargs.get("callbacks")
        is_global, why = step_logs_global(resolve("step_logs"), callbacks, self)
        if getattr(self, "_tfdist_global_step_logs", is_global) != is_global:
            self.train_function = self.test_function = None  # traced for the other mode
        self._tfdist_global_step_logs = is_global
        if is_global not in _logged_modes and self.distribute_strategy.extended.should_checkpoint:
            _logged_modes.add(is_global)
            logger.info("tfdist: each step's logs are %s (%s); the epoch's are over all workers",
                        "averaged over the workers, a collective per step" if is_global
                        else "each worker's own", why)
        _global_step_logs.append(is_global)
        try:
            return original(self, *args, **kwargs)
        finally:
            _global_step_logs.pop()

    return run


# id(distributed iterator) -> (first step of the chunk being run, steps in the epoch or None)
_chunks: dict[int, tuple[int, int | None]] = {}


def _wrap_enumerate(original: Any) -> Any:
    def _enumerate_iterator(self: Any) -> Any:
        for begin, end, iterator in original(self):
            _chunks[id(iterator)] = (begin, self.steps_per_epoch or self._num_batches or None)
            yield begin, end, iterator

    return _enumerate_iterator


def steps_in_chunk(begin: int, epoch_steps: int | None, steps_per_execution: int) -> int:
    """How many steps one execution runs: ``steps_per_execution``, or what the epoch has left."""
    if epoch_steps is None:
        return steps_per_execution
    return max(0, min(steps_per_execution, epoch_steps - begin))


def _wrap_make_function(original: Any) -> Any:
    def _make_function(self: Any, step_function: Any) -> Any:
        function = original(self, step_function)
        strategy = self.distribute_strategy
        if self.steps_per_execution == 1 or self.run_eagerly or not _is_multi_worker(strategy):
            return function
        return _unrolled_steps(self, step_function, function)

    return _make_function


def _unrolled_steps(model: Any, step_function: Any, upstream: Any) -> Any:
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer

    def one_step_on_data(data: Any) -> Any:
        outputs = model.distribute_strategy.run(step_function, args=(data,))
        return trainer.reduce_per_replica(outputs, model.distribute_strategy, reduction="auto")

    one_step = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)

    def steps(iterator: Any, count: int) -> Any:
        outputs = None
        for _ in range(count):  # unrolled: no collective inside a tf.cond or tf.while_loop
            outputs = one_step(iterator.get_next())
        return outputs

    traced = tf.function(steps)  # traced once per count: a full chunk and the epoch's last

    def function(iterator: Any) -> Any:
        if not isinstance(iterator, tf.distribute.DistributedIterator):
            return upstream(iterator)
        begin, epoch_steps = _chunks.get(id(iterator), (0, None))
        count = steps_in_chunk(begin, epoch_steps, model.steps_per_execution)
        if count == 0:
            raise StopIteration
        return traced(iterator, count)

    return function
