"""One worker of the replica sync check tests (tests/test_sync.py).

    python sync_worker.py OUT_DIR MODE

Modes, run as 2 workers through `tfdist launch` unless said otherwise:

* ``fit``: ``fit`` with ``dist.callbacks()``; records the steps the check ran at and its cost.
* ``desync``: the same, but rank 1 moves one weight of its own copy by one ulp after the first
  step: both ranks must stop with ReplicaMismatchError at the check after that step.
* ``custom``: a custom loop calling ``tfdist.sync.check`` (passes, then fails after rank 1
  changes its copy), then a check that only rank 0 calls, which must time out with an error.
* ``replicas``: ONE process with a 2-replica MirroredStrategy on 2 logical CPUs, standing in for
  a worker with 2 GPUs: a change to replica 1's copy must be named as "rank 0 replica 1".

The model is examples/keras_train.py's digits CNN plus a BatchNormalization layer, whose moving
statistics Keras updates per replica (they differ between workers by design and are skipped).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import tfdist

STEPS_PER_EPOCH, EPOCHS, GLOBAL_BATCH = 4, 2, 64


def main(out_dir: str, mode: str) -> None:
    out = Path(out_dir)
    if mode == "replicas":
        return _replicas(out)
    dist = tfdist.init(backend="mwms")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(3)
    with dist.scope():
        model = _model(tf.keras)
    if mode == "custom":
        return _custom(out, dist, model)
    _fit(out, dist, model, nudge=mode == "desync")


def _model(keras: Any) -> Any:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def _dataset(dist: tfdist.Distributed) -> Any:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS_PER_EPOCH * GLOBAL_BATCH, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    return dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))


def _fit(out: Path, dist: tfdist.Distributed, model: Any, nudge: bool) -> None:
    import tensorflow as tf

    from tfdist.errors import ReplicaMismatchError
    from tfdist.sync import ReplicaSyncCheck

    class Nudge(tf.keras.callbacks.Callback):
        # After the first step, just before the check that follows it (which runs after the
        # user's callbacks). Nudged before training, the ulp may not survive the step: the
        # same update can round both copies to one value (it did on some CPUs).
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if nudge and dist.rank == 1 and batch == 0:
                _nudge_local_copy(dist, model.trainable_variables[0], replica=0)

    with dist.scope():
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = dist.callbacks(Nudge())
    sync_check = next(c for c in callbacks if isinstance(c, ReplicaSyncCheck))
    try:
        model.fit(_dataset(dist), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except ReplicaMismatchError as error:
        (out / f"error-{dist.rank}.txt").write_text(str(error))
        _wait_for(out / f"error-{1 - dist.rank}.txt")  # so the launcher stops neither rank early
        raise
    _write(out, dist.rank, checked_steps=sync_check.checked_steps, seconds=sync_check.seconds,
           moving_mean=model.layers[1].moving_mean.numpy().tolist())


def _custom(out: Path, dist: tfdist.Distributed, model: Any) -> None:
    import tensorflow as tf

    from tfdist import sync
    from tfdist.errors import ReplicaMismatchError, TfdistError

    with dist.scope():
        optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(x: Any, y: Any) -> Any:
        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905
            return loss

        return dist.strategy.run(replica_step, args=(x, y))

    x, y = next(iter(dist.strategy.experimental_distribute_dataset(_dataset(dist))))
    step(x, y)
    variables = sync.model_variables(model) + list(optimizer.variables)
    start = time.perf_counter()
    sync.check(dist, variables, step=1)  # must pass: one averaged step
    seconds = time.perf_counter() - start
    if dist.rank == 1:
        _nudge_local_copy(dist, model.trainable_variables[-1], replica=0)
    mismatch = _error_of(lambda: sync.check(dist, variables, step=2), ReplicaMismatchError)
    # Written before the timeout: TensorFlow sometimes crashes while it aborts the timed-out
    # collective (SIGABRT or SIGSEGV inside its collective executor, TensorFlow 2.21), and
    # what was found up to here must reach the test either way.
    _write(out, dist.rank, seconds=seconds, mismatch=mismatch, variables=len(variables))
    if dist.rank == 0:  # the mistake: only the chief checks; rank 1 never joins
        timeout = _error_of(lambda: sync.check(dist, variables, step=3, timeout_s=3),
                            TfdistError)
        _write(out, dist.rank, name="timeout", timeout=timeout)
    else:
        _wait_for(out / "timeout-0.json")


def _replicas(out: Path) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    from tfdist import sync
    from tfdist.backends.mwms import MultiWorkerDistributed

    dist = MultiWorkerDistributed(tfdist.detect(), strategy, "ring", 0)
    from tfdist.errors import ReplicaMismatchError

    with strategy.scope():
        model = _model(tf.keras)
    variables = sync.model_variables(model)
    sync.check(dist, variables, step=1)
    _nudge_local_copy(dist, model.trainable_variables[2], replica=1)
    mismatch = _error_of(lambda: sync.check(dist, variables, step=2), ReplicaMismatchError)
    _write(out, 0, mismatch=mismatch)


def _nudge_local_copy(dist: tfdist.Distributed, variable: Any, replica: int) -> None:
    """Moves element 0 of one replica's own copy by one ulp: nothing else sees the change."""
    inner = variable.value if not callable(variable.value) else variable  # Keras 3 / tf_keras
    copy = dist.strategy.experimental_local_results(inner)[replica]
    flat = copy.numpy().reshape(-1)
    flat[0] = np.nextafter(flat[0], np.float32(np.inf))
    copy.assign(flat.reshape(copy.shape))


def _error_of(call: Any, expected: type[Exception]) -> str:
    try:
        call()
    except expected as error:
        return str(error)
    return ""


def _wait_for(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _write(out: Path, rank: int, name: str = "result", **result: Any) -> None:
    partial = out / f".{name}-{rank}.json"
    partial.write_text(json.dumps({"rank": rank, **result}))
    os.replace(partial, out / f"{name}-{rank}.json")  # atomic: the other rank polls for it


if __name__ == "__main__":
    main(*sys.argv[1:3])
