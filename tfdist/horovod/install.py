"""Is a usable Horovod installed? Each failure becomes an error that says how to fix it.

Horovod is compiled against one TensorFlow: its ``mpi_lib`` library links TensorFlow's C++ ABI,
so a TensorFlow upgrade after the build breaks it (an ``undefined symbol`` when TensorFlow loads
the library), or worse, loads and misbehaves (Horovod then only warns). Horovod's build records
the TensorFlow it compiled against in ``horovod/metadata.json``; tfdist compares it with the
installed TensorFlow before loading anything.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Any

from tfdist.errors import ConfigError

__all__ = ["BUILD_RECORD", "REBUILD", "import_horovod", "import_horovod_keras",
           "import_horovod_torch", "installed_tensorflow", "is_installed"]

BUILD_RECORD = "metadata.json"  # written into horovod/ by Horovod's build
REBUILD = ("HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 "
           "HOROVOD_WITHOUT_MXNET=1 pip install --no-cache-dir --no-build-isolation "
           "--force-reinstall --no-deps horovod==0.28.1")
_HOW = (f"Build it against the installed TensorFlow: `{REBUILD}` (setuptools, wheel, packaging "
        "and cmake<4 installed first; add HOROVOD_WITH_MPI=1 for MPI). Horovod 0.28.1 builds "
        "against TensorFlow 2.18 at the newest.")


def is_installed() -> bool:
    """Whether a ``horovod`` package can be found, without importing it."""
    return importlib.util.find_spec("horovod") is not None


def installed_tensorflow() -> str | None:
    """The installed TensorFlow's version, read from package metadata (no TensorFlow import)."""
    for name in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def import_horovod() -> Any:
    """Imports ``horovod.tensorflow``.

    Returns:
        The ``horovod.tensorflow`` module.

    Raises:
        ConfigError: Horovod is not installed, was built without TensorFlow support, or was
            built against another TensorFlow; the message names the versions and the fix.
    """
    if not is_installed():
        raise ConfigError("backend 'horovod' needs the horovod package, which is not installed "
                          f"in this Python ({sys.executable}). " + _HOW)
    _check_build_record()
    try:
        import horovod.tensorflow as hvd
    except Exception as error:  # ImportError, or tf.errors.NotFoundError from load_op_library
        raise _explain(error) from error
    return hvd


def import_horovod_torch() -> Any:
    """Imports ``horovod.torch``.

    Raises:
        ConfigError: Horovod is not installed or was built without PyTorch; the message says
            how to build it (Horovod 0.28.1 needs one line changed to compile against torch 2).
    """
    how = ("Build Horovod from its source against the installed torch: `pip download "
           "--no-deps --no-binary :all: horovod==0.28.1`, unpack it, change `set(CMAKE_CXX_"
           "STANDARD 14)` to 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt (torch 2's "
           "headers need C++17), then `HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install "
           "--no-build-isolation --no-deps .` in that folder.")
    if not is_installed():
        raise ConfigError("backend 'horovod' of tfdist.torch needs the horovod package, which is "
                          f"not installed in this Python ({sys.executable}). " + how)
    try:
        import horovod.torch as hvd
    except Exception as error:  # ImportError, or the extension library failing to load
        raise ConfigError(f"horovod.torch cannot be imported: {type(error).__name__}: "
                          f"{str(error).strip().rstrip('.')}. " + how) from error
    return hvd


def import_horovod_keras() -> Any:
    """Imports ``horovod.tensorflow.keras`` for tf_keras (Keras 2).

    Its code does ``from keras import backend as K``; with Keras 3 installed that is Keras 3's
    backend, which lacks what Horovod calls. ``keras`` resolves to tf_keras during the import.

    Raises:
        ConfigError: as :func:`import_horovod`, or tf_keras is not installed.
    """
    import_horovod()
    from tfdist.keras.versions import keras2_package

    if keras2_package() == "keras":  # TensorFlow 2.15: `keras` is Keras 2 already
        import horovod.tensorflow.keras as hvd_keras

        return hvd_keras
    try:
        import tf_keras
    except ImportError:
        raise ConfigError("TF_USE_LEGACY_KERAS=1 asks for tf_keras (Keras 2), which is not "
                          "installed: `pip install --no-deps tf_keras==<your TensorFlow minor "
                          "version>`") from None
    saved = sys.modules.get("keras")
    sys.modules["keras"] = tf_keras
    try:
        import horovod.tensorflow.keras as hvd_keras
    finally:
        if saved is None:
            sys.modules.pop("keras", None)
        else:
            sys.modules["keras"] = saved
    return hvd_keras


def _check_build_record() -> None:
    spec = importlib.util.find_spec("horovod")
    folder = os.path.dirname(spec.origin) if spec and spec.origin else None
    record = os.path.join(folder, BUILD_RECORD) if folder else None
    if not record or not os.path.exists(record):
        return  # built elsewhere: only loading the library can tell
    with open(record, encoding="utf-8") as f:
        built = json.load(f).get("tensorflow")
    installed = installed_tensorflow()
    if built and installed and built != installed:
        raise ConfigError(
            f"horovod in {folder} was compiled against TensorFlow {built}, but TensorFlow "
            f"{installed} is installed: its library would fail to load or misbehave. " + _HOW)


def _explain(error: Exception) -> ConfigError:
    text = str(error).strip().rstrip(".")
    installed = installed_tensorflow() or "(none found)"
    if "has not been built" in text or "HOROVOD_WITH_TENSORFLOW" in text:
        return ConfigError(f"horovod is installed without its TensorFlow extension (built "
                           f"before TensorFlow was installed, or the build failed): {text}. "
                           + _HOW)
    if ("undefined symbol" in text or "symbol not found" in text.lower()
            or "installed with version" in text):
        return ConfigError(f"horovod's TensorFlow library does not load with TensorFlow "
                           f"{installed}: it was compiled against another TensorFlow ({text}). "
                           + _HOW)
    if isinstance(error, ImportError) and "tensorflow" in text.lower():
        return ConfigError(f"horovod.tensorflow cannot be imported: {text}. Is TensorFlow "
                           f"installed? (found: {installed})")
    return ConfigError(f"horovod.tensorflow cannot be imported with TensorFlow {installed}: "
                       f"{type(error).__name__}: {text}. " + _HOW)
