"""A GAN as users write one, trained by ``fit`` with ``dist.callbacks(model_dir=...)``.

    python gan_worker.py OUT_DIR MODEL_DIR [STOP]

The shape of the keras-io GANs, written for this test: a ``keras.Model`` without ``call()``
holding a generator and a discriminator (Dropout in it), its own ``compile(d_optimizer,
g_optimizer)`` that calls ``super().compile()`` with none (Keras then holds an RMSprop that is
never applied), its own ``train_step`` drawing noise with ``keras.random.normal`` without a seed
(Keras's global seed generator, which no model holds) and applying each network's gradients with
its own Adam; ``fit(x)`` with no labels, an odd global batch (37), no shuffling, 3 epochs of 30
steps. One process, or each worker of ``tfdist launch -n 2``.

``STOP`` (first run only: ``TFDIST_RESTART_COUNT`` unset or 0): ``USR1:K`` sends this process
SIGUSR1 after its K-th step (counted over the epochs); ``KILL:K`` SIGKILLs it after its K-th
step, once a save of the first epoch's end is committed in MODEL_DIR. Writes
``result-RANK-RUN.json`` (the steps this run trained, where it resumed; after a finished fit a
digest of the weights and of every optimizer's and random generator's state) and
``state-RANK-RUN.npz`` (those values).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import tfdist

out, model_dir = sys.argv[1], sys.argv[2]
stop = sys.argv[3] if len(sys.argv) > 3 else ""
run = int(os.environ.get("TFDIST_RESTART_COUNT") or 0)

with tfdist.strategy_scope() as dist:
    import keras

    keras.utils.set_random_seed(1)

    class GAN(keras.Model):
        def __init__(self):
            super().__init__()
            self.generator = keras.Sequential([
                keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(3)])
            self.discriminator = keras.Sequential([
                keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                keras.layers.Dropout(0.2), keras.layers.Dense(1)])

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

        def train_step(self, real):
            import tensorflow as tf

            rows = tf.shape(real)[0]
            noise = keras.random.normal((rows, 4))
            with tf.GradientTape() as tape:
                fake = self.generator(noise)
                d_loss = (self.bce(tf.ones((rows, 1)), self.discriminator(real, training=True))
                          + self.bce(tf.zeros((rows, 1)),
                                     self.discriminator(fake, training=True)))
            weights = self.discriminator.trainable_weights
            grads = tape.gradient(d_loss, weights)
            self.d_optimizer.apply_gradients(zip(grads, weights, strict=True))
            with tf.GradientTape() as tape:
                g_loss = self.bce(tf.ones((rows, 1)),
                                  self.discriminator(self.generator(noise), training=True))
            weights = self.generator.trainable_weights
            grads = tape.gradient(g_loss, weights)
            self.g_optimizer.apply_gradients(zip(grads, weights, strict=True))
            return {"d_loss": d_loss, "g_loss": g_loss}

    gan = GAN()
    gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(2e-3))

real = np.random.default_rng(0).normal(size=(37 * 30, 3)).astype("float32")


class Steps(keras.callbacks.Callback):
    """Counts this run's steps; stops the first run at its ``STOP``."""

    def __init__(self):
        super().__init__()
        self.trained = 0

    def on_train_batch_end(self, batch, logs=None):
        self.trained += 1
        how, _, at = stop.partition(":")
        if run or not how or self.trained != int(at):
            return
        if how == "USR1":
            os.kill(os.getpid(), signal.SIGUSR1)
            return
        deadline = time.monotonic() + 60  # the first epoch's end, committed (a background save)
        state = os.path.join(model_dir, "preempted", "state.json")
        while time.monotonic() < deadline:
            if os.path.exists(state):
                with open(state, encoding="utf-8") as f:
                    if json.load(f).get("epoch_done"):
                        break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


steps = Steps()
callbacks = dist.callbacks(steps, model_dir=model_dir, tensorboard=False)
resumed = next(c for c in callbacks if hasattr(c, "resumed_from"))
result: dict = {}
try:
    gan.fit(real, batch_size=37, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    from keras.src.random.seed_generator import global_seed_generator

    from tfdist.sync import digest

    values = ([v.numpy() for v in gan.weights] + [v.numpy() for v in gan.d_optimizer.variables]
              + [v.numpy() for v in gan.g_optimizer.variables]
              + [np.asarray(v.numpy()) for v in gan.variables if "seed" in v.path]
              + [np.asarray(global_seed_generator().state.numpy())])
    np.savez(os.path.join(out, f"state-{dist.rank}-{run}.npz"), *values)
    result["digest"] = digest(values)
finally:  # a stopped run too (fit exits with 75)
    where = resumed.resumed_from
    result.update(trained=steps.trained, resumed=None if where is None else {
        "epoch": where["epoch"], "step": where["step"], "epoch_done": where["epoch_done"]})
    with open(os.path.join(out, f"result-{dist.rank}-{run}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
