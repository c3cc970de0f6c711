"""``tfdist verify``: does this script compute on N workers what it computes in one process?

- :mod:`tfdist.verify.run` runs a script in one process and on N local workers (the same global
  batch, the same seed), and prints the verdict (the ``tfdist verify`` command);
- :mod:`tfdist.verify.record` is installed in each process of those runs (the ``verify-record``
  patch) and writes down each step's logs and weights, evaluate's and predict's results and the
  final weights;
- :mod:`tfdist.verify.compare` (pure) compares the records and names the first difference, its
  likely cause and the fix.

This module holds the variables ``tfdist verify`` sets for its runs (a protocol, like
``tfdist launch``'s: not user settings). Pure.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["DIR", "REPLICAS", "SEED", "STEPS", "replicas_for_scaling", "seed_once"]

DIR = "TFDIST_VERIFY_DIR"  # where each rank writes its record; set: the run records
STEPS = "TFDIST_VERIFY_STEPS"  # each fit stops after this many steps (0: as the script says)
SEED = "TFDIST_VERIFY_SEED"  # seeds Python, NumPy and the framework when the strategy is made
REPLICAS = "TFDIST_VERIFY_REPLICAS"  # the one-process run's dist.scale_lr scales by these


def replicas_for_scaling(num_replicas: int, environ: Mapping[str, str] | None = None) -> int:
    """The replicas ``dist.scale_lr`` scales by: the compared run's in ``tfdist verify``'s
    one-process run (the same learning rate in both runs), else ``num_replicas``."""
    given = (os.environ if environ is None else environ).get(REPLICAS, "")
    return int(given) if given.isdigit() and int(given) > 0 else num_replicas


_seeded: list[int] = []


def seed_once(environ: Mapping[str, str] | None = None) -> int | None:
    """Seeds Python, NumPy and TensorFlow (and Keras 3's own seed, where imported) with
    ``TFDIST_VERIFY_SEED``, once per process, at the earlier of TensorFlow's first op
    (:mod:`tfdist.autostart`) and the strategy's creation (:mod:`tfdist.verify.record`): the
    same point of the script in the one-process run and the workers' run. The seed, or None
    (not a verify run, or seeded already)."""
    given = (os.environ if environ is None else environ).get(SEED, "")
    if _seeded or not given.isdigit():
        return None
    seed = int(given)
    _seeded.append(seed)
    import random
    import sys

    import numpy as np
    import tensorflow as tf

    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "utils"):  # Keras 3: its own global seed too
        keras.utils.set_random_seed(seed)
    return seed
