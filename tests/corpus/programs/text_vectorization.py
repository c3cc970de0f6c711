"""Text classification from scratch (keras-io), IMDB-review shape on synthetic sentences.

Mirrors the keras-io example "Text classification from scratch": raw strings in a tf.data
dataset, a `TextVectorization` layer (custom standardization, `output_mode="int"`,
`output_sequence_length`) adapted on the text only, the vectorization applied in the input
pipeline with `ds.map(vectorize_text)`, then `Embedding` -> `Conv1D` -> `GlobalMaxPooling1D`
-> `Dense(1, sigmoid)` trained with binary cross-entropy.  Sentences are drawn from a small
vocabulary with numpy; the label is whether "good" words outnumber "bad" ones.
"""
# corpus: mwms-k3 hvd-k3

import re
import string

import numpy as np
import tensorflow as tf
import keras
from keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(42)

GLOBAL_BATCH = 32
MAX_FEATURES = 200
SEQUENCE_LENGTH = 24
EMBEDDING_DIM = 16

GOOD = ["great", "wonderful", "superb", "moving", "brilliant", "fun"]
BAD = ["awful", "boring", "dull", "terrible", "weak", "messy"]
NEUTRAL = ["the", "film", "movie", "plot", "actor", "was", "and", "a", "story", "it",
           "scene", "ending", "music", "very", "quite", "really", "camera", "<br />"]


def make_reviews(n, rng):
    texts, labels = [], []
    for _ in range(n):
        length = rng.randint(8, 20)
        n_good = rng.randint(0, 4)
        n_bad = rng.randint(0, 4)
        if n_good == n_bad:
            n_good += 1
        words = list(rng.choice(NEUTRAL, size=length))
        words += list(rng.choice(GOOD, size=n_good)) + list(rng.choice(BAD, size=n_bad))
        rng.shuffle(words)
        text = " ".join(words).capitalize() + rng.choice([".", "!", "..."])
        texts.append(text)
        labels.append(int(n_good > n_bad))
    return np.array(texts), np.array(labels, dtype="int32")


rng = np.random.RandomState(42)
train_texts, train_labels = make_reviews(640, rng)
val_texts, val_labels = make_reviews(160, rng)


def custom_standardization(input_data):
    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")


with strategy_scope() as dist:
    raw_train_ds = tf.data.Dataset.from_tensor_slices((train_texts, train_labels))
    raw_val_ds = tf.data.Dataset.from_tensor_slices((val_texts, val_labels))

    vectorize_layer = layers.TextVectorization(
        standardize=custom_standardization,
        max_tokens=MAX_FEATURES,
        output_mode="int",
        output_sequence_length=SEQUENCE_LENGTH,
    )
    text_ds = raw_train_ds.map(lambda x, y: x)
    vectorize_layer.adapt(text_ds.batch(64))

    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(MAX_FEATURES, EMBEDDING_DIM)(inputs)
    x = layers.Conv1D(32, 5, padding="valid", activation="relu", strides=1)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(32, activation="relu")(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])


def vectorize_text(text, label):
    text = tf.expand_dims(text, -1)
    return vectorize_layer(text), label


train_ds = raw_train_ds.batch(GLOBAL_BATCH).map(vectorize_text).prefetch(2)
val_ds = raw_val_ds.batch(GLOBAL_BATCH).map(vectorize_text)
history = model.fit(dist.shard(train_ds), validation_data=dist.shard(val_ds), epochs=2, verbose=2)
print(
    "final loss %.5f  val_loss %.5f  vocab %d"
    % (history.history["loss"][-1], history.history["val_loss"][-1], vectorize_layer.vocabulary_size())
)
