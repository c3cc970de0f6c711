"""A Keras 3 model (``import keras``) trained while ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras``
tf_keras: a mix tfdist refuses with its fix (tests/test_keras_compat.py)."""

from __future__ import annotations

import keras
import numpy as np

import tfdist


def main() -> None:
    dist = tfdist.init()
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile("adam", "sparse_categorical_crossentropy")
    dataset = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    model.fit(dataset, epochs=1, verbose=0)


if __name__ == "__main__":
    main()
