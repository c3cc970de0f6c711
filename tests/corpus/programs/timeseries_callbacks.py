"""Timeseries forecasting for weather prediction (keras-io), on a synthetic multivariate series.

Mirrors the keras-io example "Timeseries forecasting for weather prediction": a multivariate
series normalised with the training split's mean and std, windows made by
`keras.utils.timeseries_dataset_from_array` (sampling_rate, sequence_length, targets shifted
by the past+future offset, batch_size = the global batch) for training and validation, an
`LSTM(32)` -> `Dense(1)` regressor, and the example's callbacks: `EarlyStopping(monitor=
"val_loss")`, `ModelCheckpoint(save_best_only=True, save_weights_only=True)` into a temporary
folder, plus `ReduceLROnPlateau`; then `load_weights` of the best checkpoint.
"""
# corpus: mwms-k3 hvd-k3 jax

import os
import tempfile

import numpy as np
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(9)

GLOBAL_BATCH = 32
STEP = 2          # sampling_rate: one sample every 2 steps
PAST = 40
FUTURE = 6
N = 1000
SPLIT = 700

rng = np.random.RandomState(9)
t = np.arange(N, dtype="float32")
temperature = 10 + 8 * np.sin(2 * np.pi * t / 96) + rng.normal(scale=0.8, size=N)
pressure = 1000 + 5 * np.cos(2 * np.pi * t / 300) + rng.normal(scale=0.5, size=N)
humidity = 60 - 2 * temperature + rng.normal(scale=2.0, size=N)
wind = np.abs(rng.normal(3.0, 1.5, size=N))
features = np.stack([temperature, pressure, humidity, wind], axis=1).astype("float32")

mean = features[:SPLIT].mean(axis=0)
std = features[:SPLIT].std(axis=0)
features = (features - mean) / std
train_data = features[:SPLIT]
val_data = features[SPLIT:]

start = PAST + FUTURE
sequence_length = int(PAST / STEP)
x_train = train_data
y_train = features[start:SPLIT + start, 0]

with strategy_scope() as dist:
    dataset_train = keras.utils.timeseries_dataset_from_array(
        x_train[: len(y_train)],
        y_train,
        sequence_length=sequence_length,
        sampling_rate=STEP,
        batch_size=GLOBAL_BATCH,
    )
    x_end = len(val_data) - PAST - FUTURE
    x_val = val_data[:x_end]
    y_val = features[SPLIT + start:, 0]
    dataset_val = keras.utils.timeseries_dataset_from_array(
        x_val,
        y_val,
        sequence_length=sequence_length,
        sampling_rate=STEP,
        batch_size=GLOBAL_BATCH,
    )

    inputs = keras.layers.Input(shape=(sequence_length, features.shape[1]))
    lstm_out = keras.layers.LSTM(32)(inputs)
    outputs = keras.layers.Dense(1)(lstm_out)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse")

path_checkpoint = os.path.join(tempfile.mkdtemp(), "model_checkpoint.weights.h5")
es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=1)
lr_callback = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=1e-4)
modelckpt_callback = keras.callbacks.ModelCheckpoint(
    monitor="val_loss",
    filepath=path_checkpoint,
    verbose=1,
    save_weights_only=True,
    save_best_only=True,
)

history = model.fit(
    dist.shard(dataset_train),
    epochs=2,
    validation_data=dist.shard(dataset_val),
    callbacks=[es_callback, lr_callback, modelckpt_callback],
    verbose=2,
)
model.load_weights(path_checkpoint)
best_val = model.evaluate(dist.shard(dataset_val), verbose=0)
print(
    "final loss %.5f  val_loss %.5f  best-checkpoint val_loss %.5f  lr %.5f"
    % (
        history.history["loss"][-1],
        history.history["val_loss"][-1],
        best_val,
        float(np.asarray(model.optimizer.learning_rate)),
    )
)
