"""tfdist's own errors, left uncaught by a script: one line, once, and an exit that is not retried.

A :class:`~tfdist.errors.TfdistError` (a ``ConfigError``, ``InitOrderError``, ``LaunchError``,
``StorageError`` ...) says what is wrong and the fix in its message; Python's traceback around it,
on every rank, with the other ranks' gRPC errors after it, hides that line. Once ``tfdist`` is
imported, such an error that ends the script:

- prints ``tfdist: <message>``, without the traceback (``TFDIST_TRACEBACK=1``, or
  ``TFDIST_VERBOSE=1``, prints Python's traceback as well);
- once: on a rank other than 0 the line waits :data:`OTHERS_WAIT_S` first, time for a launcher
  to end this rank when rank 0 exits with the same error (``tfdist launch``, srun
  ``--kill-on-bad-exit``, mpirun and torchrun end the other ranks at a failure); a rank that alone
  found it still says so, and nothing is lost;
- ends the process with :data:`EXIT_CONFIG` (78, sysexits.h's EX_CONFIG) at once (no library
  teardown, where the other ranks' collectives would wait or flood), which neither ``tfdist
  launch --max-restarts`` nor the rendered Slurm jobs' requeue retries: a run started again
  would stop at the same place.

:class:`~tfdist.errors.ReplicaMismatchError` keeps its own report (:mod:`tfdist.failures`: rank 0
prints it once), and every other exception its traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any

from tfdist.errors import EXIT_CONFIG, ReplicaMismatchError, TfdistError

__all__ = ["EXIT_CONFIG", "OTHERS_WAIT_S", "install", "line"]

# How long a rank other than 0 waits before it prints the error and exits (see the docstring).
OTHERS_WAIT_S = 3.0


def line(error: BaseException) -> str:
    """The one line of ``error`` (pure): ``tfdist: <message>``, the prefix once."""
    message = str(error).strip() or type(error).__name__
    return message if message.startswith("tfdist") else f"tfdist: {message}"


def _traceback_wanted() -> bool:
    from tfdist.settings import resolve

    try:
        return bool(resolve("traceback") or resolve("verbose"))
    except TfdistError:  # a value neither 1 nor 0: as asked for, Python's printing
        return True


def _rank() -> int:
    """This process's rank: the running handle's, else the launch's (0 when unknown)."""
    strategy = sys.modules.get("tfdist.strategy")
    with contextlib.suppress(Exception):
        handle = strategy.current() if strategy is not None else None
        if handle is not None:
            return int(handle.environment.rank)
    with contextlib.suppress(Exception):
        from tfdist.env import detect

        return int(detect(os.environ).rank)
    return 0


def _wrap(previous: Any) -> Any:
    def hook(kind: type[BaseException], value: BaseException,
             traceback: TracebackType | None) -> None:
        _hook(previous, kind, value, traceback)

    return hook


def _hook(previous: Any, kind: type[BaseException], value: BaseException,
          traceback: TracebackType | None) -> None:
    if not isinstance(value, TfdistError) or isinstance(value, ReplicaMismatchError):
        previous(kind, value, traceback)
        return
    if _rank() != 0 and threading.current_thread() is threading.main_thread():
        # A launcher ending this rank meanwhile is the normal case: no signal handler of
        # tfdist's (the agreed stop at a preemption) may turn that into a save.
        with contextlib.suppress(Exception):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        time.sleep(OTHERS_WAIT_S)
    if _traceback_wanted():
        import traceback as tracebacks

        tracebacks.print_exception(kind, value, traceback, file=_stream())
    else:
        print(line(value), file=_stream(), flush=True)
    end()


def _stream() -> Any:
    """Where the line goes: ``sys.stderr``, unless an outer hook swapped it for a buffer it
    would print after this one returns (torch.distributed's prefixes every rank's traceback
    so), which it never does: this one ends the process. Then the process's real stderr."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__ or sys.stderr


def end(code: int = EXIT_CONFIG, environment: Any = None) -> None:
    """Ends the process with ``code`` at once (no further ``atexit`` functions, no library
    teardown): logs and output flushed, scratch folders removed, the ``model_dir`` this process
    holds given up (where those modules are in use), and for a rank of many a moment for the
    launcher to forward its output (:func:`tfdist.failures.linger`; ``environment``: the
    launch, default the one it knows)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    scratch = sys.modules.get("tfdist.scratch")
    if scratch is not None:
        with contextlib.suppress(Exception):
            scratch.remove_scratch_dirs()
    ownership = sys.modules.get("tfdist.ownership")
    if ownership is not None:
        with contextlib.suppress(Exception):
            ownership.release_all()
    failures = sys.modules.get("tfdist.failures")
    if failures is not None:
        with contextlib.suppress(Exception):
            failures.linger(environment)
    os._exit(code)


def install() -> None:
    """Patch ``own-error-line``'s installer (:mod:`tfdist.patches`): the hook in
    ``sys.excepthook``, once; ``import tfdist`` calls it."""
    from tfdist import patches

    patches.apply("own-error-line", sys, "excepthook", _wrap)
