"""One process: TensorFlow's default strategy, nothing to synchronise.

Chosen by ``auto`` for one plain process that sees at most one device (``auto`` plans
:mod:`tfdist.backends.mirrored`, which hands over here), or on request (``backend="single"``), in
which case this process trains alone even if a launcher started others: it is rank 0 of 1.
"""

from __future__ import annotations

from tfdist.backends.base import Distributed, Settings
from tfdist.env import ClusterEnvironment

__all__ = ["SingleDistributed", "create"]


class SingleDistributed(Distributed):
    """The handle for one process with TensorFlow's default strategy."""

    backend = "single"

    @property
    def rank(self) -> int:  # type: ignore[override]
        return 0

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return 1


def create(environment: ClusterEnvironment, settings: Settings) -> SingleDistributed:
    """The handle; TensorFlow picks its devices as it would without tfdist."""
    from tfdist import quiet

    tf = quiet.import_tensorflow()

    del settings  # one process keeps TensorFlow's own thread defaults, as before tfdist
    return SingleDistributed(environment, tf.distribute.get_strategy(), "none",
                             len(tf.config.list_physical_devices("GPU")))
