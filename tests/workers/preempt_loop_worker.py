"""A 2-worker custom training loop that gets a real preemption signal, as a user writes one with
``dist.preemption()``, ``dist.save_state``, ``dist.load_state`` and ``dist.exit_preempted``.

    python preempt_loop_worker.py OUT_DIR MODEL_DIR BACKEND SIGNAL_RANK SIGNAL_STEP

``SIGNAL_RANK`` (-1: none) sends itself SIGUSR1 after its ``SIGNAL_STEP``-th step (over all
epochs) of the first run. Writes ``result-RANK-RUN.json`` as preempt_worker.py does.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

import tfdist

EPOCHS, GLOBAL_BATCH = 3, 32


def main(out_dir: str, model_dir: str, backend: str, signal_rank: str, signal_step: str) -> None:
    dist = tfdist.init(backend=backend)
    import tensorflow as tf

    from tfdist.sync import digest, model_variables

    keras = tf.keras
    keras.utils.set_random_seed(7)
    run = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))
    target = int(signal_step) if int(signal_rank) == dist.rank and run == 0 else None
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    with dist.scope():
        # Dropout: the resumed run must draw the masks the uninterrupted one draws.
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(0.3), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction="none")
    strategy = dist.strategy
    dist.broadcast_initial_state(model, optimizer)
    dataset = strategy.experimental_distribute_dataset(dist.shard(
        tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=1).batch(GLOBAL_BATCH)))

    @tf.function
    def train_step(features, labels):  # type: ignore[no-untyped-def]
        def replica_step(features, labels):  # type: ignore[no-untyped-def]
            with dist.gradient_tape() as tape:
                logits = model(features, training=True)
                loss = tf.nn.compute_average_loss(per_example(labels, logits),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905

        strategy.run(replica_step, args=(features, labels))

    # What a user writes: restore (None on the first run), skip what was trained, and save at
    # the agreed step.
    position = dist.load_state(model_dir, model=model, optimizer=optimizer)
    first_epoch, done_in_epoch = (position["epoch"], position["step"]) if position else (0, 0)
    for _ in range(first_epoch):
        iter(dataset)  # each epoch's iterator reshuffles: make the ones the stopped run made
    trained = 0
    result = {"rank": dist.rank, "run": run, "code": 0, "resumed": position is not None}
    try:
        with dist.preemption(check_seconds=0.02) as stop:
            for epoch in range(first_epoch, EPOCHS):
                for step, (features, labels) in enumerate(dataset, start=1):
                    if step <= done_in_epoch:
                        continue  # trained before the preemption
                    train_step(features, labels)
                    trained += 1
                    result.update(epoch=epoch, step=step)
                    if trained == target:
                        os.kill(os.getpid(), signal.SIGUSR1)
                    if stop.step():
                        dist.save_state(model_dir, {"epoch": epoch, "step": step},
                                        model=model, optimizer=optimizer)
                        dist.exit_preempted()
                done_in_epoch = 0
        result["digest"] = digest(model_variables(model, include_optimizer=True))
    except SystemExit as exit_:
        result["code"] = exit_.code
        raise
    finally:
        result.update(steps=trained, checks=stop.checks)
        with open(os.path.join(out_dir, f"result-{dist.rank}-{run}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
