"""The Keras wing: what makes Keras ``fit`` compute on several processes what it computes in one.

Importing it loads no TensorFlow or Keras; each room imports its Keras when it runs.

- :mod:`~tfdist.keras.plan`: ``dist.callbacks()``'s plan for every Keras (pure): which
  callbacks in which order, the options a Keras cannot honour refused, how a user's writer runs.
- :mod:`~tfdist.keras.callbacks`: TensorFlow's Keras's classes for the plan (chief-written
  files, the preemption checkpoint, warm-up, the throughput meter, the chief's progress bar),
  and the routing of a user's own writers.
- :mod:`~tfdist.keras.routing`, :mod:`~tfdist.keras.warmup`: the bodies every Keras shares (the
  writers' wrappers, Keras 3's backup per rank, the warm-up).
- :mod:`~tfdist.keras.fit_preemption`: the preemption callback's body for every Keras (the
  agreed stop, the exact state, the resume).
- :mod:`~tfdist.keras.writers`: the user's own writers and saves, once, from the chief.
- :mod:`~tfdist.keras.step_results`: what ``fit``, ``evaluate`` and the ``*_on_batch`` calls
  return, made one process's numbers.
- :mod:`~tfdist.keras.batch_statistics`: BatchNormalization's moving statistics averaged.
- :mod:`~tfdist.keras.fit_inputs`: ``fit``'s arrays, PyDatasets and generators in one order.
- :mod:`~tfdist.keras.input_position`, :mod:`~tfdist.keras.input_wait`,
  :mod:`~tfdist.keras.iterators`: where ``fit``'s input stands, how long each step waited for
  it, and its iterators freed off the training thread.
- :mod:`~tfdist.keras.versions`, :mod:`~tfdist.keras.checks`, :mod:`~tfdist.keras.keras3`,
  :mod:`~tfdist.keras.keras2`: which Keras runs, what is checked before the first step, and
  the fixes each Keras needs.
"""
