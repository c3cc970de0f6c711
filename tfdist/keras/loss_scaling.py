"""Keras 3's losses scaled for the replicas' sum, made one process's where Keras leaves them off.

Under a tf.distribute strategy the replicas' gradients are summed, so Keras 3 divides a loss
object's mean by the number of replicas (``scale_loss_for_distribution``): the sum is then the
global batch's mean, as in one process. Two places where that goes wrong on several workers,
measured on 2 MWMS workers against one process with the same global batch:

- **A scaled loss logged.** A custom ``train_step`` that calls a ``keras.losses`` object and
  returns its value, or feeds it to a ``keras.metrics.Mean`` tracker (the DCGAN, WGAN and
  distillation examples' shape), logs the scaled value: 1/N of one process's loss. Keras's own
  ``train_step`` unscales before its tracker; the user's cannot know. tfdist remembers each
  tensor the scaling made, in the step being traced, and where that very tensor is logged (a
  value the step returns, a ``Mean``/``Sum`` metric's update) it puts the unscaled one: the
  gradient keeps the scaled loss, the logs read one process's numbers.
- **Weights summed per replica.** ``reduction="mean_with_sample_weight"`` divides each
  replica's weighted sum by its own weights' sum; averaged over the replicas that is not the
  global batch's weighted mean when their weights differ. tfdist divides by every replica's
  weights (one scalar all-reduce a step).
- **A batch that does not divide.** Keras divides by N whatever each replica's rows: a global
  batch of 33 on 2 replicas weighs 17 rows and 16 rows 1:1 (and an uneven last batch, or a
  replica left without rows, likewise). In ``fit``'s step tfdist scales by the replica's share
  of the batch's rows instead (its rows over the job's, one all-reduce of N numbers a step,
  which also tells :mod:`tfdist.keras.random_draws` where each replica's rows lie), which
  is 1/N when the batch divides, and, where each step's logs are averaged over the workers,
  weighs its logged means by the rows each replica counted (one more all-reduce): the step is
  one process's.
- **A term of the model's own.** A model that overrides ``compute_loss`` to add a term (a
  penalty's mean) to ``super().compute_loss(...)`` adds an unscaled number to scaled ones: the
  term's gradient is N times one process's. tfdist lets Keras's losses stay each replica's
  mean inside such a ``compute_loss`` and scales its total once.
- **A loss that returns one number.** A ``keras.losses.Loss`` subclass whose ``call`` reduces
  over the batch itself (a contrastive loss over the batch's pairs) reaches Keras's reduction
  as a scalar, which Keras returns unscaled: the replicas' sum is N times one process's
  gradient. tfdist scales it like every other mean, once, and says so in one warning: each
  replica computes such a loss over its own rows only (pairs across replicas are missing), so
  it stays near one process's, not equal.

- **A mean of the script's own.** A custom ``train_step`` that averages its loss over the rows
  itself (``tf.reduce_mean``, ``ops.mean``: the VAE and WGAN-GP examples) and applies the
  gradients gives each replica's mean's gradient, which the optimizer sums: N times one
  process's step. Where fit's step takes a gradient w.r.t. variables, tfdist walks back from
  the loss to the reductions over the rows: only means of the script's own, and the gradients
  are scaled by the replica's share of the rows (one line says so); a sum over the rows
  (``tf.nn.compute_average_loss``), a mean the script divides by the replicas itself, or a
  loss Keras scaled is left alone; a mean beside one of those is named in one warning. On
  tf_keras (patch ``keras2-loss-objects``) fit's step divides such gradients by the replicas
  (tf_keras weighs an uneven split 1:1 anyway); a loop of the script's own (``strategy.run``)
  is only named: TensorFlow's guides scale that loss by hand (``tf.nn.compute_average_loss``).

Installed (patch ``keras3-loss-scaling``) under MWMS over several workers on Keras 3.

tf_keras (Keras 2) refuses the DCGAN's shape outright: a ``keras.losses`` object with its
default reduction, called outside ``compile`` under any tf.distribute strategy, raises its own
``ValueError`` ("Please use ``Reduction.SUM`` or ``Reduction.NONE`` ..."), so the Keras 3
program fails on tf_keras as soon as it runs on several workers. Patch ``keras2-loss-objects``
computes such a loss as Keras 3 does: the replica's mean divided by the replicas (their summed
gradients are then the global batch's mean), and where that very tensor reaches a ``Mean`` or
``Sum`` tracker, the tracker gets the unscaled mean; a value the step returns as it is, tf_keras
sums over the replicas, which makes the scaled means one process's mean.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras.versions import trainer_class

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["install_keras2_loss_objects", "install_loss_scaling", "replica_rows", "unscaled"]

logger = logging.getLogger("tfdist")
# scaled tensor's ref -> the unscaled tensor, for the step being traced (a thread's own: Keras
# may trace on several threads). Cleared at each step function's trace.
_local = threading.local()
_warned: set[str] = set()
# tf_keras: scaled tensor's ref -> the replica's mean, for the graph being traced; shared by the
# threads that trace it (MirroredStrategy traces each replica on a thread of its own, and
# reduces their values on the caller's).
_keras2_made: dict[str, Any] = {"graph": None, "made": {}}
_keras2_lock = threading.Lock()
_keras2_installed = False  # patch keras2-loss-objects is: Keras 2's fit steps are known by name


def _made() -> dict[Any, Any]:
    made: dict[Any, Any] | None = getattr(_local, "made", None)
    if made is None:
        made = _local.made = {}
    return made


def unscaled(value: Any) -> Any:
    """The unscaled loss if ``value`` is a loss Keras scaled for the replicas in this trace,
    else ``value``."""
    ref = getattr(value, "ref", None)
    if ref is None:
        return value
    try:
        key = ref()
        return _made().get(key, _keras2_made["made"].get(key, value))
    except TypeError:  # not hashable: no tensor of ours
        return value


def install_loss_scaling(where: Where, dist: Any) -> None:
    """Patch ``keras3-loss-scaling``'s installer (MWMS, several workers, Keras 3; once)."""
    from keras.src.losses import loss as loss_module
    from keras.src.metrics import reduction_metrics

    patches.apply("keras3-loss-scaling", loss_module, "scale_loss_for_distribution",
                  _remembering)
    patches.apply("keras3-loss-scaling", loss_module, "unscale_loss_for_distribution",
                  _unscaling)
    patches.apply("keras3-loss-scaling", loss_module, "reduce_values",
                  functools.partial(_scalars_scaled, scale=loss_module))
    for metric in (reduction_metrics.Mean, reduction_metrics.Sum):
        patches.apply("keras3-loss-scaling", metric, "update_state", _metric_unscaled)
    patches.apply("keras3-loss-scaling", reduction_metrics.Mean, "result", _result_noted)
    patches.apply("keras3-loss-scaling", trainer_class(), "_make_function",
                  _step_unscaled)
    patches.apply("keras3-loss-scaling", trainer_class(), "_compute_loss",
                  functools.partial(_scaled_once, scale=loss_module))
    import tensorflow as tf

    patches.apply("keras3-loss-scaling", tf.GradientTape, "gradient", _hand_reduced_scaled)


def _deferred() -> bool:
    """Whether a model's own ``compute_loss`` is running: Keras's scaling waits for its total."""
    return bool(getattr(_local, "deferred", False))


def _scaled_once(original: Any, scale: Any) -> Any:
    """A model whose class overrides ``compute_loss`` (adding a term of its own to
    ``super().compute_loss(...)``, the guides' advice) gets its total scaled once, as Keras
    scales its own losses: inside, Keras's losses stay each replica's mean, so the user's term,
    a mean too, is not left N times too large in the replicas' summed gradient."""
    from tfdist.keras.checks import owns

    @functools.wraps(original)
    def _compute_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _deferred() or not owns(self, "compute_loss"):
            return original(self, *args, **kwargs)
        _local.deferred = True
        try:
            total = original(self, *args, **kwargs)
        finally:
            _local.deferred = False
        return scale.scale_loss_for_distribution(total)

    return _compute_loss


def _remembering(original: Any) -> Any:
    @functools.wraps(original)
    def scale_loss_for_distribution(value: Any) -> Any:
        if _deferred():
            return value
        share = getattr(_local, "share", None)
        if share is None:
            scaled = original(value)
        else:
            from keras.src import ops

            scaled = ops.multiply(value, ops.cast(share, value.dtype))
        if scaled is not value and hasattr(scaled, "ref"):
            _made()[scaled.ref()] = value
        return scaled

    return scale_loss_for_distribution


def _unscaling(original: Any) -> Any:
    @functools.wraps(original)
    def unscale_loss_for_distribution(value: Any) -> Any:
        if _deferred():
            return value
        made = unscaled(value)
        if made is not value:
            return made
        share = getattr(_local, "share", None)
        if share is None:
            return original(value)
        from keras.src import ops

        return ops.divide_no_nan(value, ops.cast(share, value.dtype))

    return unscale_loss_for_distribution


def _replica_share(data: Any) -> Any:
    """This replica's rows over the global batch's (one scalar all-reduce), the factor that
    makes the replicas' summed gradients the global batch's mean when the batch splits
    unevenly (33 rows on 2: 17/33 and 16/33, not 1/2 each). None outside a replica context of
    several replicas, or for a batch without rows to count."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return None
    rows = _rows(data)
    if rows is None:
        return None
    rows = tf.cast(rows, tf.float32)
    # Every replica's rows (one all-reduce of N numbers): the share, and where each replica's
    # rows lie in the global batch (replica_rows: the random draws for the global batch).
    _local.counts = context.all_reduce(
        "sum", tf.one_hot(context.replica_id_in_sync_group, context.num_replicas_in_sync) * rows)
    return tf.math.divide_no_nan(rows, tf.reduce_sum(_local.counts))


def replica_rows() -> Any:
    """In ``fit``'s training step being traced on several replicas: every replica's rows in
    this step's batch (a float vector, replica order), else None."""
    return getattr(_local, "counts", None)


def _static_rows(data: Any) -> Any:
    """The batch's rows where the trace knows them (its first batched tensor's first
    dimension), else None."""
    import tensorflow as tf

    for tensor in tf.nest.flatten(data):
        shape = getattr(tensor, "shape", None)
        if shape is not None and shape.rank:
            return shape[0]
    return None


def _rows(data: Any) -> Any:
    """The batch's rows: its first batched tensor's first dimension, or None."""
    import tensorflow as tf

    for tensor in tf.nest.flatten(data):
        if isinstance(tensor, tf.RaggedTensor):
            return tensor.nrows()
        if isinstance(tensor, tf.SparseTensor):
            return tensor.dense_shape[0]
        if getattr(tensor, "shape", None) is not None and tensor.shape.rank:
            return tf.shape(tensor)[0]
    return None


def _scalars_scaled(original: Any, scale: Any) -> Any:
    @functools.wraps(original)
    def reduce_values(values: Any, sample_weight: Any = None,
                      reduction: Any = "sum_over_batch_size") -> Any:
        if (reduction == "mean_with_sample_weight" and sample_weight is not None
                and not _deferred()):
            weighted = _over_the_job_weights(values, sample_weight)
            if weighted is not None:
                return weighted
        result = original(values, sample_weight, reduction)
        if (tuple(getattr(values, "shape", (0,))) == ()
                and reduction in ("sum_over_batch_size", "mean", "mean_with_sample_weight")):
            _warn_scalar()
            return scale.scale_loss_for_distribution(result)
        return result

    return reduce_values


def _over_the_job_weights(values: Any, sample_weight: Any) -> Any:
    """``reduction="mean_with_sample_weight"`` over the global batch: the replica's weighted
    sum over the sum of every replica's weights (one scalar all-reduce), which the replicas'
    sum makes one process's mean (each replica's own mean, averaged, is not when the replicas'
    weights differ). None outside a replica context of several replicas."""
    import tensorflow as tf
    from keras.src import ops

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2 or tuple(values.shape) == ():
        return None
    total = ops.sum(values)
    weights = context.all_reduce("sum", ops.cast(ops.sum(sample_weight), total.dtype))
    loss = ops.divide_no_nan(total, weights)
    _made()[loss.ref()] = loss * context.num_replicas_in_sync  # the job's mean, as logged
    return loss


def _warn_scalar() -> None:
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if "scalar" in _warned or context is None or context.num_replicas_in_sync < 2:
        return
    _warned.add("scalar")
    if tf.distribute.get_strategy().extended.should_checkpoint:  # the chief
        logger.warning(
            "tfdist: a loss of yours returns one number for the batch (its call() reduces "
            "over the rows): each of the %d replicas computes it over its own rows only; tfdist "
            "scales it for the replicas' sum as Keras scales its own losses, so the gradient "
            "has one process's size, but a loss over pairs of rows (contrastive) misses the "
            "pairs across replicas and stays near one process's, not equal. For one process's "
            "numbers: a loss per row (call() returning one value per example)",
            context.num_replicas_in_sync)


def _metric_unscaled(original: Any) -> Any:
    @functools.wraps(original)
    def update_state(self: Any, values: Any, sample_weight: Any = None) -> Any:
        return original(self, unscaled(values), sample_weight=sample_weight)

    return update_state


def _step_unscaled(original: Any) -> Any:
    @functools.wraps(original)
    def _make_function(self: Any, step_function: Any) -> Any:
        from tfdist.keras.keras3 import tracing_global_logs

        # Only fit's step weighs the replicas by their rows (a collective a step: evaluate may
        # run on one rank); evaluate's logs are one process's anyway (weighted by rows).
        trains = getattr(step_function, "__name__", "") == "train_step"

        @functools.wraps(step_function)
        def step(data: Any) -> Any:
            _made().clear()
            _local.share = _replica_share(data) if trains else None
            _local.rows = _static_rows(data)
            _local.results = {}
            try:
                outputs = step_function(data)
            finally:
                share, _local.share = _local.share, None
                results, _local.results = _local.results, {}
                _local.counts = None
            if isinstance(outputs, dict):
                outputs = {key: unscaled(value) for key, value in outputs.items()}
                if share is not None and tracing_global_logs():  # each worker's own: as is
                    outputs = _weighted_by_rows(outputs, results)
            return outputs

        return original(self, step)

    return _make_function


def _hand_reduced_scaled(original: Any) -> Any:
    """A custom ``train_step``'s gradient of a loss it averaged over the rows itself
    (``tf.reduce_mean``, ``ops.mean``: the VAE, WGAN-GP shape) is each replica's mean's; the
    optimizer sums the replicas' gradients, N times one process's step. Where the gradient is
    taken in fit's train step, w.r.t. variables, of a loss that reaches the rows through a mean
    and through no loss Keras scaled, tfdist scales the gradients by the replica's share of the
    batch's rows, as Keras scales its own losses: their sum is then one process's. A loss that
    sums over the rows (``tf.nn.compute_average_loss`` divides such a sum by the global batch)
    is right as it is and left alone; a loss that mixes a Keras-scaled part with a mean of its
    own is named in one warning. tf_keras's fit step (no rows known) scales by 1/N; a loop of
    the script's own (``strategy.run`` outside fit) is named, not changed."""

    @functools.wraps(original)
    def gradient(self: Any, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
        grads = original(self, target, sources, *args, **kwargs)
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if (context is None or context.num_replicas_in_sync < 2 or tf.executing_eagerly()
                or not _all_variables(sources)):
            return grads
        replicas = context.num_replicas_in_sync
        share = getattr(_local, "share", None)
        if share is None and _in_keras2_fit():  # tf_keras: an even split assumed
            share = tf.constant(1.0 / replicas)
        reduction = _batch_reduction(target, getattr(_local, "rows", None), replicas,
                                     set(_made()) | set(_keras2_made["made"]))
        if reduction in _TOLD:
            _warn_once(reduction, _TOLD[reduction])
        if reduction != "mean":
            return grads
        if share is None:  # a loop of the script's own (strategy.run): named, left as it is
            _warn_once("loop-mean", _LOOP_MEAN)
            return grads
        _warn_once("hand-mean", _HAND_MEAN)

        def scaled(grad: Any) -> Any:
            if grad is None:
                return None
            if isinstance(grad, tf.IndexedSlices):
                return tf.IndexedSlices(grad.values * tf.cast(share, grad.values.dtype),
                                        grad.indices, grad.dense_shape)
            return grad * tf.cast(share, grad.dtype)

        return tf.nest.map_structure(scaled, grads,
                                     check_types=False) if grads is not None else grads

    return gradient


def _in_keras2_fit() -> bool:
    """Whether the graph being traced is Keras 2's fit step (its ``train_function``), where
    patch ``keras2-loss-objects`` is installed."""
    import tensorflow as tf

    name = str(getattr(tf.compat.v1.get_default_graph(), "name", ""))
    return _keras2_installed and name.startswith("train_function")


_LOOP_MEAN = (
    "tfdist: a training loop of yours (strategy.run) takes gradients of a loss it averages "
    "over each replica's rows itself: the optimizer sums the %d replicas' gradients, %d times "
    "one process's step. Fix: tf.nn.compute_average_loss(per_example_loss, "
    "global_batch_size=...) (or divide the mean by dist.num_replicas)")
_HAND_MEAN = (
    "tfdist: a train_step of yours takes gradients of a loss it averages over the rows itself "
    "(a mean of its own, not a keras.losses object or compute_loss): each of the %d replicas "
    "averages its own rows and the optimizer sums the replicas' gradients, %d times one "
    "process's step. tfdist scales those gradients by each replica's share of the batch, as "
    "Keras scales its own losses, so the step is one process's; a step that already divides "
    "its loss by the replicas must stop doing so")
_MIXED = (
    "tfdist: a training step of yours takes gradients of a loss that adds a mean of its own to "
    "a part already scaled for the replicas (a keras.losses object's or compute_loss's value, or "
    "a mean it divides by the replicas): the optimizer sums the %d replicas' gradients, right "
    "for the scaled part, %d times one process's for the mean. Fix: compute the whole loss "
    "with keras.losses objects or self.compute_loss, or divide each mean of your own by "
    "dist.num_replicas")
_MEAN_AND_SUM = (
    "tfdist: a training step of yours takes gradients of a loss that adds a mean over the rows "
    "to a sum over the rows: the optimizer sums the %d replicas' gradients, right for the sum, "
    "%d times one process's for the mean. Fix: divide the mean by dist.num_replicas, or "
    "compute the loss with keras.losses objects or self.compute_loss")
_TOLD = {"mixed": _MIXED, "mean and sum": _MEAN_AND_SUM}


def _warn_once(key: str, message: str) -> None:
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if key in _warned or context is None:
        return
    _warned.add(key)
    if tf.distribute.get_strategy().extended.should_checkpoint:  # the chief
        logger.warning(message, context.num_replicas_in_sync, context.num_replicas_in_sync)


def _all_variables(sources: Any) -> bool:
    """Whether every source is a variable (a gradient for an optimizer), not a tensor (a
    gradient penalty's gradient w.r.t. the inputs is left as it is)."""
    import tensorflow as tf

    flat = tf.nest.flatten(sources, expand_composites=False)  # a Keras 3 variable: assign too
    return bool(flat) and all(isinstance(s, tf.Variable) or hasattr(s, "assign") for s in flat)


_REDUCTIONS = {"Mean": "mean", "Sum": "sum"}
# Where a walk back from the loss stops: a variable's value, an input, a constant.
_LEAVES = {"ReadVariableOp", "VarHandleOp", "Placeholder", "Const", "VariableV2",
           "_Arg", "ResourceGather"}


def _batch_reduction(target: Any, rows: Any, replicas: int, scaled: Collection[Any]) -> str:
    """How ``target`` (a loss) reduces the batch's rows, walking back from it through the
    graph: each path stops at the first reduction over a batched tensor's first axis (a
    ``Mean`` or ``Sum``: the loss's own; a BatchNormalization's means lie beyond it) or at a
    tensor of ``scaled`` (refs of losses Keras scaled). A path through a division by
    ``replicas`` (or a product with its inverse) is the script's own scaling for them.

    Returns ``"mean"`` (only means of the script's own: N times one process's once summed),
    ``"keras"`` (scaled losses, perhaps beside means the script divides by the replicas
    itself), ``"sum"`` (sums, or divided means), ``"mixed"`` (an own mean beside a scaled loss
    or a divided mean), ``"mean and sum"``, or ``"unknown"`` (eager, or no reduction found)."""
    import tensorflow as tf

    if tf.executing_eagerly() or not hasattr(target, "op"):
        return "unknown"
    kinds: set[str] = set()
    seen: set[tuple[str, bool]] = set()
    stack = [(target, False)]
    while stack and len(seen) < 50000:
        tensor, divided = stack.pop()
        try:
            if tensor.ref() in scaled:
                kinds.add("keras")
                continue
        except TypeError:
            continue
        op = tensor.op
        if (op.name, divided) in seen:
            continue
        seen.add((op.name, divided))
        kind = _REDUCTIONS.get(op.type)
        if kind and _reduces_rows(op, rows):
            kinds.add("divided" if kind == "mean" and divided else kind)
            continue
        if op.type in _LEAVES:
            continue
        divided = divided or _divides_by(op, replicas)
        stack.extend((tensor, divided) for tensor in op.inputs)
    if kinds == {"mean"}:
        return "mean"
    if "mean" in kinds:
        return "mixed" if kinds & {"keras", "divided"} else "mean and sum"
    return "keras" if "keras" in kinds else "sum" if kinds else "unknown"


def _divides_by(op: Any, replicas: int) -> bool:
    """Whether ``op`` divides by ``replicas`` (or multiplies by its inverse), a constant."""
    import tensorflow as tf

    if op.type in ("RealDiv", "Div", "DivNoNan", "FloorDiv"):
        factors = [(op.inputs[1], float(replicas))]
    elif op.type == "Mul":
        factors = [(operand, 1.0 / replicas) for operand in op.inputs]
    else:
        return False
    for operand, wanted in factors:
        value = tf.get_static_value(operand)
        if value is not None and getattr(value, "size", 1) == 1 and abs(
                float(value.reshape(-1)[0] if hasattr(value, "reshape") else value)
                - wanted) < 1e-6 * wanted:
            return True
    return False


def _reduces_rows(op: Any, rows: Any) -> bool:
    """Whether a ``Mean``/``Sum`` op reduces the first axis of a batched tensor (its first
    dimension unknown in the trace, or the replica's rows)."""
    import tensorflow as tf

    values = op.inputs[0]
    rank = values.shape.rank
    if not rank:
        return False
    axes = tf.get_static_value(op.inputs[1])
    if axes is None:
        return False
    axes = {int(a) % rank for a in (axes.reshape(-1) if hasattr(axes, "reshape") else [axes])}
    if 0 not in axes:
        return False
    first = values.shape[0]
    return first is None or (rows is not None and first == rows)


def _result_noted(original: Any) -> Any:
    @functools.wraps(original)
    def result(self: Any) -> Any:
        value = original(self)
        noted = getattr(_local, "results", None)
        if noted is not None and hasattr(value, "ref"):
            noted[value.ref()] = self  # this step's logged means, by the metric that made them
        return value

    return result


def _weighted_by_rows(outputs: dict[str, Any], results: dict[Any, Any]) -> dict[str, Any]:
    """A step's logs, each mean metric's result weighted by the rows that metric counted on
    this replica (one all-reduce of the counts): Keras averages the replicas' logged values
    with equal weights, which is the global mean only while every replica has counted as many
    rows. A value the step computed itself (not a mean metric's result) is left as it is."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    counted = {key: results[value.ref()] for key, value in outputs.items()
               if hasattr(value, "ref") and value.ref() in results}
    if context is None or not counted:
        return outputs
    keys = list(counted)
    local = tf.stack([tf.cast(counted[key].count, tf.float32) for key in keys])
    weights = tf.math.divide_no_nan(local * context.num_replicas_in_sync,
                                    context.all_reduce("sum", local))
    weighted = dict(outputs)
    for index, key in enumerate(keys):
        weighted[key] = outputs[key] * tf.cast(weights[index], outputs[key].dtype)
    return weighted


def install_keras2_loss_objects(where: Where, dist: Any) -> None:
    """Patch ``keras2-loss-objects``'s installer (tf_keras under MWMS on several workers or
    MirroredStrategy; once)."""
    from tfdist.keras.versions import keras2_module

    global _keras2_installed
    losses = keras2_module("losses")
    _keras2_installed = True
    patches.apply("keras2-loss-objects", losses.Loss, "__call__", _keras2_scaled)
    patches.apply("keras2-loss-objects", losses.Loss, "_get_reduction", _keras2_allowed)
    patches.apply("keras2-loss-objects", keras2_module("metrics.base_metric").Reduce,
                  "update_state", _metric_unscaled)
    import tensorflow as tf

    patches.apply("keras2-loss-objects", tf.GradientTape, "gradient", _hand_reduced_scaled)


def _keras2_refuses(loss: Any) -> bool:
    """Whether tf_keras's ``Loss._get_reduction`` refuses ``loss`` here: a mean over the batch
    (the default reduction) outside ``compile``'s container, under a strategy."""
    import tensorflow as tf

    reduction = str(getattr(loss, "reduction", ""))
    return (not getattr(loss, "_allow_sum_over_batch_size", True)
            and reduction in ("auto", "sum_over_batch_size")
            and tf.distribute.has_strategy())


def _keras2_allowed(original: Any) -> Any:
    @functools.wraps(original)
    def _get_reduction(self: Any) -> Any:
        if getattr(_local, "keras2_mean", False):
            return "sum_over_batch_size"
        return original(self)

    return _get_reduction


def _keras2_scaled(original: Any) -> Any:
    @functools.wraps(original)
    def call(self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        if not _keras2_refuses(self):
            return original(self, y_true, y_pred, sample_weight)
        import tensorflow as tf

        before, _local.keras2_mean = getattr(_local, "keras2_mean", False), True
        try:
            mean = original(self, y_true, y_pred, sample_weight)
        finally:
            _local.keras2_mean = before
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync < 2:  # cross-replica, or one
            return mean
        scaled = mean * tf.cast(1.0 / context.num_replicas_in_sync, mean.dtype)
        if not tf.executing_eagerly():
            _keras2_note(scaled, mean)
        return scaled

    return call


def _keras2_note(scaled: Any, mean: Any) -> None:
    """Remembers ``scaled`` -> ``mean`` for the graph being traced (a tracker's update there
    reads the mean); a loss traced in another graph starts afresh, so at most one graph's
    tensors stay held."""
    graph = getattr(scaled, "graph", None)
    with _keras2_lock:
        if _keras2_made["graph"] is not graph:
            _keras2_made["graph"], _keras2_made["made"] = graph, {}
        _keras2_made["made"][scaled.ref()] = mean
