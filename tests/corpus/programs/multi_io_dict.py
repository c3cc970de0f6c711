"""The Functional API guide's multi-input, multi-output "ticket" model, fed by tf.data dicts.

Mirrors the keras-io guide "The Functional API", section "Models with multiple inputs and
outputs": issue tickets with a title (integer word ids) and binary tag vector go in; a
priority score (sigmoid) and a department (softmax) come out.  Inputs and outputs are named,
and `compile` takes a loss dict, a `loss_weights` dict and a metrics dict keyed by output
name; `fit` reads a `tf.data.Dataset` of `({"title", "tags"}, {"priority", "department"})`.
"""
# corpus: mwms-k3 hvd-k3 jax

import numpy as np
import tensorflow as tf
import keras
from keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(11)

GLOBAL_BATCH = 32
NUM_WORDS = 100
NUM_TAGS = 12
NUM_DEPARTMENTS = 4
TITLE_LEN = 10
N = 640

with strategy_scope() as dist:
    title_input = keras.Input(shape=(TITLE_LEN,), dtype="int32", name="title")
    tags_input = keras.Input(shape=(NUM_TAGS,), name="tags")

    title_features = layers.Embedding(NUM_WORDS, 16)(title_input)
    title_features = layers.LSTM(16)(title_features)
    x = layers.concatenate([title_features, tags_input])

    priority_pred = layers.Dense(1, activation="sigmoid", name="priority")(x)
    department_pred = layers.Dense(NUM_DEPARTMENTS, activation="softmax", name="department")(x)

    model = keras.Model(
        inputs={"title": title_input, "tags": tags_input},
        outputs={"priority": priority_pred, "department": department_pred},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-2),
        loss={
            "priority": keras.losses.BinaryCrossentropy(),
            "department": keras.losses.SparseCategoricalCrossentropy(),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
        metrics={
            "priority": [keras.metrics.MeanAbsoluteError()],
            "department": [keras.metrics.SparseCategoricalAccuracy(name="acc")],
        },
    )

rng = np.random.RandomState(11)
title_data = rng.randint(NUM_WORDS, size=(N, TITLE_LEN)).astype("int32")
tags_data = rng.randint(2, size=(N, NUM_TAGS)).astype("float32")
priority_targets = (tags_data[:, :4].sum(axis=1, keepdims=True) / 4.0).astype("float32")
department_targets = tags_data[:, 4:8].argmax(axis=1).astype("int32")

dataset = tf.data.Dataset.from_tensor_slices(
    (
        {"title": title_data, "tags": tags_data},
        {"priority": priority_targets, "department": department_targets},
    )
)
train = dist.shard(dataset.shuffle(N, seed=11).batch(GLOBAL_BATCH))
history = model.fit(train, epochs=2, verbose=2)
print(
    "final loss %.5f  department_acc %.4f  priority_mae %.5f"
    % (
        history.history["loss"][-1],
        history.history["department_acc"][-1],
        history.history["priority_mean_absolute_error"][-1],
    )
)
