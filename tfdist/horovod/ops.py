"""Gradient averaging, broadcast and metric averaging on Horovod's core collective ops.

These work with Keras 3 variables, tf_keras variables and plain ``tf.Variable``: they read
values with ``tf.convert_to_tensor`` and write with ``assign``. horovod.tensorflow's own helpers
(``DistributedGradientTape``, ``broadcast_variables``) call ``.ref()`` on the variables, which
Keras 3's do not have. Imported only once TensorFlow and Horovod are initialised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

__all__ = ["DistributedGradientTape", "allreduce_gradients", "average_logs",
           "broadcast_variables", "reduce"]

OPS = {"average": hvd.Average, "mean": hvd.Average, "sum": hvd.Sum}
# Horovod reduces these dtypes; other integers (uint32 seed states...) go through int64.
_BROADCAST_DTYPES = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
                     tf.bfloat16, tf.float32, tf.float64, tf.bool)


def _op(op: str) -> Any:
    try:
        return OPS[op.lower()]
    except KeyError:
        from tfdist.errors import ConfigError

        raise ConfigError(f"reduction {op!r} is not one of {sorted(OPS)}") from None


def allreduce_gradients(grads: Sequence[Any], op: str = "average",
                        compression: str | None = None) -> list[Any]:
    """Reduces ``grads`` across all ranks in one grouped all-reduce; ``None`` stays ``None``.

    Sparse gradients (``tf.IndexedSlices``, from embeddings) stay sparse: every rank's slices
    gathered (values divided by the ranks for ``"average"``), so the optimizer gets the slices
    one process gets for the global batch. Made dense first, their repeated rows were summed
    before the optimizer saw them: Adam and RMSprop square each slice of a sparse gradient
    (Keras sums the squares of a row looked up twice), so a dense sum trained other weights
    than one process (measured: 0.22 on an embedding with Adam).
    ``compression="fp16"`` sends float32 gradients as float16 (Horovod's
    ``Compression.fp16``: half the bytes, coarser sums) and returns them as float32.
    """
    if hvd.size() == 1:
        return list(grads)
    dense = list(grads)
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            dense[i] = hvd.allreduce(g, op=_op(op))
    present = [i for i, g in enumerate(dense)
               if g is not None and not isinstance(g, tf.IndexedSlices)]
    if not present:
        return list(dense)
    sent = [dense[i] for i in present]
    if compression == "fp16":
        sent = [tf.cast(g, tf.float16) if g.dtype == tf.float32 else g for g in sent]
    reduced = hvd.grouped_allreduce(sent, op=_op(op))
    result = list(dense)
    # No strict=: this runs in the caller's tf.function, and TensorFlow 2.12's autograph zip
    # takes none.
    for i, value in zip(present, reduced):  # noqa: B905
        result[i] = tf.cast(value, dense[i].dtype) if value.dtype != dense[i].dtype else value
    return result


def reduce(value: Any, op: str = "sum") -> Any:
    """All-reduces one tensor (or a nest of tensors) across ranks."""
    return tf.nest.map_structure(lambda v: hvd.allreduce(tf.convert_to_tensor(v), op=_op(op)),
                                 value)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients reduced across ranks.

    Unlike ``hvd.DistributedGradientTape`` it works with Keras 3 variables.

    Args:
        tape: the tape to wrap (a new ``tf.GradientTape()`` when None).
        op: ``"average"`` (Horovod's convention: each rank's loss is the mean over its own
            batch) or ``"sum"`` (tf.distribute's: the loss is divided by the GLOBAL batch size,
            as ``tf.nn.compute_average_loss`` does). ``Distributed.gradient_tape()`` uses
            ``"sum"`` so that the same loop runs under MultiWorkerMirroredStrategy.
        compression: ``"fp16"`` to all-reduce float32 gradients as float16, or None.
    """

    def __init__(self, tape: Any = None, op: str = "average",
                 compression: str | None = None) -> None:
        self._tape = tf.GradientTape() if tape is None else tape
        self._op, self._compression = op, compression
        _op(op)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        """``tf.GradientTape.gradient``, then one grouped all-reduce of the result."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, allreduce_gradients(flat, self._op,
                                                                   self._compression))

    def __getattr__(self, name: str) -> Any:  # watch(), stop_recording(), ...
        return getattr(self._tape, name)


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> None:
    """Sets every variable to its value on ``root_rank``.

    Runs as one ``tf.function`` so that Horovod batches the broadcasts.
    """
    variables = _unique(variables)
    if hvd.size() == 1 or not variables:
        return
    values = [tf.convert_to_tensor(v) for v in variables]
    for variable, value in zip(variables, _broadcast(values, root_rank), strict=True):
        variable.assign(value)


def _broadcast(values: list[Any], root_rank: int) -> list[Any]:
    @tf.function(autograph=False)
    def run(tensors: list[Any]) -> list[Any]:
        out = []
        for i, tensor in enumerate(tensors):
            wire = tensor if tensor.dtype in _BROADCAST_DTYPES else tf.cast(tensor, tf.int64)
            sent = hvd.broadcast(wire, root_rank, name=f"tfdist_broadcast_{i}")
            out.append(tf.cast(sent, tensor.dtype))
        return out

    return run(values)


def _unique(variables: Iterable[Any]) -> list[Any]:
    # Keras 3 lists a shared variable once per user; identity (not .ref()) dedupes both kinds.
    seen: set[int] = set()
    result = []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def average_logs(logs: dict[str, Any] | None, name: str) -> None:
    """Averages the numbers in a Keras ``logs`` dict across ranks, in place."""
    if not logs or hvd.size() == 1:
        return
    keys = sorted(k for k, v in logs.items() if _is_number(v))
    if not keys:
        return
    values = tf.constant([float(logs[k]) for k in keys], tf.float64)
    averaged = hvd.allreduce(values, op=hvd.Average, name=name).numpy()
    for key, value in zip(keys, averaged, strict=True):
        logs[key] = float(value)


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return getattr(value, "shape", ()) in ((), None) or getattr(value, "ndim", 0) == 0
