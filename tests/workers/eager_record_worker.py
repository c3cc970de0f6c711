"""Keras 2 in the state TensorFlow 2.14 and older start in inside absl's ``app.run``, before and
after ``tfdist.init`` (tests/test_keras_compat.py; ``tfdist.keras.keras2.repair_eager_record``).

TensorFlow 2.15 and newer never start so, so this worker makes the state by hand: the eager
context's record of context switches without its first, eager entry, which is what TensorFlow
2.14's early start leaves. It prints one JSON line: whether the repair touched a whole record,
what building a model raised in the broken state, whether init repaired it, and the built
model's parameter count.
"""

from __future__ import annotations

import json

import tensorflow as tf
from tensorflow.python.eager import context

import tfdist
from tfdist.keras import keras2


def build() -> int:
    keras = tf.keras
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"),
                              keras.layers.Dense(2)])
    return int(model.count_params())


def main() -> None:
    result: dict[str, object] = {"whole_record_repaired": keras2.repair_eager_record()}
    eager = context.context()
    eager._context_switches = type(eager._context_switches)(False)  # as TF <= 2.14 leaves it
    try:
        result["broken"] = f"built {build()} parameters"
    except ValueError as error:
        result["broken"] = str(error)
    tfdist.init()
    result["entries_after_init"] = len(eager._context_switches.stack)
    result["params"] = build()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
