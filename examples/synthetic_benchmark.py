"""Horovod's TensorFlow 2 synthetic benchmark, on tfdist: the same flags, the same output.

A port of ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` from the Horovod
repository (Apache 2.0), which HPC tutorials run on 1 to 16 GPUs to measure images/s and
scaling. The model comes from ``keras.applications`` with random weights (``weights=None``), the
data is one random batch, and the step is a custom loop. Only what tfdist needs changed, each
marked `tfdist:`; it runs under MWMS or Horovod, whichever the launch picks:

    tfdist launch -n 2 examples/synthetic_benchmark.py --model ResNet50 --no-cuda   # MWMS, CPU
    tfdist launch --backend horovod -n 2 examples/synthetic_benchmark.py            # Horovod
    horovodrun -np 16 -H n1:4,n2:4,n3:4,n4:4 python examples/synthetic_benchmark.py
    srun python examples/synthetic_benchmark.py            # one task per GPU: MWMS with NCCL

``--image-size`` (default 224, as the original) makes CPU runs short: ``--image-size 32``.
"""

from __future__ import annotations

import logging as std_logging
import os
import timeit

import numpy as np
from absl import app, flags, logging

import tfdist

FLAGS = flags.FLAGS
flags.DEFINE_bool("fp16-allreduce", False, "use fp16 compression during allreduce (Horovod)")
flags.DEFINE_string("model", "ResNet50", "model to benchmark (a keras.applications name)")
flags.DEFINE_integer("batch-size", 32, "input batch size (per worker)")
flags.DEFINE_integer("num-warmup-batches", 10,
                     "number of warm-up batches that don't count towards benchmark")
flags.DEFINE_integer("num-batches-per-iter", 10, "number of batches per benchmark iteration")
flags.DEFINE_integer("num-iters", 10, "number of benchmark iterations")
flags.DEFINE_bool("no-cuda", False, "disables CUDA training")
flags.DEFINE_integer("image-size", 224, "height and width of the images (tfdist: new)")


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:  # libraries' INFO logs off, tfdist's on (-v 0: all)
        logging.set_verbosity(logging.WARNING)
        std_logging.getLogger("tfdist").setLevel(std_logging.INFO)
    if FLAGS["no-cuda"].value:
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    # tfdist: instead of hvd.init() and the GPU pinning: one GPU per process, MWMS or Horovod
    # as launched.
    dist = tfdist.init()
    benchmark(dist)


def benchmark(dist: tfdist.Distributed) -> None:
    import tensorflow as tf

    tf.get_logger().setLevel("WARNING")
    keras = tf.keras
    batch, size = FLAGS["batch-size"].value, FLAGS["image-size"].value
    if FLAGS["fp16-allreduce"].value and dist.backend != "horovod":
        log(dist, "tfdist: --fp16-allreduce is Horovod's compression; MWMS all-reduces in fp32")
    # Set up standard model. tfdist: inside the strategy's scope.
    with dist.scope():
        model = getattr(keras.applications, FLAGS.model)(
            weights=None, input_shape=(size, size, 3))
        opt = keras.optimizers.SGD(0.01)
    dist.broadcast_initial_state(model, opt)  # tfdist: Horovod copies rank 0's (MWMS did)

    data = tf.random.uniform([batch, size, size, 3])
    target = tf.random.uniform([batch, 1], minval=0, maxval=999, dtype=tf.int64)
    compression = "fp16" if FLAGS["fp16-allreduce"].value else None

    @tf.function
    def benchmark_step() -> None:
        def replica_step() -> None:
            # tfdist: the tape sums the gradients over the ranks (Horovod's all-reduce, or
            # MWMS's in apply_gradients); the loss is divided by the global batch.
            with dist.gradient_tape(compression=compression) as tape:
                probs = model(data, training=True)
                loss = tf.nn.compute_average_loss(
                    keras.losses.sparse_categorical_crossentropy(target, probs),
                    global_batch_size=batch * dist.num_replicas)
            gradients = tape.gradient(loss, model.trainable_variables)
            # No strict=: TensorFlow 2.12's autograph, which converts this zip, takes none.
            opt.apply_gradients(zip(gradients, model.trainable_variables))  # noqa: B905

        dist.strategy.run(replica_step)

    log(dist, f"Model: {FLAGS.model}")
    log(dist, f"Batch size: {batch}")
    device = "GPU" if dist.num_gpus else "CPU"
    log(dist, f"Number of {device}s: {dist.num_replicas}")

    # Warm-up
    log(dist, "Running warmup...")
    timeit.timeit(benchmark_step, number=max(1, FLAGS["num-warmup-batches"].value))

    # Benchmark
    log(dist, "Running benchmark...")
    img_secs = []
    per_iter = FLAGS["num-batches-per-iter"].value
    for x in range(FLAGS["num-iters"].value):
        time = timeit.timeit(benchmark_step, number=per_iter)
        img_sec = batch * per_iter / time
        log(dist, f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(dist, f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(dist, f"Total img/sec on {dist.num_replicas} {device}(s): "
              f"{dist.num_replicas * img_sec_mean:.1f} +-{dist.num_replicas * img_sec_conf:.1f}")
    # tfdist: every rank prints a digest of its weights; equal digests, identical weights.
    from tfdist.sync import digest, model_variables

    print(f"tfdist: rank {dist.rank} of {dist.world_size}: final weights "
          f"{digest(model_variables(model))}\n", end="", flush=True)


def log(dist: tfdist.Distributed, text: str) -> None:
    if dist.is_chief:  # the original prints on rank 0 only
        print(text, flush=True)


if __name__ == "__main__":
    app.run(main)
