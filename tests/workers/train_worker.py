"""One worker of the multi-process tests: trains a small model and saves its final weights.

    python train_worker.py OUT_DIR {fit,custom} {dist,control}

``dist`` trains through tfdist (gradients averaged across workers); ``control`` trains each
worker alone on its own shard of the data, the same steps without averaging: its weights must
differ between workers, or the test could not tell averaging from no averaging.
In ``dist`` mode each worker seeds its initial weights differently: the strategy must broadcast
rank 0's. In ``control`` mode both start from the same weights, so only the missing averaging
can make them differ.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import tfdist


def main(out_dir: str, loop: str, mode: str) -> None:
    rank = tfdist.detect().rank
    dist = tfdist.init(backend="mwms" if mode == "dist" else "single")
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(100 + rank if mode == "dist" else 100)
    x, y = _data()
    global_batch = 32
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.05)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if mode == "control":  # this worker's half of the data in batches of half the size:
        dataset = dataset.shard(2, rank)  # the same steps as in dist mode, minus averaging
        global_batch //= 2
    if loop == "fit":
        with dist.scope():
            model.compile(optimizer=optimizer, loss=loss)
        history = model.fit(dist.shard(dataset.batch(global_batch)), epochs=3, verbose=0)
        losses = [float(v) for v in history.history["loss"]]
    else:
        losses = _custom_loop(dist, model, optimizer, dataset.batch(global_batch), global_batch)
    weights = {f"w{i}": v.numpy() for i, v in enumerate(model.trainable_variables)}
    np.savez(os.path.join(out_dir, f"weights-{rank}.npz"), **weights)
    with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": dist.size, "backend": dist.backend,
                   "launcher": dist.environment.launcher, "losses": losses}, f)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def _custom_loop(dist: tfdist.Distributed, model, optimizer, dataset, global_batch):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    strategy = dist.strategy
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
    distributed = strategy.experimental_distribute_dataset(dist.shard(dataset))

    @tf.function
    def step(x, y):  # type: ignore[no-untyped-def]
        def replica_step(x, y):  # type: ignore[no-untyped-def]
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    losses = []
    for _ in range(3):
        total = [float(step(x, y)) for x, y in distributed]
        losses.append(sum(total) / len(total))
    return losses


if __name__ == "__main__":
    main(*sys.argv[1:4])
