"""What ``fit``, ``evaluate`` and the ``*_on_batch`` calls return on several workers: the numbers
one process would return, or one line saying why not.

Keras reduces what each replica's step returns in ways that differ from one process once the
replicas are in several processes. Measured on 2 workers against one process with the same
global batch; each is a patch of :mod:`tfdist.patches`, installed for several processes:

- tf_keras under MultiWorkerMirroredStrategy *sums* each step's results over the replicas
  (``reduce_per_replica``'s ``"auto"`` is ``"sum"`` off TPUs): right for a loss from
  ``compute_loss`` (divided by the replicas), not for metric results (each replica's over its
  own examples): per-step logs and ``train_on_batch``/``test_on_batch`` read an accuracy of
  1.125. ``keras2-step-results`` averages the results named like the model's metrics.
- A custom ``train_step``/``test_step`` that returns values other than its metrics' results:
  Keras combines them over the replicas (Keras 3 averages, tf_keras sums), and the last step's
  are the epoch's. Keras 3 on MWMS keeps each worker's own unless they are averaged
  (:func:`tfdist.keras.keras3.step_logs_global` averages them for such a model). Either way a
  loss from ``compute_loss`` is divided by the number of replicas under tf.distribute, and any
  other value is not: one warning on the chief (:func:`own_step_line`) says so and names the
  exact way (metrics, which Keras reads over all workers).
- Keras 3's ``predict_on_batch`` under MultiWorkerMirroredStrategy gives every worker's replica
  the whole batch and concatenates them all: each row once per replica. ``predict-on-batch``
  runs the batch through the model here, once: the weights are the same on every worker.
- Keras 3's ``predict`` under MultiWorkerMirroredStrategy splits each batch over the replicas:
  one with fewer rows than replicas (``predict(x[:1])`` on 2 workers) leaves a replica none,
  and on a CPU TensorFlow's oneDNN convolution fails on an empty batch inside a graph (a
  convolution after another: "input depth must be evenly divisible by filter depth: 1 vs 16",
  TensorFlow 2.21 on an AVX-512 CPU; fine eagerly, and with ``TF_ENABLE_ONEDNN_OPTS=0``).
  ``predict-empty-replica`` runs such a replica's model on one row of zeros and returns none.
- Under Horovod each rank's metrics hold its own examples only: the epoch's logs and
  ``evaluate`` were the ranks' average (an AUC of 0.6164 against one process's 0.6181), and
  values a custom step returns instead of compiled metrics were dropped (``{"loss": 0.0}``).
  ``epoch-results`` makes every read of the model's results (the epoch's end, ``evaluate``'s,
  validation's) use the metrics' states summed over the ranks, as MultiWorkerMirroredStrategy
  does, and averages a custom step's values over the ranks.
- Both backends add a metric's state over the workers (totals and counts add). A metric of
  yours whose state does not add (a running maximum, a last value) gives another number than
  one process: one warning on the chief names it, the first time its result is read.

Imported only when :func:`tfdist.patches.install` runs its installers, after TensorFlow is up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tfdist import patches

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["install_epoch_results", "install_keras2_step_results",
           "install_predict_empty_replica", "install_predict_on_batch", "own_metrics",
           "own_step_line", "padded_predict_step"]

logger = logging.getLogger("tfdist")

# Keras 3 reads the model's results at the epoch's end and evaluate's with this method;
# tf_keras with the second.
_RESULT_READERS = ("_get_metrics_result_or_logs", "_validate_and_get_metrics_result")
_LIBRARIES = frozenset({"keras", "tf_keras", "tensorflow", "tfdist", "horovod"})


def install_predict_on_batch(where: Where, dist: Any) -> None:
    """Patch ``predict-on-batch``'s installer (MWMS, several workers, Keras 3; once)."""
    import tensorflow as tf

    patches.apply("predict-on-batch", tf.keras.Model, "predict_on_batch", _predict_on_batch)


def install_keras2_step_results(where: Where, dist: Any) -> None:
    """Patch ``keras2-step-results``'s installer (MWMS, several workers, tf_keras; once)."""
    import tensorflow as tf

    from tfdist.keras.versions import keras2_module

    training = keras2_module("engine.training")
    patches.apply("keras2-step-results", training, "reduce_per_replica", _mean_of_replicas)
    for name in ("fit", "evaluate", "train_on_batch", "test_on_batch"):
        patches.apply("keras2-step-results", tf.keras.Model, name, _keras2_entry)


def install_epoch_results(where: Where, dist: Any) -> None:
    """Patch ``epoch-results``'s installer (several processes, once): under Horovod the
    model's results from the metrics' states summed over the ranks; under MWMS, which sums
    them itself, as Keras reads them."""
    import tensorflow as tf

    is_chief = bool(dist.is_chief)
    if where.backend.horovod:
        from tfdist.horovod import ops

        read = _summed_reader(lambda tensors: [ops.reduce(t, "sum") for t in tensors],
                              lambda logs: ops.average_logs(logs, "tfdist_step_results"))
    else:
        read = functools.partial(_read_as_given, keras3=where.keras3, is_chief=is_chief)
    _install_reader(tf.keras.Model, read, is_chief)


def _summed_reader(sum_over_ranks: Callable[[list[Any]], list[Any]],
                   average_logs: Callable[[dict[str, Any]], None]
                   ) -> Callable[[Any, Any, Any], Any]:
    """Horovod's read of the model's results: from metric states summed by ``sum_over_ranks``
    (tensors in, tensors out, the same order on every rank); a custom step's values averaged
    in place by ``average_logs``."""
    def read(original: Any, model: Any, logs: Any) -> Any:
        with _summed_states(model, sum_over_ranks):
            result = original(model, logs)
        if result is logs and isinstance(logs, dict):  # a custom step's own values
            result = dict(logs)
            average_logs(result)
        return result

    return read


def _install_reader(model_class: Any, read: Callable[[Any, Any, Any], Any],
                    is_chief: bool) -> None:
    name = next(name for name in _RESULT_READERS if hasattr(model_class, name))

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def reader(self: Any, logs: Any) -> Any:
            if is_chief:
                _name_own_metrics(self)
            return read(original, self, logs)

        return reader

    patches.apply("epoch-results", model_class, name, wrap)


def _read_as_given(original: Any, model: Any, logs: Any, *, keras3: bool,
                   is_chief: bool) -> Any:
    """MWMS: the results as Keras reads them, and one warning on the chief when they are a
    custom step's own values."""
    result = original(model, logs)
    if result is logs and isinstance(logs, dict) and type(model) not in _named:
        from tfdist.keras.checks import own_step

        step = own_step(model)
        if step:
            # Every rank: reading the metrics runs collectives under MWMS.
            _named.add(type(model))
            named = {metric.name for metric in model.metrics} | _scaled_losses.get(model, set())
            if not set(logs) <= named and not metric_results_renamed(model, logs) and is_chief:
                logger.warning("tfdist: %s", own_step_line(type(model).__name__, step, keras3))
    return result


def metric_results_renamed(model: Any, logs: dict[str, Any]) -> bool:
    """Whether every value a custom step returned is one of the model's metrics' results under
    another name (``{"loss": self.total_loss_tracker.result()}``): Keras then logs the last
    step's values, which are those results, over all workers. Reads the metrics: call it on
    every rank (MWMS sums their states with collectives)."""
    try:
        results = [float(v) for v in model.get_metrics_result().values()]
        values = [float(v) for v in logs.values()]
    except (AttributeError, TypeError, ValueError):
        return False
    return bool(values) and all(
        any(abs(value - result) <= 1e-6 * max(1.0, abs(result)) for result in results)
        for value in values)


def own_step_line(model: str, step: str, keras3: bool) -> str:
    """The warning for a model whose own step returns values other than its metrics' results,
    on several MultiWorkerMirroredStrategy replicas (pure)."""
    if keras3:
        return (f"{model}'s own {step} returns values that are not its metrics' results: Keras "
                "averages them over the replicas each step and logs the last step's: one "
                "process's for a mean over the batch's rows (a Keras loss's value too: tfdist "
                "logs it unscaled), not for a sum, a maximum or a count. For one process's "
                "numbers whatever they are, update metrics in the step and return their "
                "results ({m.name: m.result() for m in self.metrics}): Keras reads those over "
                "all workers")
    return (f"{model}'s own {step} returns values that are not its metrics' results: Keras "
            "sums them over the replicas each step and logs the last step's. A loss from "
            "compute_loss is divided by the number of replicas under tf.distribute, any other "
            "value is not, so any other value reads replicas times one process's. For one "
            "process's numbers, update metrics in the step and return their results "
            "({m.name: m.result() for m in self.metrics}): Keras reads those over all workers")


@contextlib.contextmanager
def _summed_states(model: Any, sum_over_ranks: Callable[[list[Any]], list[Any]]
                   ) -> Iterator[None]:
    """While the block runs, every metric variable of ``model`` holds its sum over the ranks;
    each rank's own state is back after it (the next steps add to it)."""
    import tensorflow as tf

    variables = _unique(v for metric in model.metrics for v in metric.variables)
    if not variables:
        yield
        return
    own = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    for variable, total in zip(variables, sum_over_ranks(own), strict=True):
        variable.assign(tf.cast(total, variable.dtype))
    try:
        yield
    finally:
        for variable, value in zip(variables, own, strict=True):
            variable.assign(value)


def _unique(variables: Any) -> list[Any]:
    """Each variable once, in first-seen order (Keras 3 lists a shared one once per user)."""
    return list({id(v): v for v in variables}.values())


_named: set[type] = set()  # the classes of metrics and models named in a warning
# model -> the names of its own step's values that are a keras.losses object's scaled mean
# (tf_keras, patch keras2-loss-objects): summed over the replicas, they read one process's
_scaled_losses: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def own_metrics(metrics: Any) -> list[Any]:
    """The metrics in ``metrics`` (and inside Keras's containers of compiled metrics) whose class
    is defined outside Keras, TensorFlow and tfdist and that keep a state (pure)."""
    found, seen = [], set()
    stack = list(metrics or ())
    while stack:
        metric = stack.pop(0)
        if id(metric) in seen:
            continue
        seen.add(id(metric))
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, list | tuple):
            stack.extend(inner)
        library = type(metric).__module__.split(".")[0] in _LIBRARIES
        if not library and list(getattr(metric, "variables", ()) or ()):
            found.append(metric)
    return found


def _name_own_metrics(model: Any) -> None:
    for metric in own_metrics(getattr(model, "metrics", ())):
        if type(metric) in _named:
            continue
        _named.add(type(metric))
        logger.warning(
            "tfdist: the metric %s (%s) is read from its state added over the workers, as "
            "Keras adds it over replicas: right for totals and counts, not for a state that "
            "does not add (a running maximum, a last value), which then differs from one "
            "process's. Keep such a state as totals, or compute it after fit from predict",
            getattr(metric, "name", type(metric).__name__), type(metric).__name__)


# The models whose tf_keras fit/evaluate/*_on_batch call is running (their functions are traced
# inside it): the top one's metric names are the results to average.
_running: list[Any] = []


def _keras2_entry(original: Any) -> Any:
    @functools.wraps(original)
    def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
        _running.append(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _running.pop()

    return entry


def _mean_of_replicas(original: Any) -> Any:
    """tf_keras's ``reduce_per_replica``: on several workers, ``"auto"`` (which sums) means the
    replicas' values of the results named like the model's metrics (each replica's result over
    its own examples); other values (a loss from ``compute_loss``, already divided by the
    replicas) are summed, as Keras has them."""
    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        import tensorflow as tf

        if (reduction != "auto" or not _running or not isinstance(values, dict)
                or not _several_workers(strategy)):
            return original(values, strategy, reduction)
        names = {metric.name for metric in _running[-1].metrics}
        _scaled_losses[_running[-1]] = frozenset(
            key for key, value in values.items() if _a_scaled_loss(value))
        summed = original({k: v for k, v in values.items() if k not in names}, strategy,
                          reduction)

        def mean(value: Any) -> Any:
            if isinstance(value, tf.distribute.DistributedValues):
                return strategy.reduce("MEAN", value, axis=None)
            return value

        return {key: mean(value) if key in names else summed[key]
                for key, value in values.items()}

    return reduce_per_replica


def _a_scaled_loss(value: Any) -> bool:
    """Whether a step's value is, on every local replica, a ``keras.losses`` object's mean that
    tfdist divided by the replicas (:func:`tfdist.keras.loss_scaling.unscaled` knows it)."""
    import tensorflow as tf

    from tfdist.keras.loss_scaling import unscaled

    def scaled(part: Any) -> bool:
        for _ in range(4):  # the replica's output reaches here through tf.identity
            if unscaled(part) is not part:
                return True
            op = getattr(part, "op", None)
            if op is None or op.type != "Identity":
                return False
            part = op.inputs[0]
        return False

    parts = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
    return all(scaled(part) for part in parts)


def install_predict_empty_replica(where: Where, dist: Any) -> None:
    """Patch ``predict-empty-replica``'s installer (MWMS, several workers, Keras 3, CPU)."""
    from tfdist.keras.versions import trainer_class

    patches.apply("predict-empty-replica", trainer_class(), "predict_step", padded_predict_step)


def padded_predict_step(original: Any) -> Any:
    """Keras 3's ``predict_step`` for a replica whose batch may be empty: the model runs on one
    row of zeros instead, and the outputs keep none of its rows (as many rows as the input)."""
    @functools.wraps(original)
    def predict_step(self: Any, data: Any) -> Any:
        import tensorflow as tf
        from keras.src import tree

        batched = [t for t in tree.flatten(data) if isinstance(t, tf.Tensor) and t.shape.rank]
        if not batched:
            return original(self, data)
        rows = tf.shape(batched[0])[0]

        def one_row_if_empty(t: Any) -> Any:
            if not isinstance(t, tf.Tensor) or not t.shape.rank:
                return t
            zeros = tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)
            return tf.cond(rows > 0, lambda: t, lambda: zeros)

        outputs = original(self, tree.map_structure(one_row_if_empty, data))
        return tree.map_structure(
            lambda t: t[:rows] if isinstance(t, tf.Tensor) and t.shape.rank else t, outputs)

    return predict_step


def _predict_on_batch(original: Any) -> Any:
    """Keras 3's ``predict_on_batch``: the batch through the model once, on this worker."""
    @functools.wraps(original)
    def predict_on_batch(self: Any, x: Any) -> Any:
        if not _several_workers(self.distribute_strategy):
            return original(self, x)
        from keras.src import backend, tree

        return tree.map_structure(backend.convert_to_numpy, self.predict_step((x,)))

    return predict_on_batch


def _several_workers(strategy: Any) -> bool:
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())
