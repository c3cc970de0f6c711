"""Which Keras drives ``tf.keras`` (pure but for reading installed versions).

Keras 3 (``import keras``), or Keras 2: the tf_keras package (``TF_USE_LEGACY_KERAS=1``) or the
keras 2.x package of TensorFlow 2.15 and older. Every room of the wing asks here, and so does
the Horovod wing; :data:`AFFECTED` is the range of Keras 3 releases :mod:`tfdist.keras.keras3`
fixes.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["AFFECTED", "is_keras3", "keras2_module", "keras2_package", "legacy_keras_requested",
           "needs_fix", "running", "trainer_class"]


# Half-open range of Keras versions with the defects. Raise the upper bound only after the
# upstream issue is fixed in a release and the tests pass without the fix there.
AFFECTED = ((3, 0), (4, 0))


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def is_keras3(keras_module: Any) -> bool:
    """Whether ``keras_module`` (usually ``tf.keras``) is Keras 3 rather than Keras 2.

    Keras 2 is tf_keras, or on TensorFlow 2.15 the ``keras`` 2.15 package itself. Their
    ``tf.keras`` (``tf_keras.api._v2.keras``, ``keras.api._v2.keras``) has no ``__version__``;
    its package has.
    """
    package = keras_module.__name__.split(".")[0]
    if package == "tf_keras":
        return False
    version = (getattr(keras_module, "__version__", None)
               or getattr(sys.modules.get(package), "__version__", "3"))
    return not str(version).startswith("2.")


def legacy_keras_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``tf.keras`` is tf_keras, read the way TensorFlow itself reads the variable (in
    ``environ``, default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def running() -> dict[str, str]:
    """The versions of TensorFlow and Keras this process runs, package -> version: each one's
    module where it is imported, else its installed package's; "" where neither is."""
    found = {}
    for package, distributions in _DISTRIBUTIONS.items():
        version = getattr(sys.modules.get(package), "__version__", None)
        for distribution in distributions if version is None else ():
            try:
                version = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        found[package] = str(version or "")
    return found


# The distributions that install each package (the nightlies: a release candidate of
# TensorFlow requires keras-nightly).
_DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-gpu"),
                  "keras": ("keras", "keras-nightly")}


def keras2_package() -> str | None:
    """The package whose Keras 2 is ``tf.keras``: ``"tf_keras"`` (``TF_USE_LEGACY_KERAS=1``),
    ``"keras"`` (a keras 2.x: TensorFlow 2.15, where ``tf.keras`` is Keras 2 without the
    variable), or None for Keras 3. Both Keras 2 packages have the same ``src.engine``."""
    if legacy_keras_requested():
        return "tf_keras"
    version = getattr(sys.modules.get("keras"), "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("keras")
        except importlib.metadata.PackageNotFoundError:
            return None
    return "keras" if str(version).startswith("2.") else None


def keras2_module(name: str) -> Any:
    """Keras 2's internal module ``name`` (``"backend"``, ``"engine.training"``) in the package
    that is ``tf.keras`` (:func:`keras2_package`; tf_keras where none is): under ``src`` from
    Keras 2.13 on, at the package's top in Keras 2.12 (TensorFlow 2.12's)."""
    package = keras2_package() or "tf_keras"
    try:
        return importlib.import_module(f"{package}.src.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{package}.src":
            raise
        return importlib.import_module(f"{package}.{name}")


# The trainer class of each Keras 3 backend (``keras.src.backend.<name>.trainer``), which
# ``keras.Model`` inherits ``fit`` and its steps from: named for the backend up to Keras 3.15,
# ``Trainer`` in every backend from 3.16 on (the keras-nightly that TensorFlow 2.22.0rc0 needs).
_TRAINER_NAMES = {"tensorflow": "TensorFlowTrainer", "jax": "JAXTrainer", "torch": "TorchTrainer"}


def trainer_class(backend: str = "tensorflow") -> Any:
    """Keras 3's trainer class of ``backend``, under the name this Keras gives it."""
    module = importlib.import_module(f"keras.src.backend.{backend}.trainer")
    found = getattr(module, _TRAINER_NAMES[backend], None)
    return found if found is not None else module.Trainer


def needs_fix() -> bool:
    """True when Keras 3 drives ``tf.keras`` and its version is in ``AFFECTED``."""
    if legacy_keras_requested():
        return False  # tf_keras (Keras 2) has its own multi-worker code, which works
    import keras

    return AFFECTED[0] <= _version_tuple(keras.__version__) < AFFECTED[1]
