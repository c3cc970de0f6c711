"""The parts of tfdist.keras.step_results that need no workers: which metrics are the user's, the
warning for a model whose own step returns values that are not its metrics' results, and the
predict step of a replica with an empty batch. The patches themselves are tested on 2 real
workers against one process (tests/test_keras_traps.py; the empty batch in tests/test_corpus.py's
cell, convnet_mnist's predict on one row)."""

from __future__ import annotations

import pytest


def _metrics():
    import keras

    class Largest(keras.metrics.Metric):
        def __init__(self):  # type: ignore[no-untyped-def]
            super().__init__(name="largest")
            self.largest = self.add_weight(name="largest", shape=(), initializer="zeros")

        def update_state(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

        def result(self):  # type: ignore[no-untyped-def]
            return self.largest

    class Stateless(keras.metrics.Metric):
        def update_state(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            pass

        def result(self):  # type: ignore[no-untyped-def]
            return 0.0

    class Holder:  # Keras's compiled-metrics container holds the user's in `metrics`
        def __init__(self, metrics):  # type: ignore[no-untyped-def]
            self.metrics = metrics

    largest = Largest()
    return {
        "Keras's own": ([keras.metrics.AUC(), keras.metrics.Mean()], []),
        "yours": ([keras.metrics.AUC(), largest], ["largest"]),
        "yours, in a container, twice": ([Holder([largest]), largest], ["largest"]),
        "yours without a state": ([Stateless(name="none")], []),
        "none": (None, []),
    }


@pytest.mark.parametrize("case", ["Keras's own", "yours", "yours, in a container, twice",
                                  "yours without a state", "none"])
def test_the_users_metrics_with_a_state_are_found(case):
    from tfdist.keras.step_results import own_metrics

    metrics, names = _metrics()[case]
    assert [m.name for m in own_metrics(metrics)] == names


@pytest.mark.parametrize(("keras3", "says"), [
    (True, "Keras averages them over the replicas each step and logs the last step's: one "
           "process's for a mean over the batch's rows (a Keras loss's value too: tfdist logs "
           "it unscaled), not for a sum, a maximum or a count."),
    (False, "Keras sums them over the replicas each step and logs the last step's. A loss "
            "from compute_loss is divided by the number of replicas under tf.distribute, any "
            "other value is not, so any other value reads replicas times one process's."),
])
def test_a_custom_steps_own_values_are_explained_with_the_fix(keras3, says):
    from tfdist.keras.step_results import own_step_line

    line = own_step_line("Net", "train_step", keras3)
    assert line.startswith("Net's own train_step returns values that are not its metrics' "
                           f"results: {says}"), line
    assert line.endswith("return their results ({m.name: m.result() for m in self.metrics}): "
                         "Keras reads those over all workers")


def test_per_rank_writer_paths_are_found_by_a_float32_sum():
    """tfdist.keras.writers.per_rank_writers on two ranks, their sum taken in float32 as the
    backends take it: the same paths are routed, a path per rank (a tempfile.mkdtemp() each)
    is left to its rank, other numbers of writers route every one."""
    import numpy as np

    from tfdist.keras import writers

    class Writer:
        def __init__(self, path):
            self.filename = path

    def on_two_ranks(per_rank):
        vectors = []

        class Rank:
            world_size = 2

            def sum_over_ranks(self, values):
                vectors.append(np.asarray(values, np.float32))
                return [float(v) for v in np.sum(vectors, axis=0, dtype=np.float32)]

        writers.per_rank_writers(Rank(), per_rank[0])  # rank 0's vector, kept
        return writers.per_rank_writers(Rank(), per_rank[1])  # rank 1's, summed with it

    same = [Writer("/runs/a/log.csv"), Writer("/runs/a/ckpt.keras")]
    assert on_two_ranks([same, same]) == set()
    apart = [[Writer("/tmp/tmpa1/log.csv"), Writer("/runs/a/ckpt.keras")],
             [Writer("/tmp/tmpb2/log.csv"), Writer("/runs/a/ckpt.keras")]]
    assert on_two_ranks(apart) == {0}
    assert on_two_ranks([same, same[:1]]) == set()


def test_a_replicas_empty_predict_batch_runs_on_one_row_of_zeros_and_returns_none():
    # Two convolutions in a graph on an empty batch: TensorFlow 2.21's oneDNN kernels fail
    # ("input depth must be evenly divisible by filter depth: 1 vs 16") on an AVX-512 CPU, where
    # MWMS gives a replica none of predict(x[:1])'s one row. The padded step returns no rows
    # for none and the same outputs as Keras's for some.
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.keras.step_results import padded_predict_step

    model = keras.Sequential([
        keras.Input((12, 12, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(3)])
    plain = tf.function(lambda x: model.predict_step((x,)))
    padded = tf.function(lambda x: padded_predict_step(type(model).predict_step)(model, (x,)))
    x = np.random.default_rng(0).normal(size=(5, 12, 12, 1)).astype("float32")
    assert padded(x[:0]).shape == (0, 3)
    np.testing.assert_array_equal(padded(x).numpy(), plain(x).numpy())
