"""Mirrors the Keras guide "Making new layers and models via subclassing" (the Model subclass
section) and the TensorFlow tutorial "Distributed training with Keras" shape: a subclassed
model trained with fit on numpy arrays.

Keras mechanisms: a subclassed keras.Model whose __init__ creates Conv2D,
BatchNormalization, pooling and Dense layers and whose call(inputs, training=None) passes
`training` to BatchNormalization explicitly; no keras.Input (built lazily on the first batch);
1000 rows with a global batch of 48, so each epoch ends with a short batch of 40 rows;
sparse categorical crossentropy from logits with accuracy; evaluate with the same odd batch.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(48)

GLOBAL_BATCH = 48  # 1000 rows: 20 full batches, then 40 rows
NUM_CLASSES = 4

# Images 16x16x3; the label is the channel/half combination that is brightest.
rng = np.random.RandomState(10)
x_train = rng.uniform(0.0, 0.5, size=(1000, 16, 16, 3)).astype("float32")
y_train = rng.randint(0, NUM_CLASSES, size=1000)
for i, label in enumerate(y_train):
    half = slice(0, 8) if label % 2 == 0 else slice(8, 16)
    x_train[i, half, :, label // 2] += 0.5
x_test, y_test = x_train[:200], y_train[:200]


class ConvBNClassifier(keras.Model):
    def __init__(self, num_classes, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = layers.Conv2D(16, 3, padding="same", use_bias=False)
        self.bn1 = layers.BatchNormalization()
        self.conv2 = layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False)
        self.bn2 = layers.BatchNormalization()
        self.pool = layers.GlobalAveragePooling2D()
        self.dense = layers.Dense(num_classes)

    def call(self, inputs, training=None):
        x = self.conv1(inputs)
        x = self.bn1(x, training=training)
        x = tf.nn.relu(x)
        x = self.conv2(x)
        x = self.bn2(x, training=training)
        x = tf.nn.relu(x)
        x = self.pool(x)
        return self.dense(x)


with strategy_scope() as dist:
    model = ConvBNClassifier(NUM_CLASSES)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

history = model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
moving_mean = model.bn1.moving_mean.numpy()
print(f"final loss {history.history['loss'][-1]:.4f}; eval loss {loss:.4f} acc {accuracy:.4f}; "
      f"bn1 moving mean sum {float(moving_mean.sum()):.5f}")
