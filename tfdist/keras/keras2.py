"""Keras 2's repairs (TensorFlow 2.11 to 2.15, tf_keras) and every Keras's random states.

The eager record TensorFlow <= 2.14 loses when imported inside absl's ``app.run``
(:func:`repair_eager_record`, patch ``eager-record``), Keras 2's random layers made to draw from
a ``tf.random.Generator`` whose state a preempted run saves (:func:`keras2_random_generator`),
and the variables of a model's random generators that its weights leave out
(:func:`random_states`, Keras 3's seed generators too).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from tfdist import patches
from tfdist.keras.versions import keras2_module, keras2_package

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["eager_record_lost", "install_eager_record", "keras2_random_generator",
           "random_states", "repair_eager_record"]

logger = logging.getLogger("tfdist")


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
    if not eager_record_lost():
        return False
    from tensorflow.python.eager import context

    patches.apply("eager-record", context.context(), "_context_switches",
                  lambda lost: type(lost)(True))
    logger.debug("tfdist: TensorFlow's eager context was created before eager execution was "
                 "on (TensorFlow <= 2.14 imported inside absl's app.run): repaired")
    return True


def eager_record_lost() -> bool:
    """Whether TensorFlow, imported, is eager and its eager context's record of context
    switches lacks its first, eager entry (see :func:`repair_eager_record`)."""
    if "tensorflow" not in sys.modules:  # not started: nothing lost (and nothing to import)
        return False
    from tensorflow.python.eager import context

    eager_context = context.context()
    record = getattr(eager_context, "_context_switches", None)
    return record is not None and not record.stack and eager_context.executing_eagerly()


def install_eager_record(where: Where, dist: Any) -> None:
    """Patch ``eager-record``'s installer (:func:`tfdist.patches.install`)."""
    repair_eager_record()


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
