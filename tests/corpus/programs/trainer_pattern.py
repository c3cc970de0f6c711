"""Mirrors keras-io "Trainer pattern" (examples/keras_recipes/trainer_pattern.py).

Keras mechanisms: a MyTrainer(keras.Model) that wraps another model (self.model), owns its
loss object (SparseCategoricalCrossentropy) and a metric object, and overrides train_step
(tf.GradientTape, self.optimizer.apply_gradients) and test_step, both returning a dict of the
metrics' results (no loss in it); the `metrics` property lists the trainer's own metric; call()
forwards to the wrapped model. Two trainers (SGD and Adam) on two models, each fit with
validation_data on numpy arrays.
"""
# corpus: mwms-k3 hvd-k3
import numpy as np
import tensorflow as tf
import keras

from tfdist import strategy_scope

keras.utils.set_random_seed(99)

GLOBAL_BATCH = 64

# Stand-in for MNIST scaled to [0, 1]: the label is the brightest of ten row bands.
rng = np.random.RandomState(8)


def make_data(n):
    x = rng.uniform(0.0, 0.5, size=(n, 28, 28)).astype("float32")
    y = rng.randint(0, 10, size=n)
    for i, label in enumerate(y):
        x[i, 2 * label + 4:2 * label + 6, :] += 0.5
    return x, y


x_train, y_train = make_data(640)
x_test, y_test = make_data(128)


def get_model():
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28)),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


class MyTrainer(keras.Model):
    def __init__(self, model):
        super().__init__()
        self.model = model
        # Create loss and metrics here.
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.accuracy_metric = keras.metrics.SparseCategoricalAccuracy()

    @property
    def metrics(self):
        # Listed here so that Keras resets them at the start of each epoch.
        return [self.accuracy_metric]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self.model(x, training=False)
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def call(self, x):
        return self.model(x)


with strategy_scope() as dist:
    model_a = get_model()
    model_b = get_model()
    trainer_1 = MyTrainer(model_a)
    trainer_2 = MyTrainer(model_b)
    trainer_1.compile(optimizer=keras.optimizers.SGD())
    trainer_2.compile(optimizer=keras.optimizers.Adam())

history_1 = trainer_1.fit(x_train, y_train, epochs=2, batch_size=GLOBAL_BATCH,
                          validation_data=(x_test, y_test), verbose=2)
history_2 = trainer_2.fit(x_train, y_train, epochs=2, batch_size=GLOBAL_BATCH,
                          validation_data=(x_test, y_test), verbose=2)
print(f"final val accuracy: SGD {history_1.history['val_sparse_categorical_accuracy'][-1]:.4f}, "
      f"Adam {history_2.history['val_sparse_categorical_accuracy'][-1]:.4f}")
