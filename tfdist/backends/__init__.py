"""The TensorFlow backends, one module each, and the small factory that picks one.

To add a backend: write ``tfdist/backends/<name>.py`` with a :class:`~tfdist.backends.base.
Distributed` subclass and ``create(environment, settings)``, give it a row in
:data:`tfdist.backend_facts.BACKENDS` (the settings' choices, :data:`MODULES` and the rooms
that behave differently per backend read it), and say in :func:`choose` when ``auto`` picks it.

Importing this package loads no framework, nor the handle interface; :func:`create` imports
the chosen module only.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from tfdist.backend_facts import BACKENDS, JAX, TF, TORCH, names
from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.backend_facts import Backend
    from tfdist.backends.base import Distributed, Settings
    from tfdist.env import ClusterEnvironment
    from tfdist.patches import Where

__all__ = ["KERAS_BACKENDS", "MODULES", "TORCH_BACKENDS", "choose", "choose_torch", "create",
           "keras_backend", "where_here"]

# The backends tfdist.init creates (TensorFlow's, and Keras 3 on JAX) and their modules.
MODULES = {row.name: row.module for row in BACKENDS if row.framework in (TF, JAX)}
# Keras 3's backends (KERAS_BACKEND) and tfdist's engine for each; "" where it has none.
KERAS_BACKENDS = {"tensorflow": TF, "jax": JAX, "torch": "", "numpy": "", "openvino": ""}
# tfdist.torch's backends: the same TFDIST_BACKEND setting, its own engines.
TORCH_BACKENDS = names(TORCH)


def keras_backend(environ: Mapping[str, str] | None = None,
                  read: Callable[[str], str] | None = None) -> str:
    """Keras 3's backend as Keras will pick it, without importing Keras: ``KERAS_BACKEND``, else
    the ``"backend"`` of ``keras.json`` in ``KERAS_HOME`` (default ``~/.keras``), else
    ``"tensorflow"``. ``read`` reads a file (tests); an unreadable or broken file counts as
    absent, as for Keras."""
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"].strip().lower()
    home = environ.get("KERAS_HOME") or os.path.join(
        environ.get("HOME") or os.path.expanduser("~"), ".keras")
    try:
        text = (read or _read)(os.path.join(home, "keras.json"))
        return str(json.loads(text).get("backend") or "tensorflow").lower()
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def choose(requested: str, environment: ClusterEnvironment,
           keras: str = "tensorflow") -> tuple[str, str]:
    """The backend for ``requested`` under this launch, and why (pure).

    Args:
        requested: ``"auto"`` or a backend name.
        environment: the detected launch.
        keras: Keras 3's backend (:func:`keras_backend`): ``jax`` makes it tfdist's ``jax``.

    Returns:
        ``(backend, reason)``.

    Raises:
        ConfigError: a backend of another framework than Keras's, or a Keras backend tfdist
            does not drive; the message names the fix.
    """
    if keras != "tensorflow":
        return _keras_backend_choice(requested, keras)
    if requested == "jax":
        raise ConfigError("backend 'jax' trains Keras 3 on JAX: set KERAS_BACKEND=jax before "
                          "Keras is imported (it is 'tensorflow' here), or leave TFDIST_BACKEND "
                          "unset")
    if requested in TORCH_BACKENDS and requested not in MODULES:
        raise ConfigError(f"backend {requested!r} is a PyTorch backend (tfdist.torch); "
                          f"TensorFlow's are auto, {', '.join(MODULES)}: set TFDIST_BACKEND to "
                          "one of them, or leave it unset")
    if requested != "auto":
        return requested, "requested (argument, flag or TFDIST_BACKEND)"
    # Horovod's launchers give no address per process, which MWMS would need.
    if environment.facts.horovod and environment.is_distributed:
        how = ("`tfdist launch --backend horovod`" if environment.facts.tfdist_launch
               else f"{environment.launcher} started the processes")
        return "horovod", f"auto: {how} ({environment.reason})"
    if environment.is_distributed:
        return "mwms", f"auto: {environment.world_size} processes ({environment.reason})"
    return "mirrored", (f"auto: one process ({environment.reason}): MirroredStrategy over its "
                        "GPUs if it sees several, else TensorFlow's default strategy")


def _keras_backend_choice(requested: str, keras: str) -> tuple[str, str]:
    """tfdist's backend for a Keras backend other than TensorFlow's (see :func:`choose`)."""
    engine = KERAS_BACKENDS.get(keras)
    if engine == JAX:
        if requested not in ("auto", "jax"):
            raise ConfigError(f"KERAS_BACKEND=jax trains on JAX, and backend {requested!r} is "
                              "TensorFlow's or PyTorch's: leave TFDIST_BACKEND unset (or jax), "
                              "or set KERAS_BACKEND=tensorflow for it")
        return "jax", "Keras 3 on JAX (KERAS_BACKEND=jax)"
    if keras == "torch":
        raise ConfigError(
            "KERAS_BACKEND=torch: no released Keras (up to 3.15.1) has multi-process data "
            "parallelism on its torch backend (keras.distribution is JAX's there; torch's is "
            "merged upstream for a later release, keras-team/keras#23316). Fix: "
            "KERAS_BACKEND=jax or tensorflow for this script, or a torch model with tfdist.torch")
    raise ConfigError(f"KERAS_BACKEND={keras}: tfdist trains Keras 3 on the tensorflow and jax "
                      f"backends ({keras!r} has no multi-process training). Fix: "
                      "KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow")


def choose_torch(requested: str, environment: ClusterEnvironment) -> tuple[str, str]:
    """tfdist.torch's backend for ``requested`` under this launch, and why (pure).

    ``auto`` is Horovod where Horovod's launchers started the processes and gave torch no
    address to meet at (horovodrun, ``tfdist launch --backend horovod``, mpirun without
    ``MASTER_ADDR``/``MASTER_PORT``), else DDP. DeepSpeed is chosen only on request.

    Raises:
        ConfigError: ``requested`` is one of TensorFlow's backends.
    """
    if requested != "auto":
        if requested not in TORCH_BACKENDS:
            raise ConfigError(f"backend {requested!r} is a TensorFlow backend; tfdist.torch's "
                              f"are auto, {', '.join(TORCH_BACKENDS)}: set TFDIST_BACKEND to one "
                              "of them, or leave it unset")
        return requested, "requested (argument, flag or TFDIST_BACKEND)"
    if environment.facts.horovod and environment.is_distributed and not (environment.master_addr
                                                       and environment.master_port):
        return "horovod", (f"auto: {environment.reason} started the processes and gives torch "
                           "no address to meet at (MASTER_ADDR/MASTER_PORT)")
    return "ddp", f"auto: torch.distributed's DistributedDataParallel ({environment.reason})"


def create(backend: str, environment: ClusterEnvironment, settings: Settings) -> Distributed:
    """Creates the handle of ``backend`` (a key of :data:`MODULES`) for this launch."""
    module = importlib.import_module(MODULES[backend])
    handle: Distributed = module.create(environment, settings)
    from tfdist import patches, preemption

    # Before the script builds its model: the inventory's rows for this launch, in its order
    # (the backend's, then the backend-neutral ones: tfdist.patches).
    patches.install(where_here(handle.facts, handle.world_size, handle.num_gpus > 0, settings),
                    handle)
    if handle.facts.framework == TF:
        from tfdist.keras import keras2

        # Keras 2's random layers keep their state in a variable that a preempted run saves,
        # so a resumed run draws the same masks.
        keras2.keras2_random_generator()
    preemption.default_signals_in_children()  # a PyDataset's process pool ends at exit
    return handle


def where_here(row: Backend, world_size: int, gpus: bool, settings: Settings) -> Where:
    """This process's launch, for the patch inventory (:func:`tfdist.patches.where`, as
    ``tfdist env`` builds it): the versions it runs, its variables, :func:`tfdist.init`'s
    ``settings`` and what it imported. The backends build it here only (MWMS's creation too).

    Args:
        row: the backend's row.
        world_size: the processes training together.
        gpus: whether this process drives GPUs.
        settings: :func:`tfdist.strategy.resolve_settings`'s.
    """
    import sys

    from tfdist import patches
    from tfdist.keras import keras2, versions

    return patches.where(row, versions.running(), os.environ, settings,
                         several_processes=world_size > 1, gpus=gpus, imported=sys.modules,
                         eager_record_lost=keras2.eager_record_lost())
