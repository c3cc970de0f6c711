"""Program start-up: detect the launch, pick a backend, create its strategy once, hand it out.

Settings, highest precedence first: the Python argument, then the ``TFDIST_*`` environment
variable, then what the cluster implies, then the default (:mod:`tfdist.settings`). Example
scripts pass a flag as the argument only when the user gave it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

from tfdist import backends, quiet
from tfdist.backends.base import Distributed, Settings
from tfdist.env import detect
from tfdist.errors import ConfigError
from tfdist.replicas import HandleCache
from tfdist.settings import resolve, skipped_patches

__all__ = ["Distributed", "current", "init", "reset", "strategy_scope"]

logger = logging.getLogger("tfdist")
_cache: HandleCache[Distributed] = HandleCache("tfdist")


def init(backend: str | None = None, *, collective: str | None = None,
         threads: int | None = None, collective_timeout: float | None = None) -> Distributed:
    """Detects the launch and creates the strategy. Call it first in ``main``.

    Calling it again returns the same handle (the strategy can be created once per process).

    Args:
        backend: ``"auto"``, ``"mwms"``, ``"horovod"``, ``"mirrored"`` or ``"single"``; env
            ``TFDIST_BACKEND``. Auto picks Horovod when horovodrun or mpirun started the
            processes, MultiWorkerMirroredStrategy when another launcher started several, and
            for one process MirroredStrategy over its GPUs when it sees several, else
            TensorFlow's default strategy (``"single"``); it logs which and why.
        collective: ``"auto"``, ``"ring"`` or ``"nccl"``; env ``TFDIST_COLLECTIVE``. Auto
            picks NCCL when GPUs are visible, ring on CPU.
        threads: TensorFlow intra- and inter-op threads; env ``TFDIST_NUM_THREADS``. By default
            the number of cores this process is pinned to, when it is pinned (srun
            ``--cpu-bind``, ``tfdist launch``), else TensorFlow's default.
        collective_timeout: seconds an MWMS collective waits for the other ranks before it
            fails with a tfdist line (a rank alive but stuck, which the heartbeat does not
            catch: :mod:`tfdist.timeouts`); env ``TFDIST_COLLECTIVE_TIMEOUT``. Default: wait
            forever.

    Returns:
        The :class:`Distributed` handle.

    Raises:
        InitOrderError: TensorFlow was initialised before this call in a multi-worker job.
        LaunchError: the launch cannot train as started (e.g. the Slurm batch shell).
        ConfigError: an invalid setting, named with the allowed values.
    """
    settings = resolve_settings(backend, collective, threads, collective_timeout)
    try:
        cached = _cache.get(settings)
    except ConfigError as error:
        if not _started_early:
            raise
        raise ConfigError(
            f"tfdist started at the script's first TensorFlow op, before strategy_scope(), with "
            f"the environment's settings; this call asks for others ({error}). Fix: give them "
            "as variables (TFDIST_BACKEND, TFDIST_COLLECTIVE, TFDIST_NUM_THREADS, "
            "TFDIST_COLLECTIVE_TIMEOUT), or call strategy_scope() before any TensorFlow op"
        ) from None
    if cached is not None:
        return cached
    environment = detect()
    quiet.show_own_lines(environment.is_chief)
    chosen, why = backends.choose(settings["backend"], environment, backends.keras_backend())
    if environment.is_chief:
        logger.info("tfdist: backend %s: %s", chosen, why)
    global _creating
    _creating = True
    try:
        handle = backends.create(chosen, environment, settings)
    finally:
        _creating = False
    quiet.quiet_other_ranks(handle.is_chief)
    return _cache.put(handle, settings)


_creating = False  # init is creating the handle (its own ops start nothing: tfdist.autostart)
_started_early = False  # init ran at the script's first TensorFlow op (tfdist.autostart)


def creating() -> bool:
    """Whether :func:`init` is creating the handle now."""
    return _creating


def start_at_first_op() -> None:
    """:func:`init` from the environment's settings, at the script's first TensorFlow op,
    unless tfdist is initialised or creating its handle (:mod:`tfdist.autostart`)."""
    global _started_early
    if _creating or _cache.handle is not None:
        return
    _started_early = True
    init()


@contextlib.contextmanager
def strategy_scope(backend: str | None = None, *, collective: str | None = None,
                   threads: int | None = None,
                   collective_timeout: float | None = None) -> Iterator[Distributed]:
    """``init()`` and enter the strategy's scope: ``with strategy_scope() as dist: ...``.

    Takes the same arguments as :func:`init`.
    """
    handle = init(backend, collective=collective, threads=threads,
                  collective_timeout=collective_timeout)
    with handle.scope():
        yield handle


def current() -> Distributed | None:
    """The handle created by :func:`init` in this process, if any."""
    return _cache.handle


def reset() -> None:
    """Forgets the handle (tests only: TensorFlow cannot reconfigure collectives in-process)."""
    _cache.clear()


def resolve_settings(backend: str | None = None, collective: str | None = None,
                     threads: int | None = None, collective_timeout: float | None = None,
                     environ: Mapping[str, str] | None = None) -> Settings:
    """The settings of :func:`init`, each from its argument, variable or default.

    Raises:
        ConfigError: an invalid value, named with the allowed ones.
    """
    return {"backend": resolve("backend", backend, environ),
            "collective": resolve("collective", collective, environ),
            "threads": resolve("threads", threads, environ),
            "collective_timeout": resolve("collective_timeout", collective_timeout, environ),
            "cpu_replicas": resolve("cpu_replicas", None, environ),
            "heartbeat_timeout": resolve("heartbeat_timeout", None, environ),
            "peer_watch": resolve("peer_watch", None, environ),
            # the patches to leave out (tfdist.patches): TFDIST_SKIP_PATCHES, the old switches
            "skip_patches": skipped_patches(environ)}
