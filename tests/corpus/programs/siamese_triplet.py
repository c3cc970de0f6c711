"""Mirrors keras-io "Image similarity estimation using a Siamese Network with a triplet loss"
(examples/vision/siamese_network.py).

Keras mechanisms: an embedding network (convnet, Dense, BatchNormalization); a DistanceLayer
returning the anchor-positive and anchor-negative squared distances; a functional
siamese_network with three inputs; a SiameseModel(keras.Model) with call(), a custom
train_step/test_step computing the triplet loss by hand (max(ap - an + margin, 0), a
per-example vector, differentiated with tf.GradientTape as the example does) and a
keras.metrics.Mean loss tracker listed in `metrics`; tf.data datasets of (anchor, positive,
negative) triplets zipped, shuffled with a seed and batched; fit with validation_data.
"""
# corpus: mwms-k3 hvd-k3
import numpy as np
import tensorflow as tf
import keras
from keras import layers, metrics, ops

from tfdist import strategy_scope

keras.utils.set_random_seed(321)

TARGET_SHAPE = (32, 32)
GLOBAL_BATCH = 32
NUM_CLASSES = 6

# Stand-in for the Totally Looks Like pairs: images of a few "identities" (a colour and a
# pattern each); the positive shares the anchor's identity, the negative does not.
rng = np.random.RandomState(14)
prototypes = rng.uniform(0.0, 1.0, size=(NUM_CLASSES, 32, 32, 3)).astype("float32")


def make_triplets(n):
    a_cls = rng.randint(0, NUM_CLASSES, size=n)
    n_cls = (a_cls + rng.randint(1, NUM_CLASSES, size=n)) % NUM_CLASSES

    def noisy(cls):
        return (0.6 * prototypes[cls]
                + 0.4 * rng.uniform(0.0, 1.0, size=(len(cls), 32, 32, 3))).astype("float32")

    return noisy(a_cls), noisy(a_cls), noisy(n_cls)


anchors, positives, negatives = make_triplets(480)
val_anchors, val_positives, val_negatives = make_triplets(96)


class DistanceLayer(layers.Layer):
    """Computes the distance between the anchor and the positive, and the anchor and the negative."""

    def call(self, anchor, positive, negative):
        ap_distance = ops.sum(tf.square(anchor - positive), -1)
        an_distance = ops.sum(tf.square(anchor - negative), -1)
        return (ap_distance, an_distance)


def build_embedding():
    inputs = keras.Input(TARGET_SHAPE + (3,))
    x = layers.Conv2D(16, 3, strides=2, activation="relu")(inputs)
    x = layers.Conv2D(32, 3, strides=2, activation="relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(64, activation="relu")(x)
    x = layers.BatchNormalization()(x)
    output = layers.Dense(32)(x)
    return keras.Model(inputs, output, name="Embedding")


class SiameseModel(keras.Model):
    """The Siamese Network model with a custom training and testing loops."""

    def __init__(self, siamese_network, margin=0.5):
        super().__init__()
        self.siamese_network = siamese_network
        self.margin = margin
        self.loss_tracker = metrics.Mean(name="loss")

    def call(self, inputs):
        return self.siamese_network(inputs)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = self._compute_loss(data)
        gradients = tape.gradient(loss, self.siamese_network.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.siamese_network.trainable_weights))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        loss = self._compute_loss(data)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def _compute_loss(self, data):
        ap_distance, an_distance = self.siamese_network(data)
        loss = ap_distance - an_distance
        loss = tf.maximum(loss + self.margin, 0.0)
        return loss

    @property
    def metrics(self):
        return [self.loss_tracker]


with strategy_scope() as dist:
    embedding = build_embedding()
    anchor_input = layers.Input(name="anchor", shape=TARGET_SHAPE + (3,))
    positive_input = layers.Input(name="positive", shape=TARGET_SHAPE + (3,))
    negative_input = layers.Input(name="negative", shape=TARGET_SHAPE + (3,))
    distances = DistanceLayer()(
        embedding(anchor_input),
        embedding(positive_input),
        embedding(negative_input),
    )
    siamese_network = keras.Model(
        inputs=[anchor_input, positive_input, negative_input], outputs=distances
    )
    siamese_model = SiameseModel(siamese_network)
    siamese_model.compile(optimizer=keras.optimizers.Adam(0.001))

anchor_dataset = tf.data.Dataset.from_tensor_slices(anchors)
positive_dataset = tf.data.Dataset.from_tensor_slices(positives)
negative_dataset = tf.data.Dataset.from_tensor_slices(negatives)
train_dataset = tf.data.Dataset.zip((anchor_dataset, positive_dataset, negative_dataset))
train_dataset = train_dataset.shuffle(buffer_size=1024, seed=32).batch(GLOBAL_BATCH)
val_dataset = tf.data.Dataset.zip(
    tuple(tf.data.Dataset.from_tensor_slices(a) for a in (val_anchors, val_positives, val_negatives))
).batch(GLOBAL_BATCH)

history = siamese_model.fit(dist.shard(train_dataset), epochs=2,
                            validation_data=dist.shard(val_dataset), verbose=2)
ap, an = siamese_model.predict([val_anchors[:8], val_positives[:8], val_negatives[:8]], verbose=0)
print(f"final loss {history.history['loss'][-1]:.4f} val_loss {history.history['val_loss'][-1]:.4f}; "
      f"mean ap {float(np.mean(ap)):.4f} an {float(np.mean(an)):.4f}")
