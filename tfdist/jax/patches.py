"""tfdist's patches of Keras 3 on JAX with several processes (rows ``jax-*`` of
:data:`tfdist.patches.INVENTORY`); :func:`tfdist.patches.install` runs their installers.

- :func:`install_rank0_values`: a variable placed eagerly on the devices of several processes takes
  rank 0's value (JAX wants the same value on every process and stops otherwise);
- :func:`install_inputs_by_rank`: ``fit``, ``evaluate`` and ``predict`` on in-memory arrays, a
  ``keras.utils.PyDataset`` or a Python generator read this rank's part of every global batch
  (Keras refuses arrays on several processes, and would read every batch whole on every rank
  from the others: one process's numbers for twice the work);
- :func:`install_predict_every_row`: ``predict``'s batches are gathered from all processes, so it
  returns every row on every rank, as one process does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras import fit_inputs
from tfdist.keras.versions import trainer_class

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["install_inputs_by_rank", "install_predict_every_row", "install_rank0_values"]


def install_rank0_values(where: Where, dist: Any) -> None:
    """Patch ``jax-rank0-values``'s installer: every eager placement of a variable's value over
    several processes takes rank 0's."""
    from jax.experimental import multihost_utils
    from keras.src.backend.jax import core, distribution_lib

    def wrap(original: Any) -> Any:
        def distribute_tensor(tensor: Any, layout: Any) -> Any:
            import jax
            from keras.src.utils import jax_utils

            if jax_utils.is_in_jax_tracing_scope(tensor) or (
                    isinstance(tensor, jax.Array) and not tensor.is_fully_addressable):
                return original(tensor, layout)  # inside a step, or placed already
            return original(multihost_utils.broadcast_one_to_all(tensor), layout)

        return distribute_tensor

    patches.apply("jax-rank0-values", distribution_lib, "distribute_tensor", wrap)
    # A large variable is otherwise made by a jitted initializer on every process, with each
    # process's own seed: its value is made once and placed as above instead.
    patches.apply("jax-rank0-values", core, "should_shard_at_init",
                  lambda original: lambda init_layout, shape: False)


def install_inputs_by_rank(where: Where, dist: Any) -> None:
    """Patch ``jax-inputs-by-rank``'s installer: ``fit``/``evaluate``/``predict`` on arrays:
    one dataset of global batches (``fit``'s shuffled the same way on every rank:
    :func:`tfdist.keras.fit_inputs.arrays_as_dataset`), of which each rank reads its part;
    ``fit``'s ``validation_data`` arrays likewise. A ``PyDataset`` (its batches shuffled in one
    order on every rank: patch ``sequence-one-order``) or a generator: each rank its part of
    every batch; loader processes become threads."""
    import keras

    from tfdist.horovod import sharding as by_rank

    rank, size, is_chief = int(dist.rank), int(dist.world_size), bool(dist.is_chief)
    num_replicas = int(dist.num_replicas)

    def split(arguments: dict[str, Any], *, shuffle: bool) -> None:
        x = arguments.get("x")
        fit_inputs.loader_threads(arguments, is_chief)  # a fork beside JAX's threads can hang
        if fit_inputs.is_sequence(x):  # each rank its part of every batch, in one agreed order
            if is_chief and shuffle and arguments.get("shuffle", True):
                fit_inputs.warn_once(fit_inputs.SEQUENCE_ORDER)
            arguments["x"] = by_rank.sequence_slices(x, rank, size)
        elif fit_inputs.is_generator(x):
            if is_chief:
                fit_inputs.warn_once(GENERATOR)
            arguments["x"] = by_rank.generator_slices(x, rank, size)
        if not fit_inputs.is_arrays(x):
            return
        if is_chief:
            fit_inputs.warn_about_arrays(arguments, num_replicas)
            if shuffle and arguments.get("shuffle", True):
                fit_inputs.warn_once(fit_inputs.ARRAYS_ORDER)
        given = {**arguments, "shuffle": shuffle and arguments.get("shuffle", True)}
        changed = fit_inputs.arrays_as_dataset(given, size)  # validation_split: arrays again
        changed["x"] = by_rank.shard(changed["x"], rank, size)
        arguments.update(changed)

    def wrap_fit(original: Any) -> Any:
        def change(bound: Any) -> None:
            split(bound.arguments, shuffle=True)
            validation = bound.arguments.get("validation_data")
            if isinstance(validation, tuple) and fit_inputs.is_arrays(validation[0]):
                bound.arguments["validation_data"] = _validation(
                    validation, bound.arguments, rank, size)
            elif fit_inputs.is_sequence(validation):
                bound.arguments["validation_data"] = by_rank.sequence_slices(validation, rank,
                                                                             size)
        return patches.rebinding(original, change)

    def wrap_other(original: Any) -> Any:
        return patches.rebinding(original, lambda bound: split(bound.arguments, shuffle=False))

    patches.apply("jax-inputs-by-rank", keras.Model, "fit", wrap_fit)
    patches.apply("jax-inputs-by-rank", keras.Model, "evaluate", wrap_other)
    patches.apply("jax-inputs-by-rank", keras.Model, "predict",
                  lambda original: _predict_padded(original, wrap_other(original)))


def _predict_padded(original: Any, split: Any) -> Any:
    """``predict`` (``split``: the original with its arrays split by rank) on arrays padded to
    whole batches, its outputs cut back to the rows given (:func:`padded`)."""
    import inspect

    signature = inspect.signature(original)

    def predict(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        x = bound.arguments.get("x")
        if not fit_inputs.is_arrays(x):
            return split(self, *args, **kwargs)
        rows = len(jax_tree_leaves(x)[0])
        bound.arguments["x"] = padded(x, rows, int(bound.arguments.get("batch_size") or 32))
        outputs = split(*bound.args, **bound.kwargs)
        return _tree_map(lambda a: a[:rows], outputs)

    return predict


def jax_tree_leaves(x: Any) -> list[Any]:
    import jax

    return list(jax.tree_util.tree_leaves(x))


def _tree_map(function: Any, tree: Any) -> Any:
    import jax

    return jax.tree_util.tree_map(function, tree)


def padded(x: Any, rows: int, batch: int) -> Any:
    """``x``'s arrays with their last row repeated up to a multiple of ``batch`` rows: every
    rank then predicts a part of every batch (a rank left without rows would never join the
    gather of the batch's outputs, and the job would hang); the outputs are cut back."""
    import numpy as np

    extra = (-rows) % batch
    if not extra or rows == 0:
        return x
    return _tree_map(lambda a: np.concatenate([np.asarray(a),
                                               np.repeat(np.asarray(a)[-1:], extra, 0)]), x)


GENERATOR = (
    "fit reads a Python generator on several processes: each runs its own copy, which must "
    "yield the same batches in the same order on every rank (each rank takes its part of every "
    "batch). For one process's numbers without that care, pass a keras.utils.PyDataset (its "
    "order is agreed over the ranks) or a tf.data.Dataset through dist.shard")


def _validation(validation: Any, arguments: dict[str, Any], rank: int, size: int) -> Any:
    """``validation_data`` arrays as this rank's part of batches of ``validation_batch_size``
    (else ``batch_size``, else 32)."""
    import tensorflow as tf

    from tfdist.horovod import sharding as by_rank

    batch = arguments.get("validation_batch_size") or arguments.get("batch_size") or 32
    data = tuple(v for v in validation if v is not None)
    dataset = tf.data.Dataset.from_tensor_slices(data if len(data) > 1 else data[0])
    return by_rank.shard(dataset.batch(batch), rank, size)


def install_predict_every_row(where: Where, dist: Any) -> None:
    """Patch ``jax-predict-every-row``'s installer: ``predict``'s outputs of each batch,
    gathered from every process in rank order."""
    from jax.experimental import multihost_utils

    def gathered(outputs: Any) -> Any:
        import jax

        def one(array: Any) -> Any:
            if isinstance(array, jax.Array) and not array.is_fully_addressable:
                return multihost_utils.process_allgather(array, tiled=True)
            return array

        return jax.tree_util.tree_map(one, outputs)

    def wrap(original: Any) -> Any:
        def make_predict_function(self: Any, force: bool = False) -> Any:
            made = original(self, force)
            step = self.predict_function
            if step is not None and not getattr(step, "_tfdist_gathers", False):
                def every_row(state: Any, iterator: Any) -> Any:
                    outputs, state = step(state, iterator)
                    return gathered(outputs), state

                every_row._tfdist_gathers = True  # type: ignore[attr-defined]
                self.predict_function = every_row
            return made

        return make_predict_function

    patches.apply("jax-predict-every-row", trainer_class("jax"), "make_predict_function", wrap)
