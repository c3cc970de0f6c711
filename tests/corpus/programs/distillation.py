"""Mirrors keras-io "Knowledge Distillation" (examples/vision/knowledge_distillation.py).

Keras mechanisms: a teacher convnet trained briefly with compile/fit on numpy arrays; a
Distiller(keras.Model) wrapping student and teacher, with an overridden
compile(optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha, temperature) and an
overridden compute_loss(x, y, y_pred, sample_weight) that calls the frozen teacher and mixes a
SparseCategoricalCrossentropy object with a KLDivergence object on temperature-softened
softmaxes; call() returns the student's output; compiled metrics; evaluate on numpy arrays.
Backend-agnostic (keras.ops only).
"""
# corpus: mwms-k3 hvd-k3 jax
import numpy as np
import keras
from keras import layers, ops

from tfdist import strategy_scope

keras.utils.set_random_seed(2024)

GLOBAL_BATCH = 64

# Stand-in for MNIST (reshaped to 28x28x1, scaled): the label is the block where the image is
# brightest, so teacher and student both learn it.
rng = np.random.RandomState(5)


def make_data(n):
    x = rng.uniform(0.0, 0.3, size=(n, 28, 28, 1)).astype("float32")
    y = rng.randint(0, 10, size=n)
    for i, label in enumerate(y):
        r, c = divmod(int(label), 5)
        x[i, 2 + r * 12:12 + r * 12, 1 + c * 5:6 + c * 5, 0] += 0.7
    return x, y


x_train, y_train = make_data(640)
x_test, y_test = make_data(192)


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn,
                alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


with strategy_scope() as dist:
    teacher = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name="teacher",
    )
    student = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name="student",
    )
    teacher.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )

# Train the teacher first, as the example does.
teacher.fit(x_train, y_train, epochs=2, batch_size=GLOBAL_BATCH, verbose=2)
teacher_scores = teacher.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
print(f"teacher test loss {teacher_scores[0]:.4f} accuracy {teacher_scores[1]:.4f}")

with dist.scope():
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )

history = distiller.fit(x_train, y_train, epochs=2, batch_size=GLOBAL_BATCH, verbose=2)
scores = distiller.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH, verbose=0)
print(f"final distiller loss {history.history['loss'][-1]:.4f}; "
      f"student test {scores}")
