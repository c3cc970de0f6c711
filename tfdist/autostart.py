"""tfdist starts at TensorFlow's first op, in a multi-process launch, when the script's first
TensorFlow work comes before ``strategy_scope()``.

Multi-worker collectives (and Horovod's GPU pinning) can only be configured before TensorFlow's
runtime starts, which it does at the first op: a tensor, a ``tf.data.Dataset``, a Keras model.
Scripts often make their data first, as public Keras examples do, and would stop with
:class:`tfdist.errors.InitOrderError`. So ``import tfdist`` arms a hook (standard library only,
nothing else is imported): when TensorFlow's context module is imported in a launch of several
processes whose Keras runs on TensorFlow, the ``first-op-start`` patch wraps
``Context.ensure_initialized``, and the first op that starts the runtime runs
:func:`tfdist.init` first, with the settings from the environment (``TFDIST_BACKEND``...).
``strategy_scope()`` later returns that handle; a call with other settings is refused with the
fix. What remains an error: an op before ``import tfdist``.

Nothing happens in one process, under Keras 3 on JAX, in a torch script (``tfdist.torch``),
in the ``tfdist`` command itself (:func:`off`: ``tfdist doctor`` makes its own collectives), or
once tfdist is initialised.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["MODULE", "arm", "off"]

MODULE = "tensorflow.python.eager.context"
_lock = threading.Lock()
_state = {"decided": False}


def off() -> None:
    """Nothing starts at TensorFlow's first op in this process: the ``tfdist`` command's own
    (``tfdist doctor`` makes its own collectives, ``tfdist env`` reads the launch)."""
    _state["decided"] = True


def arm() -> None:
    """Called by ``import tfdist``: wraps TensorFlow's context when it is (or gets) imported."""
    module = sys.modules.get(MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders load TensorFlow's context module, then
    wraps it once its code has run."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _wrap(module)


def _wanted() -> bool:
    """Whether this process is a launch tfdist must start before TensorFlow's runtime: several
    processes, Keras on TensorFlow, no torch shim, tfdist not initialised."""
    if "tfdist.torch" in sys.modules:
        return False
    from tfdist import backends, strategy
    from tfdist.backend_facts import TF, backend
    from tfdist.env import detect
    from tfdist.settings import resolve, skipped_patches

    if strategy.current() is not None:
        return False
    try:
        if "first-op-start" in skipped_patches():
            return False
        environment = detect()
        keras = backends.keras_backend()
        if not environment.is_distributed or keras != "tensorflow":
            return False
        chosen, _ = backends.choose(resolve("backend"), environment, keras)
    except Exception:  # a bad setting or launch: tfdist.init says so, with the fix
        return False
    row = backend(chosen)
    return row.framework == TF and row.crosses_processes  # the backend tfdist.init will make


def _wrap(module: ModuleType) -> None:
    import os

    from tfdist import verify

    context_class = getattr(module, "Context", None)
    if context_class is None or not (_wanted() or os.environ.get(verify.SEED)):
        return
    from tfdist import patches

    patches.apply("first-op-start", context_class, "ensure_initialized", _starting)


def _starting(original: Any) -> Any:
    def ensure_initialized(self: Any) -> Any:
        if not self._initialized and not _state["decided"]:
            from tfdist import strategy, verify

            with _lock:
                if not _state["decided"]:
                    _state["decided"] = True
                    verify.seed_once()  # a `tfdist verify` run: both runs seeded here
                    if not strategy.creating() and _wanted():
                        strategy.start_at_first_op()
        return original(self)

    ensure_initialized.__wrapped__ = original  # type: ignore[attr-defined]
    return ensure_initialized
