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

All fixes wrap the upstream functions and defer to them everywhere else. They are applied by
tfdist.init only for a multi-worker strategy and only on the Keras versions in ``AFFECTED``;
``tests/test_keras_compat.py`` fails loudly when the pinned Keras no longer has the defects or
moved the patched functions. ``TFDIST_KERAS_FIX=0`` turns the fix off (to reproduce the bug).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from typing import Any

from tfdist import patches
from tfdist.settings import resolve

__all__ = ["AFFECTED", "LOG_SAFE_CALLBACKS", "apply", "compile_owner",
           "compile_without_xla", "is_keras3", "keras2_module", "keras2_package",
           "keras2_random_generator", "legacy_keras_requested", "needs_fix", "own_step",
           "peeked_batch", "random_states", "refuse_mixed_keras", "repair_eager_record",
           "step_logs_global", "steps_in_chunk"]

logger = logging.getLogger("tfdist")

# Half-open range of Keras versions with the defects. Raise the upper bound only after the
# upstream issue is fixed in a release and the tests pass without the fix there.
AFFECTED = ((3, 0), (4, 0))


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def is_keras3(keras_module: Any) -> bool:
    """Whether ``keras_module`` (usually ``tf.keras``) is Keras 3 rather than Keras 2.

    Keras 2 is tf_keras, or on TensorFlow 2.15 the ``keras`` 2.15 package itself. Their
    ``tf.keras`` (``tf_keras.api._v2.keras``, ``keras.api._v2.keras``) has no ``__version__``;
    its package has.
    """
    package = keras_module.__name__.split(".")[0]
    if package == "tf_keras":
        return False
    version = (getattr(keras_module, "__version__", None)
               or getattr(sys.modules.get(package), "__version__", "3"))
    return not str(version).startswith("2.")


def legacy_keras_requested() -> bool:
    """Whether ``tf.keras`` is tf_keras, read the way TensorFlow itself reads the variable."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def keras2_package() -> str | None:
    """The package whose Keras 2 is ``tf.keras``: ``"tf_keras"`` (``TF_USE_LEGACY_KERAS=1``),
    ``"keras"`` (a keras 2.x: TensorFlow 2.15, where ``tf.keras`` is Keras 2 without the
    variable), or None for Keras 3. Both Keras 2 packages have the same ``src.engine``."""
    if legacy_keras_requested():
        return "tf_keras"
    version = getattr(sys.modules.get("keras"), "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("keras")
        except importlib.metadata.PackageNotFoundError:
            return None
    return "keras" if str(version).startswith("2.") else None


def keras2_module(name: str) -> Any:
    """Keras 2's internal module ``name`` (``"backend"``, ``"engine.training"``) in the package
    that is ``tf.keras`` (:func:`keras2_package`; tf_keras where none is): under ``src`` from
    Keras 2.13 on, at the package's top in Keras 2.12 (TensorFlow 2.12's)."""
    package = keras2_package() or "tf_keras"
    try:
        return importlib.import_module(f"{package}.src.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{package}.src":
            raise
        return importlib.import_module(f"{package}.{name}")


def repair_eager_record() -> bool:
    """Gives TensorFlow's eager context back its record of being eager, where TensorFlow 2.14
    and older lost it: imported inside absl's ``app.run`` (an absl-flags script that imports
    TensorFlow in ``main``, as tfdist's examples do).

    There ``import tensorflow`` imports ``tensorflow.python.distribute.combinations``, which
    asks absl to count the GPUs once absl has started (``app.call_after_init``); absl, started
    already, does it at once, and so creates the eager context before ``import tensorflow``
    turns eager execution on. The context's per-thread record of context switches then lacks its
    first, eager entry: inside Keras 2's graph ``executing_eagerly_outside_functions()`` is
    False, ``keras.Input`` makes a graph placeholder instead of a KerasTensor, and building a
    model fails ("Output tensors of a Sequential model must be the output of a TensorFlow
    `Layer`"). TensorFlow 2.15 and newer import that module later. The repair swaps in the
    record the context's constructor makes with eager execution on; where the record is whole,
    or TensorFlow is not eager, it changes nothing.

    Returns whether it repaired.
    """
    if "tensorflow" not in sys.modules:  # not started: nothing lost (and nothing to import)
        return False
    from tensorflow.python.eager import context

    eager_context = context.context()
    record = getattr(eager_context, "_context_switches", None)
    if record is None or record.stack or not eager_context.executing_eagerly():
        return False
    patches.apply("eager-record", eager_context, "_context_switches",
                  lambda lost: type(lost)(True))
    logger.debug("tfdist: TensorFlow's eager context was created before eager execution was "
                 "on (TensorFlow <= 2.14 imported inside absl's app.run): repaired")
    return True


def keras2_random_generator() -> bool:
    """On Keras 2, makes the random layers created from now on (Dropout, noise, random
    initializers without a seed) draw from a ``tf.random.Generator``, whose state is a variable
    that tfdist saves with a preempted run (:func:`random_states`), instead of TensorFlow's
    legacy stateful random ops, whose state no checkpoint holds: a resumed run then draws the
    masks an uninterrupted one would. Keras 3's layers do so already (``SeedGenerator``).

    Returns whether Keras 2 is in use (and now draws from generators).
    """
    package = keras2_package()
    if package is None:
        return False
    backend = keras2_module("backend")
    if not backend.is_tf_random_generator_enabled():
        backend.enable_tf_random_generator()
        logger.debug("tfdist: %s's random layers draw from tf.random.Generator", package)
    return True


def random_states(model: Any) -> list[Any]:
    """The variables of a Keras model's random generators, which the model's file (``weights``)
    and a ``tf.train.Checkpoint`` of it leave out: Keras 3's seed generators (in ``variables``
    but not ``weights``), and Keras 2's ``tf.random.Generator`` states (see
    :func:`keras2_random_generator`), which neither lists. [] for anything else."""
    if not hasattr(model, "weights") or not hasattr(model, "variables"):
        return []
    saved = {id(v) for v in model.weights}
    found = [v for v in model.variables if id(v) not in saved]
    listed = {id(v) for v in found}
    layers = model._flatten_layers() if hasattr(model, "_flatten_layers") else ()
    for layer in layers:
        generator = getattr(getattr(layer, "_random_generator", None), "_generator", None)
        state = getattr(generator, "state", None)
        if state is not None and id(state) not in listed:
            found.append(state)
            listed.add(id(state))
    return found


def needs_fix() -> bool:
    """True when Keras 3 drives ``tf.keras`` and its version is in ``AFFECTED``."""
    if legacy_keras_requested():
        return False  # tf_keras (Keras 2) has its own multi-worker code, which works
    import keras

    return AFFECTED[0] <= _version_tuple(keras.__version__) < AFFECTED[1]


def apply() -> bool:
    """Installs the fixes (:mod:`tfdist.patches`), once. Returns whether they are installed."""
    if not resolve("keras_fix") or not needs_fix():
        return False
    from keras.src.backend.tensorflow import trainer

    cls = trainer.TensorFlowTrainer
    applied = [
        patches.apply("keras3-symbolic-build", cls, "_maybe_symbolic_build",
                      _wrap_symbolic_build),
        patches.apply("keras3-reduce-per-replica", trainer, "reduce_per_replica",
                      _wrap_reduce_per_replica),
        patches.apply("keras3-steps-per-execution", cls, "_make_function",
                      _wrap_make_function),
        patches.apply("keras3-epoch-chunks", trainer.TFEpochIterator, "_enumerate_iterator",
                      _wrap_enumerate),
        *(patches.apply("keras3-step-logs", cls, name, _wrap_logs_mode)
          for name in ("fit", "evaluate")),
    ]
    if any(applied):
        import keras

        logger.debug("tfdist: applied the Keras %s multi-worker fit fix (keras#20585)",
                      keras.__version__)
    return True


def _is_multi_worker(strategy: Any) -> bool:
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def _wrap_symbolic_build(original: Any) -> Any:
    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is None or strategy is None or not _is_multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        import tensorflow as tf
        from keras.src import tree

        data_batch = peeked_batch(iterator)
        if data_batch is None:
            for _, _, it in iterator:
                data_batch = next(it)
                break

        def local(value: Any) -> Any:
            if isinstance(value, tf.distribute.DistributedValues):
                return strategy.experimental_local_results(value)[0]
            return value

        return original(self, iterator=None, data_batch=tree.map_structure(local, data_batch))

    return _maybe_symbolic_build


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
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        inner = callback
        while type(inner).__module__.startswith("tfdist.") and hasattr(inner, "callback"):
            inner = inner.callback
        if _reads_step_logs(inner):
            return True, f"the callback {type(inner).__name__} reads each step's logs"
    return False, "no callback reads each step's logs"


_LIBRARIES = frozenset({"keras", "tf_keras", "tensorflow", "tfdist"})


def own_step(model: Any) -> str | None:
    """The name of the first of ``train_step``, ``test_step`` that ``model``'s class defines
    itself (outside Keras and tfdist), or ``None`` (pure)."""
    if model is None:
        return None
    for name in ("train_step", "test_step"):
        owner = next((c for c in type(model).__mro__ if name in vars(c)), None)
        if owner is not None and owner.__module__.split(".")[0] not in _LIBRARIES:
            return name
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
_logged_modes: set[bool] = set()


def _wrap_logs_mode(original: Any) -> Any:
    import inspect

    signature = inspect.signature(original)

    training = original.__name__ == "fit"

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_multi_worker(self.distribute_strategy):
            return original(self, *args, **kwargs)
        if training:
            check_optimizer(getattr(self, "optimizer", None),
                            self.distribute_strategy.extended.should_checkpoint)
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


def check_optimizer(optimizer: Any, is_chief: bool = True) -> None:
    """What Keras 3's optimizer does differently on several MWMS workers, before the first step:
    ``gradient_accumulation_steps`` fails upstream ("merge_call called while defining a new
    graph"): refused with the fix; clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``)
    is applied to each replica's gradients before they are averaged, not to the average as in
    one process: one warning saying so.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` is set.
    """
    if optimizer is None:
        return
    if getattr(optimizer, "gradient_accumulation_steps", None):
        from tfdist.errors import ConfigError

        raise ConfigError(
            f"{type(optimizer).__name__}(gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}) fails in Keras 3 under several "
            "MultiWorkerMirroredStrategy workers (upstream: 'merge_call called while defining "
            "a new graph'). Raise the global batch instead (more workers already add to it), "
            "or train with backend='horovod', which accumulates correctly")
    clipping = {name: getattr(optimizer, name, None)
                for name in ("clipnorm", "global_clipnorm", "clipvalue")}
    clipping = {name: value for name, value in clipping.items() if value is not None}
    if clipping and is_chief and "clipping" not in _optimizer_warned:
        _optimizer_warned.add("clipping")
        logger.warning(
            "tfdist: %s clips each replica's gradients before they are averaged (Keras 3 "
            "under tf.distribute), not their average as one process does: the weights differ "
            "from one process's while clipping is active. backend='horovod' or tf_keras clip "
            "the averaged gradients", ", ".join(f"{k}={v}" for k, v in clipping.items()))


_optimizer_warned: set[str] = set()


def check_metrics(model: Any) -> None:
    """Refuses a compiled metric object that was created outside the strategy's scope (Keras 3
    accepts it, tf_keras refuses it): under several MultiWorkerMirroredStrategy workers its
    state stays each worker's own, so its results differ from rank to rank and from one
    process's. The same answer on every rank, before the first step.

    Raises:
        ConfigError: naming the metric and the fix.
    """
    compiled = getattr(model, "_compile_metrics", None)
    strategy = model.distribute_strategy
    stack = [getattr(compiled, name, None) for name in ("_user_metrics", "_user_weighted_metrics")]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif any(not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
                 for v in getattr(item, "variables", None) or ()):
            from tfdist.errors import ConfigError

            name = getattr(item, "name", type(item).__name__)
            raise ConfigError(
                f"the metric {name} ({type(item).__name__}) was created outside `with "
                "dist.scope():`: under several MultiWorkerMirroredStrategy workers its state "
                "stays each worker's own, and its results differ from rank to rank and from "
                "one process's (tf_keras refuses it too). Create it inside the scope, or pass "
                "its name to compile (metrics=['auc'])")


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


def compile_without_xla(model_class: Any, reason: str) -> None:
    """Makes ``compile(jit_compile=True)`` compile without XLA, with one warning saying why.

    For the launches where XLA cannot compile the step's all-reduce: MWMS on CPUs (TensorFlow
    has no XLA collectives for CPU devices, b/194942685; with NCCL on GPUs it has) and Horovod
    (its ops are not XLA ops). The script runs unchanged; only the step is not XLA-compiled.
    """
    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("jit_compile") is True:
                if not _warned:
                    logger.warning("tfdist: compile(jit_compile=True) trains without XLA here: "
                                   "%s", reason)
                    _warned.append(True)
                kwargs["jit_compile"] = False
            return original(self, *args, **kwargs)

        return compile

    patches.apply("compile-without-xla", compile_owner(model_class), "compile", wrap)


def compile_owner(model_class: Any) -> Any:
    """The class that defines ``compile`` for ``model_class`` (Keras 3: ``Trainer``; tf_keras:
    ``Model``), where tfdist wraps it. Keras compiles a loaded model from its saved config only
    where ``compile`` is that class's own (``compile_from_config``: "the model's compile()
    method is custom" otherwise), so a wrapper set on a subclass would leave every
    ``load_model`` without its optimizer."""
    return next(cls for cls in model_class.__mro__ if "compile" in vars(cls))


_warned: list[bool] = []


MIXED_KERAS = (
    "this model is a Keras 3 model (`import keras`), but TF_USE_LEGACY_KERAS=1 makes tf.keras, "
    "and so tfdist's strategy set-up and callbacks, tf_keras (Keras 2): the two do not mix on "
    "several workers (Keras 3's fit fails on PerReplica values; under Horovod its gradients "
    "would not be averaged). Build the model with `tf.keras` (or `import tf_keras as keras`), "
    "or unset TF_USE_LEGACY_KERAS to train with Keras 3")


def refuse_mixed_keras() -> bool:
    """With ``TF_USE_LEGACY_KERAS=1`` and Keras 3 imported too (``import keras``), makes Keras 3
    models' ``fit``, ``evaluate`` and ``predict`` raise :data:`MIXED_KERAS` instead of failing
    deep inside TensorFlow (or, under Horovod, training without averaging). Returns whether the
    guard is in place. A script that imports Keras 3 only after :func:`tfdist.init` is not
    seen."""
    module = sys.modules.get("keras")
    if not legacy_keras_requested() or module is None or not is_keras3(module):
        return False
    from keras.src.backend.tensorflow import trainer

    from tfdist.errors import ConfigError

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise ConfigError(MIXED_KERAS)

        return refuse

    for name in ("fit", "evaluate", "predict"):
        patches.apply("mixed-keras", trainer.TensorFlowTrainer, name, wrap)
    return True
