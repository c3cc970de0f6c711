"""One small Embedding + Dense model trained fresh with each built-in Keras 3 optimizer.

Shape of the keras-io "Optimizers" API page examples and of the optimizer comparisons users
post in issues: the same tiny bag-of-embeddings classifier (`Embedding` ->
`GlobalAveragePooling1D` -> `Dense`) is rebuilt from the same seed and compiled in turn with
`SGD(momentum=0.9, nesterov=True)`, `Adam`, `RMSprop`, `Adagrad`, `Adamax`, `Nadam` and
`AdamW(weight_decay=...)`; each gets one short `fit` on numpy arrays and its final loss is
printed.  Exercises the embedding's sparse (gathered) gradients through every optimizer's
slot variables, several models and compiles inside one strategy scope.
"""
# corpus: mwms-k3 hvd-k3 jax

import numpy as np
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(3)

GLOBAL_BATCH = 32
VOCAB = 64
SEQ = 10
N = 192

rng = np.random.RandomState(3)
x = rng.randint(0, VOCAB, size=(N, SEQ)).astype("int32")
token_class = rng.randint(0, 3, size=VOCAB)
# label: the class most of the row's tokens belong to
y = np.array([np.bincount(token_class[row], minlength=3).argmax() for row in x], dtype="int32")


def build_model():
    inputs = keras.Input(shape=(SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 12)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(inputs, outputs)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(learning_rate=1e-2),
    "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=3e-3),
    "adagrad": lambda: keras.optimizers.Adagrad(learning_rate=0.1),
    "adamax": lambda: keras.optimizers.Adamax(learning_rate=1e-2),
    "nadam": lambda: keras.optimizers.Nadam(learning_rate=1e-2),
    "adamw": lambda: keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.01),
}

results = {}
with strategy_scope() as dist:
    for name, make_optimizer in OPTIMIZERS.items():
        keras.utils.set_random_seed(3)  # the same initial weights for every optimizer
        model = build_model()
        model.compile(
            optimizer=make_optimizer(),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=2)
        results[name] = history.history["loss"][-1]

print("final losses " + "  ".join("%s %.5f" % (k, v) for k, v in results.items()))
