"""Keras 3 on JAX (``KERAS_BACKEND=jax``): ``dist.callbacks()`` with the options and writers that
Keras 3 on JAX used to leave alone.

    tfdist launch -n 2 jax_callbacks_worker.py OUT

One small model trains 2 epochs of 4 steps on a ``keras.utils.PyDataset`` (no TensorFlow is
needed) with ``dist.callbacks(...)``: ``warmup_epochs=1``, a ``chief_only`` callback, the user's
``ModelCheckpoint``, ``CSVLogger`` and ``BackupAndRestore`` in ``OUT``, and ``model_dir`` with
``preempt=False`` (Keras's backup per rank in ``model_dir/backup``). A probe records the learning
rate each step ran with (read from ``fit``'s state, which is what the step used) and, at each
epoch's end on the chief, the folders of ``model_dir/backup``. Each rank writes
``OUT/rank-N.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import tfdist
from tfdist.errors import ConfigError

ROWS, GLOBAL_BATCH = 64, 16


def main(out: str) -> None:
    dist = tfdist.init()
    import keras

    class Batches(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(0)
            self.x = rng.normal(size=(ROWS, 4)).astype("float32")
            self.y = self.x[:, :1] * 2 + 1

        def __len__(self) -> int:
            return ROWS // GLOBAL_BATCH

        def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
            return self.x[rows], self.y[rows]

    record: dict[str, object] = {"rates": [], "chief_only_epochs": []}
    model_dir = os.path.join(out, "model")

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            model = self._model  # not self.model: that would write fit's state back
            index = [v.path for v in model.optimizer.variables].index(
                model.optimizer._learning_rate.path)
            state = model._jax_state["optimizer_variables"]
            record["rates"].append(float(np.asarray(state[index])))  # type: ignore[attr-defined]

        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            record["backup_at_epoch_end"] = sorted(os.listdir(os.path.join(model_dir, "backup")))

    class ChiefAlone(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            record["chief_only_epochs"].append(epoch)  # type: ignore[attr-defined]

    with dist.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.08), loss="mse")
    try:
        dist.callbacks(average_batch_statistics=True)
    except ConfigError as error:
        record["refused"] = str(error)
    writers = [keras.callbacks.ModelCheckpoint(os.path.join(out, "user.keras")),
               keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
               keras.callbacks.BackupAndRestore(os.path.join(out, "user-backup"),
                                                delete_checkpoint=False)]
    callbacks = dist.callbacks(*writers, Probe(), model_dir=model_dir, preempt=False,
                               warmup_epochs=1, chief_only=[ChiefAlone()], sync_check=False,
                               tensorboard=False, throughput=False)
    record["classes"] = [type(c).__name__ for c in callbacks]
    model.fit(Batches(), epochs=2, verbose=0, callbacks=callbacks)
    record["weights"] = [np.asarray(w).tolist() for w in model.get_weights()]
    with open(os.path.join(out, f"rank-{dist.rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
