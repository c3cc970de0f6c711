"""A script's own saves on every rank, each loaded at once (tests/test_saves.py).

    python saves_worker.py OUT_DIR

Every rank builds a tiny Keras model in the scope and fits it one epoch with a
``ModelCheckpoint`` passed straight to ``fit`` (tfdist's routed checkpoint saves inside
``fit``), then, with ``model.save``/``save_weights`` on every rank and no wait of its own:

- ``same_path``: 20 rounds: the bias set to the round's number, ``model.save`` of one path,
  then ``keras.models.load_model`` of it on every rank at once. Each load must find the file
  and the weights just saved (a stale file holds the round before).
- ``same_weights``: the same with ``save_weights`` and ``load_weights``, 5 rounds.
- ``own_path``: the bias 100 + rank, each rank saving its own ``own-RANK.keras`` and
  ``own-RANK.weights.h5`` and loading them at once; after a barrier each rank reads both ranks'
  files.
- ``per_rank_files``: the reference, the same inside ``tfdist.per_rank_files()`` (written as
  given, no collective) to ``given-RANK...``: the answer ``own_path`` must equal.

A failed load is recorded and the rounds go on (a load runs no collective). Writes
``result-RANK.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import tfdist

ROUNDS, WEIGHT_ROUNDS = 20, 5


def main(out_dir: str) -> None:
    faulthandler.dump_traceback_later(90, exit=True)  # a hang says where, before the test ends it
    dist = tfdist.init()
    import tensorflow as tf

    keras = tf.keras
    with dist.scope():
        model = _model(keras)
        model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    data = dist.shard(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32))
    model.fit(data, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "fit.keras"))])

    def bias(value: float) -> None:
        model.layers[-1].bias.assign([value])

    def load_model(path: str) -> float:
        return _bias(keras.models.load_model(path))

    def load_weights(path: str) -> float:
        fresh = _model(keras)
        fresh.load_weights(path)
        return _bias(fresh)

    same = os.path.join(out_dir, "same.keras")
    weights = os.path.join(out_dir, "same.weights.h5")
    result: dict[str, Any] = {"rank": dist.rank, "same_path": [], "same_weights": []}
    for round_ in range(ROUNDS):
        bias(float(round_))
        model.save(same)
        result["same_path"].append(_loaded(load_model, same))
    for round_ in range(WEIGHT_ROUNDS):
        bias(float(round_))
        model.save_weights(weights)
        result["same_weights"].append(_loaded(load_weights, weights))
    bias(100.0 + dist.rank)
    result["own_path"] = _own_files(dist, model, out_dir, "own", load_model, load_weights)
    with tfdist.per_rank_files():
        result["per_rank_files"] = _own_files(dist, model, out_dir, "given", load_model,
                                              load_weights)
        # One path for every rank inside per_rank_files (a slip): written whole, and said.
        shared = os.path.join(out_dir, "shared", "one.keras")
        for _ in range(3):
            model.save(shared)
    result["shared"] = _loaded(load_model, shared)  # whole: one rank's or the other's
    with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
        json.dump(result, f)


def _model(keras: Any) -> Any:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])


def _bias(model: Any) -> float:
    return float(np.asarray(model.layers[-1].bias)[0])


def _loaded(load: Callable[[str], float], path: str) -> float | str:
    """The bias of what ``load`` finds at ``path``, or the error it raised."""
    try:
        return load(path)
    except Exception as error:  # recorded: the test names the round
        return f"{type(error).__name__}: {error}"


def _own_files(dist: Any, model: Any, out_dir: str, prefix: str,
               load_model: Callable[[str], float],
               load_weights: Callable[[str], float]) -> dict[str, Any]:
    """Each rank saves its own ``PREFIX-RANK.keras`` and ``.weights.h5`` and loads them at once;
    after a barrier, what this rank finds in every rank's files."""
    whole = os.path.join(out_dir, f"{prefix}-{{}}.keras")
    weights = os.path.join(out_dir, f"{prefix}-{{}}.weights.h5")
    model.save(whole.format(dist.rank))
    model.save_weights(weights.format(dist.rank))
    found: dict[str, Any] = {"mine": [_loaded(load_model, whole.format(dist.rank)),
                                      _loaded(load_weights, weights.format(dist.rank))]}
    dist.sum_over_ranks([0.0])  # every rank has saved its own
    found["every"] = {rank: [_loaded(load_model, whole.format(rank)),
                             _loaded(load_weights, weights.format(rank))]
                      for rank in range(dist.world_size)}
    return found


if __name__ == "__main__":
    main(sys.argv[1])
