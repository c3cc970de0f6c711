"""Starting and ending tfdist.torch: :func:`init` detects the launch, picks the backend and
creates its handle once per process; :func:`distributed` and :func:`shutdown` end it.

The backends' handles live in :mod:`tfdist.torch.handle` (DDP), :mod:`tfdist.torch.horovod` and
:mod:`tfdist.torch.deepspeed`, each with ``create(environment, settings)``; the backend table
(:mod:`tfdist.backend_facts`) names the module of the backend :func:`tfdist.backends.
choose_torch` picks.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as torch_dist

from tfdist import backend_facts as facts
from tfdist import preemption, quiet
from tfdist.backends import choose_torch
from tfdist.env import detect
from tfdist.errors import ConfigError
from tfdist.replicas import HandleCache
from tfdist.settings import resolve
from tfdist.torch.handle import TorchDistributed, TorchSettings

__all__ = ["current", "distributed", "init", "shutdown"]

logger = logging.getLogger("tfdist")

_cache: HandleCache[TorchDistributed] = HandleCache(
    "tfdist.torch", "; call tfdist.torch.shutdown() first")
_atexit_registered = False


def init(collective: str | None = None, *, backend: str | None = None,
         timeout: float | timedelta | None = None) -> TorchDistributed:
    """Detects the launch, pins this process's GPU and creates the process group.

    Calling it again returns the same handle until :func:`shutdown`. One plain process gets
    a one-rank group over an in-memory store, so the same script runs everywhere.

    Args:
        backend: ``"auto"``, ``"ddp"``, ``"horovod"`` or ``"deepspeed"``; env
            ``TFDIST_BACKEND``. Auto is Horovod under horovodrun (or mpirun without
            ``MASTER_ADDR``), else DDP (:func:`tfdist.backends.choose_torch`).
        collective: ``"auto"``, ``"nccl"`` or ``"gloo"``; env ``TFDIST_TORCH_COLLECTIVE`` (or
            its old name ``TFDIST_TORCH_BACKEND``). Auto picks NCCL when CUDA is available,
            gloo on CPU. NCCL without CUDA falls back to gloo, with a warning (as TensorFlow's
            NCCL request falls back to the ring).
        timeout: seconds (or a ``timedelta``) that the rendezvous and every collective may wait
            for the other ranks before raising; env ``TFDIST_TORCH_TIMEOUT``; default 600. A
            peer whose process stops (no heartbeat: :mod:`tfdist.torch.heartbeat`) ends every
            rank sooner: after half of it, at most 30 s.

    Returns:
        The :class:`TorchDistributed` handle.

    Raises:
        LaunchError: the launch cannot train as started, or the ranks did not meet in time.
        ConfigError: an invalid setting, or a process group created outside tfdist.
    """
    settings = TorchSettings(*_settings(collective, timeout), resolve("backend", backend))
    cached = _cache.get(settings)
    if cached is not None:
        return cached
    if torch_dist.is_initialized():
        raise ConfigError("torch.distributed was initialised outside tfdist: remove your "
                          "init_process_group call and let tfdist.torch.init() create the group")
    environment = detect()
    quiet.show_own_lines(environment.is_chief)  # tfdist's lines in any script, as for Keras
    chosen, why = choose_torch(settings.backend, environment)
    if environment.is_chief:
        logger.info("tfdist: torch backend %s: %s", chosen, why)
    module = importlib.import_module(facts.backend(chosen, facts.TORCH).module)
    handle: TorchDistributed = _cache.put(module.create(environment, settings), settings)
    _register_atexit()
    preemption.default_signals_in_children()  # a DataLoader's forked workers end when told
    handle.prepare()
    return handle


@contextlib.contextmanager
def distributed(collective: str | None = None, *, backend: str | None = None,
                timeout: float | timedelta | None = None) -> Iterator[TorchDistributed]:
    """``init()``, and tear the process group down on leaving, also on an exception.

    On success every rank waits at a barrier before destroying the group, so rank 0, which
    hosts the rendezvous store, is not gone while others still finish. On an exception the
    group is destroyed at once and the exception propagates; the other ranks' pending
    collectives then fail (gloo: at once, as the connections close; NCCL: within the timeout),
    so no rank waits forever. Takes the same arguments as :func:`init`.
    """
    handle = init(collective, backend=backend, timeout=timeout)
    completed = False
    try:
        yield handle
        completed = True
    finally:
        shutdown(barrier=completed)


def current() -> TorchDistributed | None:
    """The handle created by :func:`init` in this process, if any."""
    return _cache.handle


def shutdown(*, barrier: bool = True) -> None:
    """Destroys the process group tfdist created; does nothing when there is none.

    Args:
        barrier: wait for every rank first (a normal finish). Without it (after an error) the
            group is destroyed at once, and an error while destroying it is only logged, so it
            cannot hide the original one.
    """
    handle = _cache.clear()
    if handle is not None:
        handle.close(barrier)


def _settings(collective: str | None, timeout: float | timedelta | None) -> tuple[str, float]:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    return resolve("torch_collective", collective), resolve("torch_timeout", seconds)


def _register_atexit() -> None:
    # A script that calls init() without the context manager still releases the group, even
    # when it ends with an exception (atexit runs after the traceback is printed).
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown, barrier=False)
        _atexit_registered = True
