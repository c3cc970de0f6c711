"""The optimizers a Keras model holds, recorded at a save and built the same way before a resume
(tfdist/keras/optimizers.py), on real Keras optimizers in this process: a GAN's own two (built
at their first apply_gradients, over one network's weights each) beside the RMSprop its
``compile`` leaves unused, a state saved before there was a record, and the models that cannot
be built as saved, each named.
"""

from __future__ import annotations

import numpy as np
import pytest

from tfdist.keras import optimizers

keras = pytest.importorskip("keras")


class _GAN(keras.Model):
    """A GAN's shape: two networks, no call(), an optimizer each as an attribute."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        self.discriminator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer


def _gan(trained: bool) -> _GAN:
    gan = _GAN()
    gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.1, momentum=0.9))
    if trained:  # one step each, as the GAN's train_step applies them
        for optimizer, network in ((gan.d_optimizer, gan.discriminator),
                                   (gan.g_optimizer, gan.generator)):
            weights = network.trainable_weights
            optimizer.apply_gradients([(np.ones(w.shape, "float32"), w) for w in weights])
    return gan


def _shapes(optimizer) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in optimizers.variables(optimizer)]


def test_a_gans_optimizers_are_found_once_each_compiles_own_first():
    gan = _gan(trained=False)
    gan.same_again = gan.d_optimizer  # held twice: once in the list
    assert optimizers.optimizers(gan) == [gan.optimizer, gan.d_optimizer, gan.g_optimizer]
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.compile("adam", "mse")
    assert optimizers.optimizers(plain) == [plain.optimizer]
    assert optimizers.optimizers(keras.Sequential()) == []  # not compiled


def test_a_gans_optimizers_are_built_as_saved_over_the_same_weights():
    saved = _gan(trained=True)
    record = optimizers.record(saved)
    # compile's RMSprop was never applied; each of the two trains one network's weights.
    weights = [id(w) for w in saved.weights]
    assert record == [
        {"attribute": "optimizer", "class": "RMSprop", "built": False, "variables": None},
        {"attribute": "d_optimizer", "class": "Adam", "built": True,
         "variables": [weights.index(id(w)) for w in saved.discriminator.trainable_weights]},
        {"attribute": "g_optimizer", "class": "SGD", "built": True,
         "variables": [weights.index(id(w)) for w in saved.generator.trainable_weights]}]
    fresh = _gan(trained=False)
    assert not optimizers.is_built(fresh.d_optimizer)
    assert optimizers.build_as_saved(fresh, record) == []
    for before, after in zip(optimizers.optimizers(saved), optimizers.optimizers(fresh),
                             strict=True):
        assert optimizers.is_built(after) == optimizers.is_built(before)
        assert _shapes(after) == _shapes(before)  # what loading the saved values needs
    assert optimizers.build_as_saved(fresh, record) == []  # built already: left alone


def test_a_state_saved_before_the_record_builds_the_models_optimizer_as_the_first_step_would():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(), "mse")
    assert optimizers.build_as_saved(model, None) == []
    assert optimizers.is_built(model.optimizer)
    assert _shapes(model.optimizer)[-4:] == [(2, 3), (2, 3), (3,), (3,)]  # the slots


BUILD_PROBLEMS = {
    # name: (how the saved state's record differs from this model, the problem named)
    "another number of optimizers": (
        lambda record: record[:2], "the saved state has 2 optimizer(s), this model 3"),
    "variables the model does not hold": (
        lambda record: [record[0], {**record[1], "variables": None}, record[2]],
        "d_optimizer (Adam) trained variables the model does not hold"),
    "a position past the model's weights": (
        lambda record: [record[0], {**record[1], "variables": [0, 99]}, record[2]],
        "d_optimizer (Adam) trained variables the model does not hold"),
}


@pytest.mark.parametrize("case", sorted(BUILD_PROBLEMS))
def test_a_model_that_cannot_be_built_as_saved_is_named(case):
    change, problem = BUILD_PROBLEMS[case]
    record = change(optimizers.record(_gan(trained=True)))
    fresh = _gan(trained=False)
    assert optimizers.build_as_saved(fresh, record) == [problem]
    assert not optimizers.is_built(fresh.d_optimizer)


def test_an_optimizer_over_a_variable_outside_the_model_is_recorded_as_not_known():
    gan = _gan(trained=True)
    outside = keras.Variable(np.zeros(2, "float32"))
    extra = keras.optimizers.Adam()
    extra.apply_gradients([(np.ones(2, "float32"), outside)])
    gan.extra_optimizer = extra
    held = optimizers.optimizers(gan)
    record = optimizers.record(gan)
    assert held.index(extra) == 2  # the attributes by name: d_, extra_, g_optimizer
    assert [entry["variables"] is None for entry in record] == [True, False, True, False]


def test_a_tf_keras_optimizer_is_built_when_it_has_indexed_its_variables():
    # tf_keras's optimizers carry no built flag: a resume that took one for built left its
    # slots unmade and Keras skipped their saved values (2 MWMS workers, other weights).
    tf_keras = pytest.importorskip("tf_keras")
    import tensorflow as tf

    model = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(3)])
    model.compile(tf_keras.optimizers.Adam(), "mse")
    assert not optimizers.is_built(model.optimizer)
    assert optimizers.record(model)[0]["variables"] is None
    optimizers.build_as_saved(model, [{"attribute": "optimizer", "built": True,
                                       "variables": [1, 0]}])
    assert optimizers.is_built(model.optimizer)
    assert optimizers.trained(model.optimizer, model.weights) == [1, 0]  # as saved
    assert optimizers.trained(model.optimizer, [tf.Variable(1.0)]) is None
    assert optimizers.is_built(tf_keras.optimizers.legacy.Adam())  # builds nothing ahead
