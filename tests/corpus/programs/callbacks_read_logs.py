"""Callbacks that read each batch's logs: LambdaCallback, a custom early stop, CSVLogger.

Mirrors the keras-io guide "Writing your own callbacks" (a `keras.callbacks.Callback` whose
`on_train_batch_end` reads `logs["loss"]`, records it and sets `self.model.stop_training`
once the loss drops below a threshold; `LearningRateScheduler` with a schedule function) plus
the API pages' `LambdaCallback(on_batch_end=...)` that reads the logs each batch and
`CSVLogger` writing to a temporary file, read back at the end.  A dense classifier on a
tf.data dataset (unshuffled) through `dist.shard`.
"""
# corpus: mwms-k3 hvd-k3 jax

import csv
import os
import tempfile

import numpy as np
import tensorflow as tf
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(14)

GLOBAL_BATCH = 32
N = 640
THRESHOLD = 0.55

rng = np.random.RandomState(14)
x = rng.normal(size=(N, 20)).astype("float32")
y = ((x[:, 0] + x[:, 1] - x[:, 2]) > 0).astype("int32")


class LossHistoryStop(keras.callbacks.Callback):
    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold
        self.batch_losses = []
        self.stopped_at = None

    def on_train_batch_end(self, batch, logs=None):
        loss = float(logs["loss"])
        self.batch_losses.append(loss)
        if loss < self.threshold and self.stopped_at is None:
            self.stopped_at = (len(self.batch_losses), loss)
            self.model.stop_training = True


def schedule(epoch, lr):
    return lr if epoch < 1 else lr * 0.5


seen = {"batches": 0, "acc_sum": 0.0}


def on_batch_end(batch, logs):
    seen["batches"] += 1
    seen["acc_sum"] += float(logs["accuracy"])


csv_path = os.path.join(tempfile.mkdtemp(), "training.log")
history_stop = LossHistoryStop(THRESHOLD)
callbacks = [
    keras.callbacks.LambdaCallback(on_batch_end=on_batch_end),
    keras.callbacks.LearningRateScheduler(schedule),
    history_stop,
    keras.callbacks.CSVLogger(csv_path),
]

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(20,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )

train = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
history = model.fit(train, epochs=2, callbacks=callbacks, verbose=2)

with open(csv_path) as f:
    rows = list(csv.DictReader(f))
print(
    "batches %d  stopped_at %s  last batch loss %.5f  lambda mean acc %.5f  csv epochs %d last loss %s  lr %.4f"
    % (
        len(history_stop.batch_losses),
        None if history_stop.stopped_at is None else "%d (%.5f)" % history_stop.stopped_at,
        history_stop.batch_losses[-1],
        seen["acc_sum"] / seen["batches"],
        len(rows),
        rows[-1]["loss"],
        float(np.asarray(model.optimizer.learning_rate)),
    )
)
