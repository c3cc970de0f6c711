"""After a short fit, evaluate and predict on odd sizes: 1, 3 and 257 rows (batch 32).

Shape of the keras-io guide "Training & evaluation with the built-in methods" (fit, then
`evaluate` and `predict` on held-out data) as users run it on whatever is left over: a single
row, three rows, and 257 rows (eight full batches of 32 and one of 1), each passed as numpy
arrays with `batch_size=32` and as a `tf.data.Dataset` batched by 32 through `dist.shard`.
Prints the shapes, the sums of the predictions and the evaluated loss/accuracy.
`from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(13)

GLOBAL_BATCH = 32

rng = np.random.RandomState(13)
centers = rng.normal(scale=2.0, size=(3, 10)).astype("float32")
y_all = rng.randint(0, 3, size=900).astype("int32")
x_all = (centers[y_all] + rng.normal(size=(900, 10))).astype("float32")
x_train, y_train = x_all[:640], y_all[:640]
x_rest, y_rest = x_all[640:], y_all[640:]

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(10,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )

model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=2)

lines = []
for n in (1, 3, 257):
    x, y = x_rest[:n], y_rest[:n]
    loss_np, acc_np = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    pred_np = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    loss_ds, acc_ds = model.evaluate(dist.shard(ds), verbose=0)
    pred_ds = model.predict(dist.shard(ds), verbose=0)
    lines.append(
        "n=%d numpy: eval %.5f/%.4f pred %s sum %.4f col0 %.4f | dataset: eval %.5f/%.4f pred %s sum %.4f col0 %.4f"
        % (
            n, loss_np, acc_np, pred_np.shape, pred_np.sum(), pred_np[:, 0].sum(),
            loss_ds, acc_ds, pred_ds.shape, pred_ds.sum(), pred_ds[:, 0].sum(),
        )
    )
print("\n".join(lines))
