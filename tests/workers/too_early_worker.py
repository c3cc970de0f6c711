"""Runs a TensorFlow op before tfdist.init() in a 2-worker job: must raise InitOrderError."""

import sys

import tensorflow as tf

import tfdist

tf.constant(1.0)  # the mistake: the eager runtime starts here
try:
    tfdist.init()
except tfdist.InitOrderError as error:
    print(f"InitOrderError: {error}")
    sys.exit(3)
print("no error")
