"""fit on a keras.utils.PyDataset subclass that reshuffles itself at each epoch's end.

Shape of the Keras 3 API page "PyDataset class" (the CIFAR10PyDataset example) and of
keras-io examples that feed images from Python: a `keras.utils.PyDataset` subclass holding
numpy arrays, `__len__` (batches per epoch), `__getitem__` returning one GLOBAL batch
`(x, y)`, and `on_epoch_end` permuting its rows with its own `np.random.RandomState`;
`super().__init__(**kwargs)` forwards `workers`/`use_multiprocessing`/`max_queue_size`.
A small CNN on 16x16 grey images is trained on it, then evaluated on an unshuffled one.
"""
# corpus: mwms-k3 hvd-k3 jax

import math

import numpy as np
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(21)

GLOBAL_BATCH = 32
N = 512


class ShuffledImages(keras.utils.PyDataset):
    def __init__(self, x_set, y_set, batch_size, shuffle=True, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x_set, y_set
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = np.random.RandomState(seed)
        self.order = np.arange(len(self.x))
        if self.shuffle:
            self.rng.shuffle(self.order)

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, idx):
        low = idx * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        rows = self.order[low:high]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        if self.shuffle:
            self.rng.shuffle(self.order)


rng = np.random.RandomState(21)
y_all = rng.randint(0, 4, size=N).astype("int32")
x_all = rng.normal(scale=0.3, size=(N, 16, 16, 1)).astype("float32")
for i, label in enumerate(y_all):  # a bright quadrant tells the class
    r, c = divmod(int(label), 2)
    x_all[i, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8, 0] += 1.0

train_seq = ShuffledImages(x_all[:448], y_all[:448], GLOBAL_BATCH, shuffle=True, seed=21)
test_seq = ShuffledImages(x_all[448:], y_all[448:], GLOBAL_BATCH, shuffle=False)

with strategy_scope() as dist:
    model = keras.Sequential(
        [
            keras.Input(shape=(16, 16, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(4, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

history = model.fit(train_seq, epochs=2, verbose=2)
loss, acc = model.evaluate(test_seq, verbose=0)
print("final loss %.5f  test loss %.5f  test accuracy %.4f" % (history.history["loss"][-1], loss, acc))
