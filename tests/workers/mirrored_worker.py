"""One process training a small model under tfdist; writes what the mirrored tests compare.

    python mirrored_worker.py OUT GLOBAL_BATCH
    python -m tfdist launch -n 2 mirrored_worker.py OUT GLOBAL_BATCH

Writes OUT/result.json (backend, replicas, whether every variable's per-device copies are
identical, for a dense net and a BatchNormalization net), OUT/weights.npz (the dense net's
final weights), OUT/batch_norm.npz (the BatchNormalization net's, moving statistics included)
and OUT/initial.npz; with several workers, each rank writes to OUT/rank-R. The backend and
replicas come from TFDIST_* variables, as a user sets them. ``MIRRORED_TEST_CONTROL=1`` then
trains the BatchNormalization net once more, last, from the same start with
``TFDIST_AVERAGE_BATCH_STATISTICS=0`` set (the control: each device keeps the statistics of its
own examples), written to OUT/control.npz and its copies' equality to result.json's
``control_copies_equal``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import tfdist


def per_device_copies_equal(model) -> bool:  # type: ignore[no-untyped-def]
    from tfdist.sync import model_variables

    for variable in model_variables(model, include_optimizer=True,
                                    include_batch_statistics=True):
        tf_variable = getattr(variable, "value", variable)  # Keras 3 wraps a tf.Variable
        copies = [np.asarray(c) for c in getattr(tf_variable, "values", (tf_variable,))]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


def main() -> None:
    out, global_batch = Path(sys.argv[1]), int(sys.argv[2])
    dist = tfdist.init()
    if dist.world_size > 1:
        out = out / f"rank-{dist.rank}"
        out.mkdir(parents=True, exist_ok=True)
    import tensorflow as tf

    keras = tf.keras
    control = os.environ.get("MIRRORED_TEST_CONTROL") == "1"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) > 0).astype("int64")
    data = dist.shard(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))
    nets = {}
    for name in ("dense", "batch_norm", *(["control"] if control else [])):
        keras.utils.set_random_seed(0)
        with dist.scope():
            layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu")]
            if name != "dense":
                layers.append(keras.layers.BatchNormalization())
            model = keras.Sequential([*layers, keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = [np.array(w) for w in model.get_weights()]
        if name == "control":  # the last net: as a user turns the average off
            os.environ["TFDIST_AVERAGE_BATCH_STATISTICS"] = "0"
        model.fit(data, epochs=3, verbose=0, callbacks=dist.callbacks(throughput=False))
        nets[name] = (model, initial)
    dense, initial = nets["dense"]
    np.savez(out / "weights.npz", **{f"w{i}": w for i, w in enumerate(dense.get_weights())})
    np.savez(out / "initial.npz", **{f"w{i}": w for i, w in enumerate(initial)})
    np.savez(out / "batch_norm.npz",
             **{f"w{i}": w for i, w in enumerate(nets["batch_norm"][0].get_weights())})
    result = {"backend": dist.backend, "world_size": dist.world_size,
              "num_replicas": dist.num_replicas,
              "local_replicas": dist.local_replicas, "lr_scaled": dist.scale_lr(1.0),
              "copies_equal": {name: per_device_copies_equal(nets[name][0])
                               for name in ("dense", "batch_norm")}}
    if control:
        np.savez(out / "control.npz",
                 **{f"w{i}": w for i, w in enumerate(nets["control"][0].get_weights())})
        result["control_copies_equal"] = per_device_copies_equal(nets["control"][0])
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
