"""Train a small CNN on handwritten digits, on one process or many, unchanged.

    python examples/keras_train.py --epochs=8                       # one process
    tfdist launch -n 2 examples/keras_train.py --epochs=8 --scale_lr  # 2 local workers
    srun python examples/keras_train.py --model_dir=$SCRATCH/run1     # one Slurm task per GPU
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_train.py  # Horovod (auto)
    tfdist launch --backend horovod -n 2 examples/keras_train.py      # Horovod, no horovodrun

The data is scikit-learn's 8x8 digits (1797 images, shipped with tfdist) served through
tensorflow-datasets by a local builder: nothing is downloaded. Each change for distributed
training is marked `tfdist:`.
"""

from __future__ import annotations

import logging as std_logging
import os

from absl import app, flags, logging

import tfdist
import tfdist.datasets

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 10, "Passes over the training data.")
flags.DEFINE_integer("batch_size", 64, "GLOBAL batch size, split over all replicas.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for one replica.")
flags.DEFINE_bool("scale_lr", False, "Multiply the learning rate by the number of replicas.")
flags.DEFINE_float("warmup_epochs", 0, "Ramp the scaled learning rate up over these epochs.")
flags.DEFINE_string("model_dir", None,
                    "Checkpoints, the resumable state and TensorBoard logs go here.")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets directory ($TFDS_DATA_DIR).")
flags.DEFINE_enum("dataset", "digits", tfdist.datasets.available(), "Dataset to train on.")
flags.DEFINE_enum("backend", "auto", ["auto", "mwms", "horovod", "single"],
                  "tfdist backend: auto picks Horovod under horovodrun/mpirun, else MWMS.")
flags.DEFINE_enum("collective", "auto", ["auto", "ring", "nccl"], "All-reduce implementation.")
flags.DEFINE_integer("seed", 0, "Random seed for weights and shuffling.")


def build_model(keras):  # type: ignore[no-untyped-def]
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
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
    # tfdist: write the dataset files now; this runs no TensorFlow op.
    tfdist.datasets.prepare(FLAGS.dataset, FLAGS.data_dir)
    import tensorflow as tf

    from tfdist.sync import digest, model_variables  # these import TensorFlow: only now

    tf.get_logger().setLevel("WARNING")  # absl would show TensorFlow's per-step INFO lines
    keras = tf.keras
    keras.utils.set_random_seed(FLAGS.seed)
    # tfdist: the strategy comes first, before any dataset or model exists.
    with tfdist.strategy_scope(given("backend"), collective=given("collective")) as dist:
        model = build_model(keras)
        # tfdist: linear scaling by the number of replicas, when asked.
        lr = dist.scale_lr(FLAGS.learning_rate) if FLAGS.scale_lr else FLAGS.learning_rate
        model.compile(optimizer=keras.optimizers.Adam(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    def split(name: str, shuffle: bool, shard: bool = True) -> tf.data.Dataset:
        ds = tfdist.datasets.load(FLAGS.dataset, name, FLAGS.data_dir)
        ds = ds.map(tfdist.datasets.normalize)
        if shuffle:  # the same seed on every worker, so the shards partition the data
            # tfdist: repeated, reshuffled each pass: one iterator reads every epoch (fit's
            # steps_per_epoch below). A new iterator each epoch costs 0.1 to 1 s under MWMS.
            ds = ds.shuffle(2048, seed=FLAGS.seed).repeat()
        # tfdist: batch with the GLOBAL batch size and shard explicitly by element. Every
        # training batch is whole: a batch that does not split evenly over the replicas gives
        # no gradient one process would compute, and tfdist would say so.
        ds = ds.batch(FLAGS.batch_size, drop_remainder=shuffle).prefetch(tf.data.AUTOTUNE)
        return dist.shard(ds) if shard else ds

    train, test = split("train", shuffle=True), split("test", shuffle=False)
    if dist.is_chief:
        print(f"tfdist: {dist.world_size} worker(s), {dist.num_replicas} replica(s), backend "
              f"{dist.backend}, collective {dist.collective}, learning rate {lr:g}", flush=True)
    examples = int(tfdist.datasets.load(FLAGS.dataset, "train", FLAGS.data_dir).cardinality())
    model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=examples // FLAGS.batch_size,
              verbose=2, shuffle=False,  # shuffled above
              # tfdist: chief-only checkpoints and logs, the exact state at each epoch's end,
              # LR warmup.
              callbacks=dist.callbacks(model_dir=FLAGS.model_dir,
                                       warmup_epochs=FLAGS.warmup_epochs))
    # tfdist: each rank evaluates its shard; the metrics are over every rank's rows.
    loss, accuracy = model.evaluate(test, verbose=0, callbacks=dist.callbacks())
    # tfdist: predict returns every row, in order, on every rank (also on the split dataset).
    predicted = model.predict(test, verbose=0).argmax(axis=-1)
    labels = [int(y) for _, batch in split("test", False, shard=False) for y in batch.numpy()]
    agree = float((predicted == labels).mean())
    # tfdist: every rank prints a digest of its weights; equal digests mean bit-identical weights.
    # One write with its newline, so ranks that share an output file don't interleave lines.
    print(f"tfdist: rank {dist.rank} of {dist.world_size}: final weights "
          f"{digest(model_variables(model))}\n", end="", flush=True)
    if FLAGS.model_dir:  # tfdist: every rank calls save (it may run collectives); the chief writes
        dist.save(model, os.path.join(FLAGS.model_dir, "final.keras"))
    if dist.is_chief:  # tfdist: only the chief reports
        print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}  "
              f"(predict: {agree:.4f} on {len(labels)} images)", flush=True)


if __name__ == "__main__":
    app.run(main)
