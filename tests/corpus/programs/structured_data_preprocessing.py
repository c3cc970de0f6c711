"""Structured data classification from scratch (keras-io), heart-disease shape.

Mirrors the keras-io example "Structured data classification from scratch" (and the
FeatureSpace variant's feature kinds): a table held as a dict of columns (what `dict(df)`
gives), numeric columns normalised with `Normalization.adapt`, an integer categorical column
through `IntegerLookup(output_mode="one_hot")`, a string categorical column through
`StringLookup` + `CategoryEncoding(output_mode="one_hot")`, all inside a functional model with
one `keras.Input` per column.  The `tf.data.Dataset.from_tensor_slices((dict(df), labels))`
pipelines are built before the strategy scope, as the example does.
"""
# corpus: mwms-k3 hvd-k3

import numpy as np
import tensorflow as tf
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(1337)

GLOBAL_BATCH = 32
N = 640

# --- the "dataframe": a dict of columns --------------------------------------------------
rng = np.random.RandomState(1337)
age = rng.randint(29, 78, size=N).astype("int64")
trestbps = rng.normal(130.0, 17.0, size=N).astype("float32")
chol = rng.normal(245.0, 50.0, size=N).astype("float32")
thalach = rng.normal(150.0, 22.0, size=N).astype("float32")
oldpeak = np.abs(rng.normal(1.0, 1.1, size=N)).astype("float32")
sex = rng.randint(0, 2, size=N).astype("int64")
cp = rng.randint(0, 5, size=N).astype("int64")
ca = rng.randint(0, 4, size=N).astype("int64")
thal = rng.choice(np.array(["normal", "fixed", "reversible"]), size=N)

score = (
    0.04 * (age - 53)
    + 0.02 * (chol - 245.0)
    - 0.03 * (thalach - 150.0)
    + 0.8 * oldpeak
    + 0.6 * (cp >= 3)
    + 1.0 * (thal == "reversible")
    + 0.5 * ca
)
target = (score + rng.normal(0.0, 0.5, size=N) > np.median(score)).astype("int64")

df = {
    "age": age,
    "trestbps": trestbps,
    "chol": chol,
    "thalach": thalach,
    "oldpeak": oldpeak,
    "sex": sex,
    "cp": cp,
    "ca": ca,
    "thal": thal,
}

val_rows = N // 5
train_df = {k: v[val_rows:] for k, v in df.items()}
val_df = {k: v[:val_rows] for k, v in df.items()}
train_labels = target[val_rows:]
val_labels = target[:val_rows]


def dataframe_to_dataset(frame, labels):
    ds = tf.data.Dataset.from_tensor_slices((dict(frame), labels))
    return ds.shuffle(buffer_size=len(labels), seed=1337)


train_ds = dataframe_to_dataset(train_df, train_labels)
val_ds = dataframe_to_dataset(val_df, val_labels)

NUMERIC = ["age", "trestbps", "chol", "thalach", "oldpeak"]
INT_CATEGORICAL = ["sex", "cp", "ca"]
STR_CATEGORICAL = ["thal"]


def encode_numerical_feature(feature, name, dataset):
    normalizer = keras.layers.Normalization()
    feature_ds = dataset.map(lambda x, y: x[name]).map(lambda x: tf.expand_dims(tf.cast(x, "float32"), -1))
    normalizer.adapt(feature_ds.batch(128))
    return normalizer(feature)


def encode_categorical_feature(feature, name, dataset, is_string):
    if is_string:
        lookup = keras.layers.StringLookup()
    else:
        lookup = keras.layers.IntegerLookup(output_mode="one_hot")
    feature_ds = dataset.map(lambda x, y: x[name]).map(lambda x: tf.expand_dims(x, -1))
    lookup.adapt(feature_ds.batch(128))
    encoded = lookup(feature)
    if is_string:
        encoded = keras.layers.CategoryEncoding(
            num_tokens=lookup.vocabulary_size(), output_mode="one_hot"
        )(encoded)
    return encoded


with strategy_scope() as dist:
    inputs = {}
    for name in NUMERIC:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="float32")
    for name in INT_CATEGORICAL:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="int64")
    for name in STR_CATEGORICAL:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="string")

    encoded = [encode_numerical_feature(inputs[n], n, train_ds) for n in NUMERIC]
    encoded += [encode_categorical_feature(inputs[n], n, train_ds, False) for n in INT_CATEGORICAL]
    encoded += [encode_categorical_feature(inputs[n], n, train_ds, True) for n in STR_CATEGORICAL]
    all_features = keras.layers.concatenate(encoded)
    x = keras.layers.Dense(32, activation="relu")(all_features)
    x = keras.layers.Dropout(0.2)(x)
    output = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, output)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])


def add_feature_axis(features, label):
    return {k: tf.expand_dims(v, -1) for k, v in features.items()}, label


train = dist.shard(train_ds.map(add_feature_axis).batch(GLOBAL_BATCH))
val = dist.shard(val_ds.map(add_feature_axis).batch(GLOBAL_BATCH))
history = model.fit(train, epochs=2, validation_data=val, verbose=2)
print(
    "final loss %.5f  val_loss %.5f  val_accuracy %.4f"
    % (history.history["loss"][-1], history.history["val_loss"][-1], history.history["val_accuracy"][-1])
)
