"""Masking and padding with Keras: Embedding(mask_zero=True) feeding an LSTM.

Mirrors the keras-io guide "Understanding masking & padding" together with the shape of
"Bidirectional LSTM on IMDB": variable-length integer sequences padded with
`keras.utils.pad_sequences` (post padding, truncation), an `Embedding(mask_zero=True)` whose
mask is propagated to an `LSTM`, a `Dense` head, and `fit` on numpy arrays with
`batch_size=` and `validation_split`.  The label depends only on the unpadded tokens, so the
mask matters.  `from tensorflow import keras`, valid for Keras 3 and tf_keras.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2

import numpy as np
import tensorflow as tf
from tensorflow import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(7)

GLOBAL_BATCH = 32
VOCAB = 50
MAXLEN = 20
N = 640

rng = np.random.RandomState(7)
sequences = []
labels = []
for _ in range(N):
    length = rng.randint(3, 26)  # some longer than MAXLEN: truncated
    seq = rng.randint(1, VOCAB, size=length)
    sequences.append(seq.tolist())
    kept = seq[:MAXLEN]
    # label: do tokens from the upper half of the vocabulary dominate?
    labels.append(int((kept >= VOCAB // 2).mean() > 0.5))
x = keras.utils.pad_sequences(sequences, maxlen=MAXLEN, padding="post", truncating="post")
y = np.array(labels, dtype="float32")

with strategy_scope() as dist:
    inputs = keras.Input(shape=(MAXLEN,), dtype="int32")
    h = keras.layers.Embedding(input_dim=VOCAB, output_dim=16, mask_zero=True)(inputs)
    h = keras.layers.LSTM(24)(h)
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )

history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, validation_split=0.2, verbose=2)
mask = model.layers[1].compute_mask(tf.constant(x[:4]))
print(
    "final loss %.5f  val_loss %.5f  mask rows %s"
    % (history.history["loss"][-1], history.history["val_loss"][-1], np.asarray(mask).sum(axis=1).tolist())
)
