"""The JAX wing: Keras 3 on JAX over several processes.

Importing it loads neither JAX nor Keras. :mod:`~tfdist.jax.patches`: a variable placed on
several processes takes rank 0's value, ``fit``/``evaluate``/``predict`` read each rank's part of
every global batch, ``predict`` returns every row on every rank; :mod:`~tfdist.jax.callbacks`:
the Keras callbacks ``dist.callbacks()`` gives there. The backend itself (JAX's runtime, Keras's
``DataParallel``) is :mod:`tfdist.backends.keras_jax`.
"""
