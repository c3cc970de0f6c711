"""One worker of the multi-process tests: trains a small model and saves its final weights.

    python train_worker.py OUT_DIR {fit,custom} {dist,control,stock} [{mwms,horovod}]

``dist`` trains through tfdist's backend (MultiWorkerMirroredStrategy by default, or Horovod):
gradients are averaged across workers, and each worker seeds its initial weights differently,
so rank 0's must be broadcast. ``control`` trains each worker alone on its own shard of the data
(backend "single", the same seed), the same steps without averaging: its weights must differ
between workers, or the test could not tell averaging from no averaging. ``stock`` (Horovod,
fit, Keras 3) wraps the optimizer in horovod.tensorflow.keras's own DistributedOptimizer, which
silently does not average under Keras 3: tfdist's replica sync check must stop it.

The custom loop is the same under both backends: strategy.run, ``dist.gradient_tape()`` (a
plain tape under MWMS, a summing all-reduce under Horovod), ``dist.reduce``. Runs under any
launcher (tfdist launch, horovodrun, mpirun, srun variables). A failure is written to
result-RANK.json as ``{"error": ...}`` and exits 3. The result also holds the patches the
process installed and those the inventory plans for it (``patches``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

import tfdist
from tfdist import patches
from tfdist.keras import iterators, versions


def main(out_dir: str, loop: str, mode: str, backend: str = "mwms") -> None:
    rank = tfdist.detect().rank
    try:
        result = train(out_dir, loop, mode, backend, rank)
    except Exception as error:
        _write(out_dir, rank, {"rank": rank, "error": f"{type(error).__name__}: {error}"})
        traceback.print_exc()
        sys.exit(3)
    _write(out_dir, rank, result)


def train(out_dir: str, loop: str, mode: str, backend: str, rank: int) -> dict:
    dist = tfdist.init(backend="single" if mode == "control" else backend)
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(100 if mode == "control" else 100 + rank)
    x, y = _data()
    global_batch = 32
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.05)
        if mode == "stock":
            import horovod.tensorflow.keras as hvd_keras

            optimizer = hvd_keras.DistributedOptimizer(optimizer)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if mode == "control":  # this worker's half of the data in batches of half the size:
        dataset = dataset.shard(2, rank)  # the same steps as in dist mode, minus averaging
        global_batch //= 2
    freed: dict = {}
    watched = None
    if loop == "fit":
        with dist.scope():
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        watched = _watch_iterators() if dist.backend == "mwms" else None
        history = model.fit(dist.shard(dataset.batch(global_batch)), epochs=3, verbose=0,
                            callbacks=dist.callbacks())
        losses = [float(v) for v in history.history["loss"]]
    else:
        losses = _custom_loop(dist, model, optimizer, dataset.batch(global_batch), global_batch)
    weights = {f"w{i}": v.numpy() for i, v in enumerate(model.trainable_variables)}
    np.savez(os.path.join(out_dir, f"weights-{rank}.npz"), **weights)
    if watched is not None:
        freed = _three_ways(dist, model, x, y, global_batch, watched)
    return {"rank": rank, "size": dist.world_size, "backend": dist.backend,
            "collective": dist.collective, "launcher": dist.environment.launcher,
            "keras3": versions.is_keras3(keras), "losses": losses, "iterators": freed,
            "patches": _patches()}


def _patches() -> dict:
    """The patches this process installed, in order, and those the inventory plans for its
    launch (tfdist.patches.plan), by phase: the tests hold the two together."""
    where = patches.plan()
    assert where is not None, "tfdist.init installed no patches"
    return {"installed": [p.key for p in patches.installed()],
            "planned": {phase: [p.key for p in patches.planned(where, phase)]
                        for phase in patches.PHASES}}


def _three_ways(dist, model, x, y, global_batch, watched) -> dict:  # type: ignore[no-untyped-def]
    """Fits 3 epochs over a dataset reshuffled every epoch, from the same weights, three ways:
    ``tfdist`` as installed (the iterator Keras 3 makes at an epoch's end and drops unread is
    a stand-in: tfdist.keras.input_position.SeedsOnly), ``keras`` with every iterator Keras asks for
    made, and the control ``no-seeds``, whose stand-in draws no seeds (other orders). Each way:
    its weights' digest, the distributed iterators made and the threads that freed them (each
    one freed is named once: one made and not freed after fit would be a leak), the kinds
    of iterator each worker read through, and how many tf.data iterators were freed on
    tfdist's thread (tfdist.keras.iterators). Then ``your-options``: the kinds of a distributed
    iterator of the same strategy for the same batches distributed with options of one's own
    (the control: TensorFlow's multi-device iterator)."""
    import tensorflow as tf

    from tfdist.keras import input_position
    from tfdist.sync import digest, model_variables

    start = model.get_weights()

    def fit() -> dict:
        model.set_weights(start)
        tf.random.set_seed(7)
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1)
        watched.update(made=0, freed_on=[], kinds=set(), round=watched["round"] + 1)
        before = iterators.freed(wait_s=10)
        model.fit(dist.shard(data.batch(global_batch)), epochs=3, verbose=0)
        return {"weights": digest(model_variables(model)), **_freed(watched),
                "kinds": sorted(watched["kinds"]),
                "freed_elsewhere": iterators.freed(wait_s=10) - before}

    ways = {"tfdist": fit()}
    seeds_only = input_position.seeds_only
    try:
        input_position.seeds_only = lambda data: None
        ways["keras"] = fit()
        input_position.seeds_only = lambda data: iter(())
        ways["no-seeds"] = fit()
    finally:
        input_position.seeds_only = seeds_only
    batches = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))
    own = iter(dist.strategy.experimental_distribute_dataset(batches, tf.distribute.InputOptions()))
    ways["your-options"] = {"kinds": sorted({type(w._iterator).__name__ for w in own._iterators})}
    return ways


def _watch_iterators() -> dict:
    """Counts the distributed iterators made from now on, notes the kind each worker reads
    through, and names the thread that frees each one's per-worker iterator."""
    import threading
    import weakref

    from tensorflow.python.distribute import input_lib

    watched: dict = {"made": 0, "freed_on": [], "kinds": set(), "round": 0}
    make = input_lib.DistributedDataset.__iter__

    def __iter__(self):  # type: ignore[no-untyped-def]  # noqa: N807
        iterator = make(self)
        watched["made"] += 1
        made_in = watched["round"]  # an iterator of an earlier fit may be freed during this one

        def freed() -> None:
            if watched["round"] == made_in:
                watched["freed_on"].append(threading.current_thread().name)

        for worker in iterator._iterators:
            watched["kinds"].add(type(worker._iterator).__name__)
            weakref.finalize(worker._iterator, freed)
        return iterator

    input_lib.DistributedDataset.__iter__ = __iter__
    return watched


def _freed(watched: dict, wait_s: float = 20.0) -> dict:
    """``watched`` once every iterator made is freed (or ``wait_s`` passed)."""
    import time

    deadline = time.monotonic() + wait_s
    while len(watched["freed_on"]) < watched["made"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"made": watched["made"], "freed_on": list(watched["freed_on"])}


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def _custom_loop(dist, model, optimizer, dataset, global_batch):  # type: ignore[no-untyped-def]
    import tensorflow as tf

    from tfdist import sync

    strategy = dist.strategy
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
    distributed = strategy.experimental_distribute_dataset(dist.shard(dataset))
    dist.broadcast_initial_state(model, optimizer)

    @tf.function(reduce_retracing=True)
    def step(x, y):  # type: ignore[no-untyped-def]
        def replica_step(x, y):  # type: ignore[no-untyped-def]
            with dist.gradient_tape() as tape:
                loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905
            return loss

        return dist.reduce("sum", strategy.run(replica_step, args=(x, y)))

    losses = []
    for epoch in range(3):
        total = []
        for x, y in distributed:
            total.append(float(step(x, y)))
            if epoch == 0 and len(total) == 1:
                sync.check(dist, sync.model_variables(model), step=1)
        losses.append(sum(total) / len(total))
    return losses


def _write(out_dir: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
