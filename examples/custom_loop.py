"""A custom training loop that runs unchanged under MultiWorkerMirroredStrategy and Horovod.

    tfdist launch -n 2 examples/custom_loop.py --epochs=6                      # MWMS
    tfdist launch --backend horovod -n 2 examples/custom_loop.py --epochs=6    # Horovod (Gloo)
    horovodrun -np 2 -H localhost:2 --gloo python examples/custom_loop.py      # Horovod (auto)
    srun python examples/custom_loop.py --backend=horovod                      # Slurm + Horovod

With ``--model_dir`` a preempted run (SIGTERM, SIGUSR1 from ``--signal=USR1@...``) stops every
rank at one agreed step, saves the model, optimizer and position there, exits 75 (the job is
requeued), and the next run resumes at that step.

The step is written the tf.distribute way: ``strategy.run`` on each replica, the loss divided by
the GLOBAL batch size, gradients summed across replicas. Under MWMS ``apply_gradients`` sums them;
under Horovod the strategy is TensorFlow's default one and ``dist.gradient_tape()`` sums them
with Horovod's all-reduce (also for Keras 3 variables, which hvd.DistributedGradientTape cannot
take). Each change for distributed training is marked `tfdist:`.
"""

from __future__ import annotations

import contextlib
import logging as std_logging

from absl import app, flags, logging

import tfdist
import tfdist.datasets

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 6, "Passes over the training data.")
flags.DEFINE_integer("batch_size", 64, "GLOBAL batch size, split over all replicas.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for one replica.")
flags.DEFINE_bool("scale_lr", False, "Multiply the learning rate by the number of replicas.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets directory ($TFDS_DATA_DIR).")
flags.DEFINE_enum("dataset", "digits", tfdist.datasets.available(), "Dataset to train on.")
flags.DEFINE_enum("backend", "auto", ["auto", "mwms", "horovod", "single"],
                  "tfdist backend: auto picks Horovod under horovodrun/mpirun, else MWMS.")
flags.DEFINE_enum("collective", "auto", ["auto", "ring", "nccl"], "All-reduce implementation.")
flags.DEFINE_integer("seed", 0, "Random seed for weights and shuffling.")
flags.DEFINE_string("model_dir", None, "Where a preempted run saves its state and the next "
                    "run resumes from (none: no preemption handling).")


def build_model(keras):  # type: ignore[no-untyped-def]
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def given(name: str) -> str | None:
    """A flag's value if the user set it, so TFDIST_* variables still apply otherwise."""
    return FLAGS[name].value if FLAGS[name].present else None


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:  # libraries' INFO logs off, tfdist's on (-v 0: all)
        logging.set_verbosity(logging.WARNING)
        std_logging.getLogger("tfdist").setLevel(std_logging.INFO)
    tfdist.detect()  # tfdist: a launch that cannot train fails now, before TensorFlow loads
    train()


def train() -> None:
    tfdist.datasets.prepare(FLAGS.dataset, FLAGS.data_dir)  # runs no TensorFlow op
    import tensorflow as tf

    from tfdist import sync

    tf.get_logger().setLevel("WARNING")
    keras = tf.keras
    keras.utils.set_random_seed(FLAGS.seed)
    # tfdist: the strategy (or Horovod) first, before any dataset or model exists.
    with tfdist.strategy_scope(given("backend"), collective=given("collective")) as dist:
        model = build_model(keras)
        lr = dist.scale_lr(FLAGS.learning_rate) if FLAGS.scale_lr else FLAGS.learning_rate
        optimizer = keras.optimizers.Adam(lr)
        per_example_loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none")
    strategy = dist.strategy
    # tfdist: Horovod copies rank 0's weights and optimizer state (MWMS already did).
    dist.broadcast_initial_state(model, optimizer)

    def split(name: str, shuffle: bool):  # type: ignore[no-untyped-def]
        ds = tfdist.datasets.load(FLAGS.dataset, name, FLAGS.data_dir)
        ds = ds.map(tfdist.datasets.normalize)
        if shuffle:
            ds = ds.shuffle(2048, seed=FLAGS.seed)
        # tfdist: the GLOBAL batch, this rank's share of it.
        return strategy.experimental_distribute_dataset(dist.shard(ds.batch(FLAGS.batch_size)))

    def counts(labels, logits):  # type: ignore[no-untyped-def]
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), labels), tf.float32))
        return correct, tf.cast(tf.shape(labels)[0], tf.float32)

    @tf.function(reduce_retracing=True)
    def train_step(images, labels):  # type: ignore[no-untyped-def]
        def replica_step(images, labels):  # type: ignore[no-untyped-def]
            with dist.gradient_tape() as tape:  # tfdist: sums gradients across ranks
                logits = model(images, training=True)
                loss = tf.nn.compute_average_loss(per_example_loss(labels, logits),
                                                  global_batch_size=FLAGS.batch_size)
            grads = tape.gradient(loss, model.trainable_variables)
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B905
            return (loss, *counts(labels, logits))

        # tfdist: job-wide sums, from strategy.reduce or Horovod's all-reduce.
        return dist.reduce("sum", strategy.run(replica_step, args=(images, labels)))

    @tf.function(reduce_retracing=True)
    def test_step(images, labels):  # type: ignore[no-untyped-def]
        def replica_step(images, labels):  # type: ignore[no-untyped-def]
            return counts(labels, model(images, training=False))

        return dist.reduce("sum", strategy.run(replica_step, args=(images, labels)))

    train, test = split("train", shuffle=True), split("test", shuffle=False)
    if dist.is_chief:
        print(f"tfdist: {dist.world_size} worker(s), {dist.num_replicas} replica(s), backend "
              f"{dist.backend}, collective {dist.collective}, learning rate {lr:g}", flush=True)
    # tfdist: a preempted run saved where it stopped; None on a first run.
    position = dist.load_state(FLAGS.model_dir, model=model, optimizer=optimizer)
    first_epoch, done = (position["epoch"], position["step"]) if position else (0, 0)
    for _ in range(first_epoch):
        iter(train)  # each epoch's iterator reshuffles: make the ones the stopped run made
    # tfdist: with --model_dir, every rank learns of a preemption signal at the same step.
    watch = dist.preemption() if FLAGS.model_dir else contextlib.nullcontext()
    with watch as stop:
        for epoch in range(first_epoch, FLAGS.epochs):
            losses, correct, seen = [], 0.0, 0.0
            for step, (images, labels) in enumerate(train, start=1):
                if step <= done:
                    continue  # trained before the preemption
                loss, right, count = train_step(images, labels)
                losses.append(float(loss))
                correct, seen = correct + float(right), seen + float(count)
                if epoch == 0 and step == 1:  # tfdist: every rank holds the same weights
                    sync.check(dist, sync.model_variables(model), step=1)
                if stop is not None and stop.step():
                    dist.save_state(FLAGS.model_dir, {"epoch": epoch, "step": step},
                                    model=model, optimizer=optimizer)
                    dist.exit_preempted()  # the chief requeues the Slurm job; exit code 75
            done = 0
            if dist.is_chief and losses:
                print(f"epoch {epoch + 1}/{FLAGS.epochs}  loss {sum(losses) / len(losses):.4f}"
                      f"  accuracy {correct / seen:.4f}", flush=True)
    right_total, seen_total = 0.0, 0.0
    for images, labels in test:
        right, count = test_step(images, labels)
        right_total, seen_total = right_total + float(right), seen_total + float(count)
    if dist.is_chief:
        print(f"test accuracy {right_total / seen_total:.4f} on {int(seen_total)} images",
              flush=True)


if __name__ == "__main__":
    app.run(main)
