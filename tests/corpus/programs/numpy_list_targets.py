"""A two-output functional model fit on numpy arrays with a LIST of targets and of losses.

Shape of the keras-io guide "The Functional API" (a shared trunk with two heads) written the
way many issue reports and tutorials feed it: `model.fit(x, [y_reg, y_cls], batch_size=...)`
with `compile(loss=["mse", "sparse_categorical_crossentropy"], loss_weights=[1.0, 0.5],
metrics=[["mae"], ["accuracy"]])`, `validation_split`, then `evaluate` on the same lists.
`from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(10)

GLOBAL_BATCH = 32
N = 800

rng = np.random.RandomState(10)
x = rng.normal(size=(N, 12)).astype("float32")
y_reg = (x[:, :3].sum(axis=1, keepdims=True) + 0.1 * rng.normal(size=(N, 1))).astype("float32")
y_cls = (np.digitize(x[:, 3] - x[:, 4], [-0.7, 0.7])).astype("int32")  # 3 classes

with strategy_scope() as dist:
    inputs = keras.Input(shape=(12,))
    trunk = keras.layers.Dense(32, activation="relu")(inputs)
    trunk = keras.layers.Dense(32, activation="relu")(trunk)
    reg_out = keras.layers.Dense(1, name="value")(trunk)
    cls_out = keras.layers.Dense(3, activation="softmax", name="kind")(trunk)
    model = keras.Model(inputs, [reg_out, cls_out])
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=["mse", "sparse_categorical_crossentropy"],
        loss_weights=[1.0, 0.5],
        metrics=[["mae"], ["accuracy"]],
    )

history = model.fit(x, [y_reg, y_cls], batch_size=GLOBAL_BATCH, epochs=2, validation_split=0.2, verbose=2)
results = model.evaluate(x, [y_reg, y_cls], batch_size=GLOBAL_BATCH, verbose=0)
print(
    "final loss %.5f  val_loss %.5f  evaluate %s"
    % (history.history["loss"][-1], history.history["val_loss"][-1], " ".join("%.5f" % r for r in results))
)
