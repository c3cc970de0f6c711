"""Runs a TensorFlow op before ``import tfdist`` in a 2-worker job: must raise InitOrderError.

An op after ``import tfdist`` starts tfdist there (tfdist.autostart); before it, nothing can.
"""

import sys

import tensorflow as tf

tf.constant(1.0)  # the mistake: the eager runtime starts here, before tfdist is imported

import tfdist  # noqa: E402

try:
    tfdist.init()
except tfdist.InitOrderError as error:
    print(f"InitOrderError: {error}")
    sys.exit(3)
print("no error")
