"""2-worker fit with ``dist.callbacks(model_dir=...)`` that gets a real preemption signal.

    python preempt_worker.py OUT_DIR MODEL_DIR BACKEND SIGNAL_RANK SIGNAL_STEP [SIGNAL]

``SIGNAL_RANK`` (-1: none) sends itself ``SIGNAL`` (default USR1) after its ``SIGNAL_STEP``-th
training step (counted over all epochs) of the first run (``TFDIST_RESTART_COUNT`` 0 or unset);
``v3`` signals at the third validation batch instead, ``a`` after ``fit`` has returned (then
every rank evaluates the model, the script's last work, which the signal must not interrupt),
and ``b`` between two ``fit`` calls (one epoch, then epochs 2 and 3: the second must stop at
its first agreed step).
``PREEMPT_TEST_DROPOUT=1`` adds a Dropout layer, whose masks the resumed run must draw as the
uninterrupted one does; ``PREEMPT_TEST_LEGACY_RNG=1`` makes a Keras 2 Dropout draw from
TensorFlow's legacy stateful ops again (the control: their state is not saved).
``PREEMPT_TEST_INPUT`` picks the input: ``epochs`` (default: the dataset read once per epoch,
reshuffled each time), ``repeat`` (a repeated dataset read with ``steps_per_epoch=12``, so
epochs straddle its passes) or ``validation`` (``epochs`` with
``validation_data``). ``PREEMPT_TEST_STEP_SLEEP=S`` makes each training step S seconds longer
(a slow run for the walltime guard to stop; the weights do not change);
``PREEMPT_TEST_BATCH=B`` sets the global batch (default 32; another drops the last, short one).
``PREEMPT_TEST_WIDTH=W`` sets the hidden layer's width (default 16: another is another model).
``PREEMPT_TEST_SCALE_LR=1`` sets the learning rate with ``dist.scale_lr(0.005)`` (0.01 on 2
workers, as without it).
``PREEMPT_TEST_TIMES=1`` prints, on every rank, when its process started, when ``tfdist.init``
returned (TensorFlow imported, the strategy made), when ``fit`` was called and when the first
step ended: ``tfdist-test: rank R times started=T init=T fit=T first_step=T`` (seconds since
the epoch; tests/slurm/time_to_train.py reads them).
``PREEMPT_TEST_COUNT_ROWS=1`` adds a layer that counts the rows trained on and sums their first
feature's squares (in the model's state, so saved and resumed with it): every row trained
exactly once over the run shows as ``rows`` (count, sum) in the result.
``PREEMPT_TEST_IN_WRITE=SIGNAL:N:SECONDS`` (with ``TFDIST_BACKGROUND_SAVES=1``): in the first
run, rank SIGNAL_RANK sends itself SIGNAL (``USR1``, ``KILL``) inside its N-th background save,
on the writer thread, once its files are written and before they are made durable, then the
write goes on SECONDS later (a slow disk's stand-in); it prints ``tfdist-test: SIGNAL in
background save N on rank R``.
``PREEMPT_TEST_SOAK=SEED:CYCLES`` (with the ``validation`` input) replaces the signal arguments:
runs 0 to CYCLES-1 are each signalled (unless SIGNAL_RANK is -1) at a moment drawn from SEED
and the run's number (the same on every rank, :func:`soak_moment`), and the fit has
2 x CYCLES + 1 epochs. Every rank prints
``tfdist-test: rank R step S`` after each step, so a test can signal the launcher instead, and
writes ``result-RANK-RUN.json``: where it stopped, the steps it trained, the exit code it leaves
with, and after a finished fit a digest of its weights and optimizer state (and the weights,
``weights-RANK-RUN.npz``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np

import tfdist

SOAK_KINDS = ("step", "both", "validation", "epoch_end", "save")


def soak_moment(seed: int, run: int) -> dict[str, object]:
    """Where run ``run`` of a soak is signalled: the kinds in a shuffled order for every five
    runs (so five cycles see each once), the moment in it drawn too.

    ``step``: one rank, after its K-th step of this run; ``both``: both ranks after their K-th
    step, each its own signal (two signals at once); ``validation``: one rank at the K-th batch
    of this run's first validation; ``epoch_end``: one rank at the end of this run's first
    epoch, before the epoch's checks; ``save``: one rank while this run's first epoch-end save
    is being written (it must finish; the next agreed step stops)."""
    kinds = list(SOAK_KINDS)
    random.Random(f"{seed}-{run // len(kinds)}").shuffle(kinds)
    draw = random.Random(f"{seed}-{run}")
    return {"kind": kinds[run % len(kinds)], "rank": draw.randrange(2), "k": draw.randint(1, 8),
            "signal": draw.choice(["USR1", "TERM"])}


def RowCount(keras):  # noqa: N802 (a layer class of the Keras in use)
    """A layer that counts the rows it trains on and sums their first feature's squares."""

    class Counter(keras.layers.Layer):
        def build(self, input_shape: object) -> None:
            self.seen = self.add_weight(shape=(2,), initializer="zeros", trainable=False,
                                        name="seen")

        def call(self, x: object, training: object = None) -> object:
            if training:
                first = x[:, 0]
                self.seen.assign_add(keras.ops.stack([
                    keras.ops.cast(keras.ops.shape(x)[0], "float32"),
                    keras.ops.sum(first * first)]))
            return x

    return Counter()


def process_started() -> float:
    """When this process started (seconds since the epoch), from /proc."""
    with open("/proc/stat") as f:
        booted = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    with open("/proc/self/stat") as f:
        ticks = float(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
    return booted + ticks / os.sysconf("SC_CLK_TCK")


def main(out_dir: str, model_dir: str, backend: str, signal_rank: str, signal_step: str,
         signal_name: str = "USR1") -> None:
    times = {"started": process_started()} if os.environ.get("PREEMPT_TEST_TIMES") else None
    dist = tfdist.init(backend=backend)
    if times is not None:
        times["init"] = time.time()
    import tensorflow as tf

    from tfdist.keras.fit_preemption import PreemptionCallback

    if backend == "jax":  # Keras 3 on JAX (KERAS_BACKEND=jax); the input is tf.data's all the same
        import keras
    else:
        keras = tf.keras
    keras.utils.set_random_seed(7)
    # tfdist launch and tfdist survive count the runs; a requeued Slurm job, SLURM_RESTART_COUNT
    run = int(os.environ.get("TFDIST_RESTART_COUNT", dist.environment.restart_count))
    validating = signal_step.startswith("v")
    after_fit, between_fits = signal_step == "a", signal_step == "b"
    target = int(signal_step.lstrip("vab") or "0") if int(
        signal_rank) == dist.rank and run == 0 else None
    mode = os.environ.get("PREEMPT_TEST_INPUT", "epochs")
    soak = os.environ.get("PREEMPT_TEST_SOAK")
    seed, cycles = (int(v) for v in soak.split(":")) if soak else (0, 0)
    signalled = run < cycles and signal_rank != "-1"  # -1: the uninterrupted run
    moment = soak_moment(seed, run) if signalled else {"kind": None}
    if soak:
        target = None  # the soak's moments only
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    if os.environ.get("PREEMPT_TEST_LEGACY_RNG") == "1":
        keras.backend.experimental.disable_tf_random_generator()  # undoes tfdist's, Keras 2
    dropout = [keras.layers.Dropout(0.3)] if os.environ.get("PREEMPT_TEST_DROPOUT") == "1" else []
    counting = [RowCount(keras)] if os.environ.get("PREEMPT_TEST_COUNT_ROWS") == "1" else []
    width = int(os.environ.get("PREEMPT_TEST_WIDTH", "16"))
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), *counting,
                                  keras.layers.Dense(width, activation="relu"),
                                  *dropout, keras.layers.Dense(2)])
        # 0.01 as 0.005 scaled by 2 replicas: the same on 2 workers, 0.005 on one.
        rate = dist.scale_lr(0.005) if os.environ.get("PREEMPT_TEST_SCALE_LR") == "1" else 0.01
        model.compile(optimizer=keras.optimizers.Adam(rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = int(os.environ.get("PREEMPT_TEST_BATCH", "32"))  # 48 divides over 3 and 2 workers
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=1).batch(
        batch, drop_remainder=batch != 32)
    fit_args: dict[str, object] = {}
    if mode == "repeat":
        dataset, fit_args["steps_per_epoch"] = dataset.repeat(), 12
    elif mode == "validation":
        fit_args["validation_data"] = dist.shard(
            tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(32))
    steps = {"done": 0, "tested": 0, "epochs_ended": 0}
    step_sleep = float(os.environ.get("PREEMPT_TEST_STEP_SLEEP", "0"))

    def soak_signal(kind: str, count: int) -> None:
        """Signals this rank if the soak's moment for this run is ``kind`` at ``count``."""
        if moment["kind"] != kind or count != (1 if kind in ("epoch_end", "save")
                                               else moment["k"]):
            return
        if kind == "both":  # two signals at once: each rank its own
            name = "TERM" if dist.rank == 0 else "USR1"
        elif moment["rank"] == dist.rank:
            name = str(moment["signal"])
        else:
            return
        print(f"tfdist-test: soak run {run}: {kind} SIG{name} on rank {dist.rank}", flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))

    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            steps["done"] += 1
            if times is not None and "first_step" not in times:
                times["first_step"] = time.time()
                print(f"tfdist-test: rank {dist.rank} times " + " ".join(
                    f"{name}={value:.3f}" for name, value in times.items()), flush=True)
            print(f"tfdist-test: rank {dist.rank} step {steps['done']}", flush=True)
            time.sleep(step_sleep)
            if steps["done"] == target and not validating:
                os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
            soak_signal("step", steps["done"])
            soak_signal("both", steps["done"])

        def on_test_batch_end(self, batch: int, logs: object = None) -> None:
            steps["tested"] += 1
            if steps["tested"] == target and validating:
                os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
            soak_signal("validation", steps["tested"])

        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            steps["epochs_ended"] += 1
            soak_signal("epoch_end", steps["epochs_ended"])

    callbacks = dist.callbacks(Announce(), model_dir=model_dir, tensorboard=False)
    watcher = next(c for c in callbacks if isinstance(c, PreemptionCallback))
    if moment["kind"] == "save":  # the signal comes while the epoch's save is being written
        from tfdist.keras import fit_preemption

        saving_model = fit_preemption.save_model

        def save(*args: object, **kwargs: object) -> bool:
            wrote = saving_model(*args, **kwargs)  # type: ignore[arg-type]
            soak_signal("save", steps["epochs_ended"])  # before this rank's random states
            return wrote

        fit_preemption.save_model = save  # type: ignore[assignment]
    in_write = os.environ.get("PREEMPT_TEST_IN_WRITE")
    if in_write and run == 0 and int(signal_rank) == dist.rank:
        signal_in_write(in_write, dist.rank)
    epochs = 2 * cycles + 1 if soak else 3  # room for every moment: a run uses at most 1.5
    result = {"rank": dist.rank, "run": run, "code": 0}
    if times is not None:
        times["fit"] = time.time()
    try:
        if between_fits:
            model.fit(dist.shard(dataset), epochs=1, verbose=0, callbacks=callbacks, **fit_args)
            if target is not None:
                os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
            model.fit(dist.shard(dataset), epochs=3, initial_epoch=1, verbose=0,
                      callbacks=callbacks, **fit_args)
        else:
            model.fit(dist.shard(dataset), epochs=epochs, verbose=0, callbacks=callbacks,
                      **fit_args)
        if after_fit:
            if target is not None:
                os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
            result["evaluated"] = float(model.evaluate(dist.shard(dataset), verbose=0))
        from tfdist.sync import digest, model_variables

        result["digest"] = digest(model_variables(model, include_optimizer=True))
        result["iterations"] = int(np.asarray(model.optimizer.iterations.numpy()))
        if counting:
            result["rows"] = [float(v) for v in np.asarray(counting[0].seen.numpy())]
        np.savez(os.path.join(out_dir, f"weights-{dist.rank}-{run}.npz"),
                 *[np.asarray(w) for w in model.get_weights()])
    except SystemExit as exit_:
        result["code"] = exit_.code
        raise
    except Exception as error:  # recorded, so a run that failed and was restarted shows why
        result["code"] = f"{type(error).__name__}: {error}"[:2000]
        raise
    finally:
        result.update(epoch=watcher.epoch, step=watcher.step, steps=steps["done"],
                      tested=steps["tested"],
                      checks=watcher.watch.checks, resumed=watcher.resumed_from is not None
                      or run > 0,
                      signal=watcher.watch.signal.name if watcher.watch.signal else None)
        with open(os.path.join(out_dir, f"result-{dist.rank}-{run}.json"), "w") as f:
            json.dump(result, f)


def signal_in_write(spec: str, rank: int) -> None:
    """``PREEMPT_TEST_IN_WRITE``: the signal inside the N-th background save's write."""
    from tfdist import background

    name, number, seconds = spec.split(":")
    writes = {"count": 0}
    durable = background.fsync_folder

    def fsync_folder(folder: str) -> None:
        writes["count"] += 1
        if writes["count"] == int(number):
            print(f"tfdist-test: {name} in background save {number} on rank {rank}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
            time.sleep(float(seconds))
        durable(folder)

    background.fsync_folder = fsync_folder  # type: ignore[assignment]


if __name__ == "__main__":
    main(*sys.argv[1:])
