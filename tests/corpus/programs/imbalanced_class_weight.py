"""Imbalanced classification: credit card fraud detection (keras-io), with an initial bias.

Mirrors the keras-io example "Imbalanced classification: credit card fraud detection" and the
TensorFlow tutorial "Classification on imbalanced data": 30 numeric features standardised
with numpy statistics of the training split, a small dense network whose output bias starts
at log(pos/neg), `fit` on numpy arrays with a `class_weight` dict (1/count per class, scaled),
`validation_data`, and `FalseNegatives`/`FalsePositives`/`Precision`/`Recall`/`AUC` metrics.
`from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(2024)

GLOBAL_BATCH = 64
N = 1024

rng = np.random.RandomState(2024)
features = rng.normal(size=(N, 30)).astype("float32")
features[:, 29] = np.abs(rng.normal(80.0, 60.0, size=N))  # an "Amount"-like column
risk = features[:, 0] * 1.5 - features[:, 3] + 0.8 * features[:, 7] * features[:, 12]
targets = (risk > np.quantile(risk, 0.93)).astype("float32")[:, None]  # ~7% positives

num_val_samples = int(len(features) * 0.2)
train_features, val_features = features[:-num_val_samples], features[-num_val_samples:]
train_targets, val_targets = targets[:-num_val_samples], targets[-num_val_samples:]

counts = np.bincount(train_targets[:, 0].astype("int64"))
print("positives %d of %d training samples" % (counts[1], len(train_targets)))

mean = np.mean(train_features, axis=0)
std = np.std(train_features, axis=0)
train_features = (train_features - mean) / std
val_features = (val_features - mean) / std

neg, pos = counts
weight_for_0 = (1.0 / neg) * (neg + pos) / 2.0
weight_for_1 = (1.0 / pos) * (neg + pos) / 2.0
class_weight = {0: weight_for_0, 1: weight_for_1}
initial_bias = np.log([pos / neg])

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(train_features.shape[-1],)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(
                1, activation="sigmoid", bias_initializer=keras.initializers.Constant(initial_bias)
            ),
        ]
    )
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
        keras.metrics.AUC(name="auc"),
    ]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)

history = model.fit(
    train_features,
    train_targets,
    batch_size=GLOBAL_BATCH,
    epochs=2,
    verbose=2,
    validation_data=(val_features, val_targets),
    class_weight=class_weight,
)
h = history.history
print(
    "final loss %.5f  val_loss %.5f  val_auc %.4f  val_recall %.4f  val_fn %d"
    % (h["loss"][-1], h["val_loss"][-1], h["val_auc"][-1], h["val_recall"][-1], h["val_fn"][-1])
)
