"""Mirrors keras-io "MixUp augmentation for image classification" (examples/vision/mixup.py).

Keras mechanisms: two tf.data datasets over the same arrays, each shuffled with its own seed
and batched with the global batch, zipped and mapped (num_parallel_calls) through a mix-up
function that draws the mixing weights from a Beta distribution made of two tf.random.gamma
draws and mixes images and one-hot labels; a small convnet with Dropout and
GlobalAveragePooling2D compiled with categorical crossentropy and accuracy; fit on the mixed
dataset with a tf.data validation set; evaluate. The datasets are built right after the
strategy scope, as tfdist's README puts them.
"""
# corpus: mwms-k3 hvd-k3 jax
import numpy as np
import tensorflow as tf
import keras
from keras import layers

from tfdist import strategy_scope

keras.utils.set_random_seed(42)

AUTO = tf.data.AUTOTUNE
GLOBAL_BATCH = 64

# Stand-in for Fashion-MNIST (28x28x1 in [0, 1], one-hot labels): a class-dependent stripe.
rng = np.random.RandomState(13)


def make_data(n):
    x = rng.uniform(0.0, 0.2, size=(n, 28, 28, 1)).astype("float32")
    y = rng.randint(0, 10, size=n)
    for i, label in enumerate(y):
        x[i, :, 2 * label + 4:2 * label + 7, 0] += 1.0
    return x, keras.ops.convert_to_numpy(keras.utils.to_categorical(y, 10)).astype("float32")


x_train, y_train = make_data(640)
x_val, y_val = make_data(128)


def sample_beta_distribution(size, concentration_0=0.2, concentration_1=0.2):
    gamma_1_sample = tf.random.gamma(shape=[size], alpha=concentration_1)
    gamma_2_sample = tf.random.gamma(shape=[size], alpha=concentration_0)
    return gamma_1_sample / (gamma_1_sample + gamma_2_sample)


def mix_up(ds_one, ds_two, alpha=0.2):
    images_one, labels_one = ds_one
    images_two, labels_two = ds_two
    batch_size = tf.shape(images_one)[0]
    # Sample lambda and reshape it to do the mixup.
    l = sample_beta_distribution(batch_size, alpha, alpha)
    x_l = tf.reshape(l, (batch_size, 1, 1, 1))
    y_l = tf.reshape(l, (batch_size, 1))
    images = images_one * x_l + images_two * (1 - x_l)
    labels = labels_one * y_l + labels_two * (1 - y_l)
    return (images, labels)


def get_training_model():
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(16, (5, 5), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(32, (5, 5), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Dropout(0.2),
            layers.GlobalAveragePooling2D(),
            layers.Dense(64, activation="relu"),
            layers.Dense(10, activation="softmax"),
        ]
    )


with strategy_scope() as dist:
    model = get_training_model()
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])

train_ds_one = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(GLOBAL_BATCH * 10, seed=1)
    .batch(GLOBAL_BATCH)
)
train_ds_two = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(GLOBAL_BATCH * 10, seed=2)
    .batch(GLOBAL_BATCH)
)
# Because we will be mixing up the images and their corresponding labels, we will be
# combining two shuffled datasets from the same training data.
train_ds = tf.data.Dataset.zip((train_ds_one, train_ds_two))
train_ds_mu = train_ds.map(
    lambda ds_one, ds_two: mix_up(ds_one, ds_two, alpha=0.2), num_parallel_calls=AUTO
)
val_ds = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(GLOBAL_BATCH)

model.fit(dist.shard(train_ds_mu), validation_data=dist.shard(val_ds), epochs=2, verbose=2)
loss, accuracy = model.evaluate(dist.shard(val_ds), verbose=0)
print(f"final val loss {loss:.4f} accuracy {accuracy:.4f}")
