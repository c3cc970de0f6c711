"""Mirrors keras-io "Supervised Contrastive Learning" (examples/vision/supervised-contrastive-learning.py).

Keras mechanisms: an encoder (small convnet with global pooling) with a projection head,
pre-trained with a custom keras.losses.Loss subclass whose call(labels, feature_vectors)
returns ONE scalar computed over the whole batch (L2-normalised features, the batch's pairwise
similarity matrix divided by a temperature, an n-pairs softmax cross-entropy over same-label
pairs); then a classifier on the frozen encoder (layer.trainable = False) with Dropout,
compiled with sparse categorical crossentropy and accuracy; numpy inputs; evaluate.
"""
# corpus: mwms-k3 mwms-k2 hvd-k3 hvd-k2
import numpy as np
import tensorflow as tf
from tensorflow import keras
from tensorflow.keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(7)

NUM_CLASSES = 5
INPUT_SHAPE = (32, 32, 3)
GLOBAL_BATCH = 64
HIDDEN_UNITS = 32
PROJECTION_UNITS = 16
TEMPERATURE = 0.1
DROPOUT_RATE = 0.5

# Stand-in for CIFAR-10 (labels shaped (n, 1), as keras.datasets.cifar10 gives them): each
# class has its own colour tint, so same-label images are similar.
rng = np.random.RandomState(21)
tints = rng.uniform(0.0, 1.0, size=(NUM_CLASSES, 1, 1, 3)).astype("float32")


def make_images(n):
    y = rng.randint(0, NUM_CLASSES, size=(n, 1))
    x = rng.uniform(0.0, 1.0, size=(n,) + INPUT_SHAPE).astype("float32") * 0.5
    x += tints[y[:, 0]] * 0.5
    return x, y


x_train, y_train = make_images(640)
x_test, y_test = make_images(192)


class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=1.0, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def call(self, labels, feature_vectors):
        # Normalise the feature vectors, then compare every pair in the batch.
        feature_vectors_normalized = tf.math.l2_normalize(feature_vectors, axis=1)
        logits = tf.divide(
            tf.matmul(feature_vectors_normalized, tf.transpose(feature_vectors_normalized)),
            self.temperature,
        )
        # n-pairs loss: the targets of row i are the rows with i's label, equally weighted.
        labels = tf.reshape(tf.cast(labels, tf.int32), [-1, 1])
        same = tf.cast(tf.equal(labels, tf.transpose(labels)), logits.dtype)
        targets = same / tf.reduce_sum(same, axis=1, keepdims=True)
        return tf.reduce_mean(
            tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=logits)
        )


def create_encoder():
    inputs = keras.Input(shape=INPUT_SHAPE)
    x = layers.Conv2D(16, 3, strides=2, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)
    outputs = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs=inputs, outputs=outputs, name="cifar10-encoder")


def add_projection_head(encoder):
    inputs = keras.Input(shape=INPUT_SHAPE)
    features = encoder(inputs)
    outputs = layers.Dense(PROJECTION_UNITS, activation="relu")(features)
    return keras.Model(inputs=inputs, outputs=outputs, name="cifar-encoder_with_projection-head")


def create_classifier(encoder, trainable=True):
    for layer in encoder.layers:
        layer.trainable = trainable
    inputs = keras.Input(shape=INPUT_SHAPE)
    features = encoder(inputs)
    features = layers.Dropout(DROPOUT_RATE)(features)
    features = layers.Dense(HIDDEN_UNITS, activation="relu")(features)
    features = layers.Dropout(DROPOUT_RATE)(features)
    outputs = layers.Dense(NUM_CLASSES, activation="softmax")(features)
    model = keras.Model(inputs=inputs, outputs=outputs, name="cifar10-classifier")
    model.compile(
        optimizer=keras.optimizers.Adam(0.001),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


with strategy_scope() as dist:
    encoder = create_encoder()
    encoder_with_projection_head = add_projection_head(encoder)
    encoder_with_projection_head.compile(
        optimizer=keras.optimizers.Adam(0.001),
        loss=SupervisedContrastiveLoss(TEMPERATURE),
    )

# 1. Pre-train the encoder with the contrastive loss.
history = encoder_with_projection_head.fit(
    x=x_train, y=y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2
)

# 2. Train the classifier on the frozen encoder.
with dist.scope():
    classifier = create_classifier(encoder, trainable=False)
classifier.fit(x=x_train, y=y_train, batch_size=GLOBAL_BATCH, epochs=2, verbose=2)

accuracy = classifier.evaluate(x_test, y_test, verbose=0)[1]
print(f"final contrastive loss {history.history['loss'][-1]:.4f}; "
      f"test accuracy {round(accuracy * 100, 2)}%")
