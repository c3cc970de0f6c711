"""Keras 3's random draws over a batch made one process's on several replicas.

A Keras random draw whose first dimension is the batch (Dropout's mask, GaussianNoise, a
random augmentation layer's per-image draw, a VAE's ``keras.random.normal((batch, dim))``)
is made by each replica for its own rows. Every replica draws with the same seed, so each
takes the first rows of what one process would draw for the global batch: replica 1's rows get
replica 0's mask. Measured on 2 MWMS workers against one process (tests/corpus): the weights
differ from the first step (1 % of a kernel's scale after one Dropout step).

Each replica here draws the global batch's values with the seed one process uses and keeps its
own rows (replica ``r`` of ``N``, ``b`` rows each: rows ``r*b`` to ``(r+1)*b``, the rows
``dist.shard`` gives it; in ``fit``'s training step the rows every replica has, counted once a
step (:func:`tfdist.keras.loss_scaling.replica_rows`), so a batch that does not divide is
placed right too: 37 rows on 2 replicas, rows 0-18 and 19-36, where ``r*b`` put the second's
at 18 and a GAN's noise and Dropout masks on 2 MWMS workers ended 1 % of a kernel off one
process): the draw one process makes, N times the values to draw. Keras's
stateless draws (its TensorFlow backend's ``normal``, ``uniform``, ``truncated_normal``,
``dropout``) are redone here with the same TensorFlow ops and seeds, so the values are one
process's bit for bit. A draw counts as over the batch when its first dimension is the
replica's number of rows (for dropout: a noise shape that does not broadcast over the batch).

Where it does not act: more than :data:`MAX_REPLICAS` replicas (the draw grows with them; the
draws stay each replica's own, and one warning says so), several replicas per worker (the rows'
order over a worker's devices is not the replica order), a batch that does not divide outside
``fit``'s training step (Horovod's ranks; evaluate), TensorFlow's own ``tf.random`` ops in a
step (each replica's own, their seeds from the graph: one warning names the fix) and tf_keras's
generators (``tfdist verify`` measures them).

Installed (patch ``keras3-global-draws``) on Keras 3 under MWMS over several workers,
MirroredStrategy and Horovod over several ranks (a rank's rows are its part of the batch, as
``dist.shard`` and ``fit``'s arrays split it).

tf_keras (Keras 2) draws the same way, each replica or rank for its own rows with the seeds of
its own graph (Dropout's mask, a VAE's ``tf.random.normal`` sample, a GAN's noise): measured
on 2 MWMS workers against one process (tests/corpus, the DCGAN), a kernel 0.26 % of its scale
off after the first step, growing from there. Its generators are left as they are (patch
``keras2-told-draws``): the first draw traced in ``fit``'s training step on several replicas
or ranks gets one warning on the chief, with that size and the fix (Keras 3, where tfdist
draws them for the global batch).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras import loss_scaling
from tfdist.keras.versions import trainer_class

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["MAX_REPLICAS", "global_seed_generator", "install_global_draws",
           "install_keras2_told_draws"]

logger = logging.getLogger("tfdist")
# Up to this many replicas each draws the global batch's values (N times its own).
MAX_REPLICAS = 8
_local = threading.local()  # .rows: (dynamic rows tensor, static rows or None) of the step traced
_warned: set[str] = set()
_ranks: list[int] = []  # Horovod: [world size, rank]; empty under tf.distribute
# Keras 3's global seed generator every replica's thread draws from, and whether the main
# thread made it: [generator, bool], or empty.
_shared: list[Any] = []
_KEY = "global_seed_generator"  # Keras's global state's name for it (GLOBAL_SEED_GENERATOR)


def install_global_draws(where: Where, dist: Any) -> None:
    """Patch ``keras3-global-draws``'s installer (Keras 3, MWMS or MirroredStrategy; once)."""
    from keras.src.backend.tensorflow import random as backend_random

    if where.backend.horovod:  # one replica per rank, its rows the rank's part of the batch
        _ranks[:] = [int(dist.world_size), int(dist.rank)]

    patches.apply("keras3-global-draws", trainer_class(), "_make_function",
                  _with_rows)
    for name in ("normal", "uniform", "truncated_normal"):
        patches.apply("keras3-global-draws", backend_random, name,
                      functools.partial(_global_draw, name=name))
    patches.apply("keras3-global-draws", backend_random, "dropout", _global_dropout)
    patches.apply("keras3-global-draws", _seed_module(), "global_seed_generator",
                  _one_per_process)
    import tensorflow as tf

    for name in ("normal", "uniform", "truncated_normal"):  # TensorFlow's own: told, kept
        patches.apply("keras3-global-draws", tf.random, name, _told_per_replica)


def _one_per_process(original: Any) -> Any:
    """Keras keeps its global seed generator (``keras.random.normal(shape)`` without a seed
    draws from it) per thread, and a tf.distribute strategy traces each replica's step in a
    thread of its own: every trace made another, and tf.function refused the second ("only
    supports singleton tf.Variables created on the first call"; a GAN's noise drawn without a
    seed, on 2 MWMS workers). The replicas' threads share one: the main thread's, or the one
    the first of them made, which the main thread then takes as its own (as one process, where
    the step is traced in the main thread). ``keras.utils.set_random_seed`` still makes the
    main thread's anew."""
    @functools.wraps(original)
    def global_seed_generator() -> Any:
        if threading.current_thread() is not threading.main_thread():
            if not _shared:
                _shared[:] = [original(), False]
            return _shared[0]
        from keras.src.backend.common import global_state

        if global_state.get_global_attribute(_KEY) is None and _shared and not _shared[1]:
            global_state.set_global_attribute(_KEY, _shared[0])  # the replicas' own
        found = original()
        if not _shared or found is not _shared[0]:
            _shared[:] = [found, True]
        return found

    return global_seed_generator


def _seed_module() -> Any:
    from keras.src.random import seed_generator

    return seed_generator


def global_seed_generator(create: bool = False) -> Any:
    """Keras 3's global seed generator (what ``keras.random.normal(shape)`` without a seed
    draws from; no model holds it): the one the training step draws from, made here where
    ``create``. None without Keras 3, or where none is made yet and not ``create``."""
    import sys

    if _shared:
        return _shared[0]
    if "keras.src.random.seed_generator" not in sys.modules:
        return None
    from keras.src.backend.common import global_state

    found = global_state.get_global_attribute(_KEY)
    return _seed_module().global_seed_generator() if found is None and create else found


def _told_per_replica(original: Any) -> Any:
    """``tf.random``'s stateful draws in a step: each replica draws its own (their seeds come
    from the graph, not a state one process shares); one warning names the fix."""
    @functools.wraps(original)
    def draw(shape: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "rows", None) is not None and "tf.random" not in _warned:
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            several = _ranks or (context is not None and context.num_replicas_in_sync > 1)
            chief = (_ranks[1] == 0) if _ranks else (
                tf.distribute.get_strategy().extended.should_checkpoint)
            if several and chief:
                _warned.add("tf.random")
                logger.warning(
                    "tfdist: tf.random.%s in a training step draws each replica's own values "
                    "(its seed comes from the graph), one process one set for the whole batch: "
                    "the numbers differ from one process's. For one process's draws: "
                    "keras.random.%s(shape, seed=a keras.random.SeedGenerator), which tfdist "
                    "draws for the global batch", original.__name__.replace("random_", ""),
                    original.__name__.replace("random_", ""))
        return original(shape, *args, **kwargs)

    return draw


def _with_rows(original: Any) -> Any:
    @functools.wraps(original)
    def _make_function(self: Any, step_function: Any) -> Any:
        @functools.wraps(step_function)
        def step(data: Any) -> Any:
            import tensorflow as tf

            leaves = [t for t in tf.nest.flatten(data) if hasattr(t, "shape") and t.shape.rank]
            previous = getattr(_local, "rows", None)
            _local.rows = (tf.shape(leaves[0])[0], leaves[0].shape[0]) if leaves else None
            try:
                return step_function(data)
            finally:
                _local.rows = previous

        return original(self, step)

    return _make_function


def _plan(first: Any) -> tuple[int, Any, Any, Any] | None:
    """``(replicas, this replica's index, its rows, when)`` for a draw whose first dimension is
    ``first``, made here for the global batch: ``when`` is None where ``first`` is the
    replica's rows for sure, else a boolean tensor (a first dimension known only when the step
    runs: the draw is the global one where it equals the rows). None: a draw of its own."""
    import tensorflow as tf

    rows = getattr(_local, "rows", None)
    if rows is None:
        return None
    if _ranks:
        replicas, index = _ranks
    else:
        context = tf.distribute.get_replica_context()
        if context is None or tf.distribute.in_cross_replica_context():
            return None
        replicas, index = context.num_replicas_in_sync, context.replica_id_in_sync_group
        if not _one_replica_per_worker():
            return None
    if replicas < 2:
        return None
    dynamic, static = rows
    when = None
    known = first if isinstance(first, int) else tf.get_static_value(first)
    if known is not None:
        if static is None:
            when = tf.equal(dynamic, int(known))
        elif int(known) != static:
            return None
    elif first is not dynamic:
        when = tf.equal(tf.cast(first, dynamic.dtype), dynamic)
    if replicas > MAX_REPLICAS:
        _warn_once(replicas)
        return None
    return replicas, index, dynamic, when


def _drawn(plan: tuple[int, Any, Any, Any], make: Any, shape: Any) -> Any:
    """The replica's rows of ``make(global shape)``, or ``make(shape)`` where the plan's
    condition says the draw is not over the batch."""
    import tensorflow as tf

    replicas, index, rows, when = plan
    counts = None if _ranks else loss_scaling.replica_rows()
    if counts is None:  # an even split assumed (Horovod; fit's step without the rows counted)
        start, total = index * rows, rows * replicas
    else:  # a batch that does not divide (37 rows on 2: 19 and 18): where this replica's lie
        counts = tf.cast(counts, rows.dtype)
        start, total = tf.reduce_sum(counts[:index]), tf.reduce_sum(counts)
    if isinstance(shape, tf.Tensor):
        global_shape = tf.concat([[total], tf.cast(shape[1:], rows.dtype)], 0)
    else:
        global_shape = [total, *shape[1:]]

    def whole() -> Any:
        return make(global_shape)[start:start + rows]

    if when is None:
        return whole()
    return tf.cond(when, whole, lambda: make(shape))


def _one_replica_per_worker() -> bool:
    import tensorflow as tf

    extended = tf.distribute.get_strategy().extended
    return len(getattr(extended, "worker_devices", ())) <= 1 or not getattr(
        extended, "_in_multi_worker_mode", lambda: False)()


def _warn_once(replicas: int) -> None:
    import tensorflow as tf

    if "many" in _warned or not tf.distribute.get_strategy().extended.should_checkpoint:
        return
    _warned.add("many")
    logger.warning("tfdist: %d replicas: Keras's random draws over the batch (Dropout, noise, "
                   "random augmentation) stay each replica's own for its rows (one process "
                   "draws one set for the global batch); `tfdist verify` measures the "
                   "difference", replicas)


def _seed(seed: Any) -> Any:
    from keras.src.backend.tensorflow.random import _cast_seed
    from keras.src.random.seed_generator import draw_seed

    return _cast_seed(draw_seed(seed))


def _global_draw(original: Any, name: str) -> Any:
    @functools.wraps(original)
    def draw(shape: Any, *args: Any, **kwargs: Any) -> Any:
        plan = _plan(shape[0]) if isinstance(shape, (list, tuple)) and shape else None
        if plan is None:
            return original(shape, *args, **kwargs)
        import inspect

        import tensorflow as tf
        from keras.src.backend.config import floatx

        bound = inspect.signature(original).bind(shape, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        dtype = options["dtype"] or floatx()
        seed = _seed(options["seed"])  # drawn once: the seed generator moves once

        def make(size: Any) -> Any:
            if name == "uniform":
                return tf.random.stateless_uniform(
                    shape=size, minval=tf.cast(options["minval"], dtype),
                    maxval=tf.cast(options["maxval"], dtype), dtype=dtype, seed=seed)
            op = (tf.random.stateless_normal if name == "normal"
                  else tf.random.stateless_truncated_normal)
            return op(shape=size, mean=options["mean"], stddev=options["stddev"], dtype=dtype,
                      seed=seed)

        return _drawn(plan, make, list(shape))

    return draw


def _global_dropout(original: Any) -> Any:
    @functools.wraps(original)
    def dropout(inputs: Any, rate: Any, noise_shape: Any = None, seed: Any = None) -> Any:
        import tensorflow as tf

        if rate in (0.0, 1.0) or (noise_shape is not None and noise_shape[0] is not None):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        from keras.src.backend.tensorflow.random import _get_concrete_noise_shape

        rows = getattr(_local, "rows", None)
        first = inputs.shape[0] if inputs.shape[0] is not None else (rows[0] if rows else None)
        plan = _plan(first) if first is not None else None
        if plan is None:
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        concrete = _get_concrete_noise_shape(inputs, noise_shape)
        seed_value = _seed(seed)

        def sampler(shape: Any, dtype: Any) -> Any:
            def make(size: Any) -> Any:
                return tf.random.stateless_uniform(shape=size, dtype=dtype, seed=seed_value)

            return _drawn(plan, make, shape)

        return tf.nn.experimental.general_dropout(inputs, rate=rate, uniform_sampler=sampler,
                                                  noise_shape=concrete)

    return dropout


def install_keras2_told_draws(where: Where, dist: Any) -> None:
    """Patch ``keras2-told-draws``'s installer (tf_keras on several processes, or
    MirroredStrategy; once)."""
    import tensorflow as tf

    from tfdist.keras.versions import keras2_module

    if where.backend.horovod:
        _ranks[:] = [int(dist.world_size), int(dist.rank)]
    generator = keras2_module("backend").RandomGenerator
    for name in ("random_normal", "random_uniform", "truncated_normal", "dropout"):
        patches.apply("keras2-told-draws", generator, name,
                      functools.partial(_keras2_told, what=name))
    for name in ("normal", "uniform", "truncated_normal"):
        patches.apply("keras2-told-draws", tf.random, name,
                      functools.partial(_keras2_told, what=f"tf.random.{name}"))


def _keras2_told(original: Any, what: str) -> Any:
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        if "keras2" not in _warned and _in_keras2_training_step():
            _warned.add("keras2")
            logger.warning(
                "tfdist: %s in a training step (tf_keras) draws each replica's own values for "
                "its rows, with its own graph's seeds; one process draws one set for the whole "
                "batch: the weights differ from one process's from the first step (measured: "
                "a DCGAN's kernel 0.26 %% of its scale after one step on 2 workers). For one "
                "process's draws: Keras 3 (TF_USE_LEGACY_KERAS unset), where tfdist draws them "
                "for the global batch", "Dropout" if what == "dropout" else what)
        return original(*args, **kwargs)

    return draw


def _in_keras2_training_step() -> bool:
    """Whether the chief is tracing tf_keras ``fit``'s train function on several replicas or
    ranks (its graph, or a loop's graph inside it)."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return False
    if _ranks:
        several, chief = _ranks[0] > 1, _ranks[1] == 0
    else:
        context = tf.distribute.get_replica_context()
        several = context is not None and context.num_replicas_in_sync > 1
        chief = several and tf.distribute.get_strategy().extended.should_checkpoint
    graph = tf.compat.v1.get_default_graph()
    while several and chief and graph is not None:
        if getattr(graph, "name", "").startswith("train_function"):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False
