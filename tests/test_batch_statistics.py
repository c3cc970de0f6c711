"""Which BatchNormalization statistics tfdist averages over the replicas
(tfdist/keras/batch_statistics.py), on a subclassed model before and after its first batch:
its layers exist from ``__init__``, their variables only from the first batch, which ``fit``
runs after tfdist decided whether to average them (tf_keras under Horovod failed there with
``'BatchNormalization' object has no attribute 'moving_mean'``; tests/corpus's
``subclassed_batchnorm``)."""

from __future__ import annotations

import numpy as np
import pytest


def test_a_subclassed_models_batch_norm_counts_before_its_first_batch_builds_it() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = tf.keras
    from tfdist.keras import batch_statistics as statistics

    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.BatchNormalization()
            self.synced = keras.layers.BatchNormalization(synchronized=True)

        def call(self, inputs, training=None):  # type: ignore[no-untyped-def]
            return self.synced(self.norm(self.dense(inputs), training=training),
                               training=training)

    model = Subclassed()
    assert statistics.has_batch_statistics(model)
    assert statistics.batch_statistics(model) == []  # nothing built to average yet
    model(np.zeros((2, 3), "float32"))
    averaged = statistics.batch_statistics(model)
    assert len(averaged) == 2  # the synchronized layer's are one over the replicas already
    assert averaged[0] is model.norm.moving_mean and averaged[1] is model.norm.moving_variance
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert not statistics.has_batch_statistics(plain)


def _made_in(module: str) -> object:
    return type("Callback", (), {"__module__": module})()


@pytest.mark.parametrize(("modules", "planned"), [
    ((), False),
    (("keras.src.callbacks.early_stopping",), False),
    (("tfdist.keras.callbacks",), True),  # dist.callbacks(): its average_batch_statistics=
    (("tfdist.verify.record",), False),  # tfdist verify's recorder only watches
    (("tfdist.verify.record", "tfdist.keras.callbacks"), True),
])
def test_only_dist_callbacks_decide_the_batch_statistics_of_a_fit(modules, planned) -> None:
    from tfdist.keras.writers import planned_by_tfdist

    assert planned_by_tfdist([_made_in(module) for module in modules]) is planned
