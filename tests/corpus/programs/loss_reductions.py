"""One small model compiled in turn with a loss object at each reduction Keras 3 accepts.

Shape of the keras-io API page "Losses" (the `reduction` argument: "sum_over_batch_size",
"mean", "sum", "mean_with_sample_weight") and of the issue reports asking how a reduction
behaves with sample weights: a dense regressor is rebuilt from the same seed and compiled
with `keras.losses.MeanSquaredError(reduction=...)` for each reduction, trained on numpy arrays
with a `sample_weight` array (weights 0.5 / 1 / 3, some 0), and its final loss and the weights'
sum printed.  A reduction this Keras does not know is skipped.
"""
# corpus: mwms-k3 hvd-k3 jax

import numpy as np
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(8)

GLOBAL_BATCH = 32
N = 320

rng = np.random.RandomState(8)
x = rng.normal(size=(N, 8)).astype("float32")
true_w = rng.normal(size=(8, 1)).astype("float32")
y = (x @ true_w + 0.1 * rng.normal(size=(N, 1))).astype("float32")
w = rng.choice(np.array([0.0, 0.5, 1.0, 3.0], dtype="float32"), size=N)

REDUCTIONS = ["sum_over_batch_size", "mean", "sum", "mean_with_sample_weight"]


def build_model():
    inputs = keras.Input(shape=(8,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1)(h)
    return keras.Model(inputs, outputs)


results = {}
with strategy_scope() as dist:
    for reduction in REDUCTIONS:
        try:
            loss = keras.losses.MeanSquaredError(reduction=reduction)
        except ValueError as e:
            print("skipping reduction %r: %s" % (reduction, e))
            continue
        keras.utils.set_random_seed(8)
        model = build_model()
        # a summed loss is ~GLOBAL_BATCH times larger: the user lowers the rate to match
        lr = 0.02 / GLOBAL_BATCH if reduction == "sum" else 0.02
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss=loss)
        history = model.fit(
            x, y, sample_weight=w, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=2
        )
        weight_sum = float(sum(np.asarray(v).sum() for v in model.get_weights()))
        results[reduction] = (history.history["loss"][-1], weight_sum)

print(
    "final " + "  ".join("%s loss %.5f wsum %.5f" % (k, v[0], v[1]) for k, v in results.items())
)
