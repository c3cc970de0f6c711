"""The supervisor of ``tfdist launch``: starts the workers, streams their output and stops them.

:func:`run_workers` starts each :class:`WorkerSpec` in its own session (process group), pinned
to its cores, prints its lines with a ``[rank] `` prefix (and, with ``--log-dir``, unprefixed to
one file per rank), forwards SIGUSR1 to every worker, and stops every worker as soon as one
fails, the launcher gets Ctrl-C or SIGTERM, or the run's time limit ends; a launcher killed
outright (SIGKILL) takes its workers with it (SIGTERM: the kernel's parent-death signal).
Workers that exit preempted (75) together are no failure. The launch's plan (which workers,
with which variables) is :mod:`tfdist.launch`'s.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, BinaryIO, NoReturn, TextIO

from tfdist import quiet, timeouts
from tfdist.errors import ConfigError, LaunchError
from tfdist.preemption import EXIT_PREEMPTED

__all__ = ["EXIT_TIME_LIMIT", "PREEMPT_WAIT_S", "WorkerSpec", "exit_code", "run_workers",
           "split_lines", "warn"]

# What the launch returns when its --time-limit stopped the workers (timeout(1)'s code).
EXIT_TIME_LIMIT = 124
# Once one worker has exited preempted (75), how long the others may take to do the same.
PREEMPT_WAIT_S = 120.0
_POLL_S = 0.05
_JOIN_S = 2.0
# The lines of each worker kept to explain its death by a signal (timeouts.crashed).
_TAIL_LINES = 200
# "\r" ends a line too, so a Keras progress bar prints one line per update instead of one
# endless line; "\r\n" is a single line end.
_LINE_END = re.compile(rb"\r\n|\r|\n")

_Popen = subprocess.Popen[bytes]


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its ``rank`` (index in ``TF_CONFIG`` and local rank), ``argv``, full
    ``env``, and the ``cpus`` it is pinned to (``None``: inherit the launcher's affinity)."""

    rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    cpus: frozenset[int] | None


def split_lines(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split the complete lines off ``buffer``; return them and the unfinished rest.

    ``\\n``, ``\\r\\n`` and ``\\r`` end a line; empty ``\\r``-ended lines are dropped. A final
    ``\\r`` stays in the rest: it may be the first half of ``\\r\\n``.
    """
    lines, start = [], 0
    for match in _LINE_END.finditer(buffer):
        if match.group() == b"\r" and match.end() == len(buffer):
            break
        if match.start() > start or match.group() != b"\r":
            lines.append(buffer[start : match.start()])
        start = match.end()
    return lines, buffer[start:]


def exit_code(returncode: int) -> int:
    """Map a ``Popen.returncode`` to a shell exit code (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_workers(
    workers: Sequence[WorkerSpec],
    *,
    grace_period: float = 10.0,
    prefix: bool = True,
    out: TextIO | None = None,
    logs: Mapping[int, BinaryIO] | None = None,
    hide_noise: bool = False,
    end_time: float | None = None,
) -> int:
    """Start ``workers``, stream their output to ``out`` and wait; returns as :func:`launch`.

    ``logs`` maps a rank to a binary file that also gets that worker's lines, unprefixed and
    undecoded, flushed as they arrive; the caller closes it. With ``hide_noise``, TensorFlow's
    start-up lines (:class:`tfdist.quiet.Noise`) reach the logs only, not ``out``. Each worker
    runs in its own session (process group). When one fails, or the launcher gets Ctrl-C or
    SIGTERM, every group gets SIGTERM, then SIGKILL after ``grace_period`` seconds; their output
    is read to the end. So they are at ``end_time`` (``time.time()``, ``--time-limit``), and the
    launch returns :data:`EXIT_TIME_LIMIT` unless every worker then exits preempted.
    """
    procs: list[_Popen] = []
    threads: list[threading.Thread] = []
    lock = threading.Lock()
    tails: list[deque[str]] = [deque(maxlen=_TAIL_LINES) for _ in workers]

    def forward(signum: int, _: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signal.Signals(signum))

    try:
        with _handle([signal.SIGTERM], _raise_terminated), _handle([signal.SIGUSR1], forward):
            procs.extend(_start(spec) for spec in workers)
            # Readers start after every fork: preexec_fn is only safe while no thread runs.
            for proc, spec in zip(procs, workers, strict=True):
                head = f"[{spec.rank}] " if prefix else ""
                args = (proc, head, lock, out, (logs or {}).get(spec.rank), hide_noise,
                        tails[len(threads)])
                threads.append(threading.Thread(target=_pump, args=args, daemon=True))
                threads[-1].start()
            failure = _wait_first_failure(procs, end_time)
            if failure is None:
                return 0
            return _report_failure(*failure, procs, workers[failure[0]], threads[failure[0]],
                                   tails[failure[0]])
    except KeyboardInterrupt:
        warn("interrupted; stopping the workers")
        return 130
    except _StopError as stopped:
        warn(stopped.message)
        return stopped.code
    finally:
        # A second Ctrl-C while stopping must not leave workers behind; the stop is bounded.
        with _handle([signal.SIGINT, signal.SIGTERM], signal.SIG_IGN):
            _stop(procs, grace_period)
        for thread in threads:  # Before returning: the last lines reach the terminal and logs.
            thread.join(_JOIN_S)  # Bounded: a detached grandchild may still hold the pipe.
        if procs and all(proc.returncode == EXIT_PREEMPTED for proc in procs):
            return EXIT_PREEMPTED  # noqa: B012 (every worker saved its state: say so)


def _report_failure(rank: int, returncode: int, procs: Sequence[_Popen], spec: WorkerSpec,
                    reader: threading.Thread, tail: deque[str]) -> int:
    """Says which worker ended the run and how; returns the launch's exit code."""
    others = any(proc.poll() is None for proc in procs)
    warn(_describe(rank, returncode) + ("; stopping the other workers" if others else ""))
    if returncode < 0:  # killed: its own last words may be missing, say them for it
        reader.join(_JOIN_S)
        said = timeouts.crashed("\n".join(tail), spec.rank, _collective_timeout(spec))
        if said:
            warn(f"worker {rank}: {said}")
    return exit_code(returncode)


class _StopError(Exception):
    """The launch stops its workers: what it says, and the code it returns."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def _raise_terminated(*_: object) -> NoReturn:
    raise _StopError("got SIGTERM; stopping the workers (SIGTERM first: they save their state if "
                   "they can)", 128 + signal.SIGTERM)


@contextmanager
def _handle(
    sigs: Sequence[int], handler: Callable[[int, Any], None] | signal.Handlers
) -> Iterator[None]:
    # signal.signal only works in the main thread; elsewhere leave the handlers alone.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _libc() -> Any:
    """The C library, loaded in the launcher (not in a forked child), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _in_child(cpus: Iterable[int] | None, libc: Any, parent: int) -> Callable[[], None]:
    """What a worker's process does before its program: its cores, and SIGTERM when the
    launcher dies (Linux's parent-death signal: a launcher killed with SIGKILL, by the kernel's
    out-of-memory killer, left its workers training on, orphaned, in the same model_dir). Its
    own session keeps it out of the launcher's process group, so nothing else would tell it."""

    def run() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != parent:  # the launcher died before the line above
                os.kill(os.getpid(), signal.SIGTERM)

    return run


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _start(spec: WorkerSpec) -> _Popen:
    try:
        return subprocess.Popen(
            spec.argv,
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Safe: no reader thread runs yet (see run_workers); nothing imported in the child.
            preexec_fn=_in_child(spec.cpus, _libc(), os.getpid()),
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise LaunchError(
            f"cannot start worker {spec.rank} ({shlex.join(spec.argv)}): {err}. Check that the "
            "script or executable exists (scripts must end in .py; use -m for modules)."
        ) from err


def _pump(
    proc: _Popen, head: str, lock: threading.Lock, out: TextIO | None, log: BinaryIO | None,
    quiet_output: bool = False, tail: deque[str] | None = None,
) -> None:
    assert proc.stdout is not None
    fd, rest = proc.stdout.fileno(), b""
    noise = quiet.Noise() if quiet_output else None
    while chunk := os.read(fd, 65536):
        lines, rest = split_lines(rest + chunk)
        _emit(_shown(lines, noise), head, lock, out or sys.stdout)
        log = _log(lines, log)
        if tail is not None:
            tail.extend(line.decode("utf-8", errors="replace") for line in lines)
    rest = rest.rstrip(b"\r")
    _emit(_shown([rest] if rest else [], noise), head, lock, out or sys.stdout)
    _log([rest] if rest else [], log)
    proc.stdout.close()


def _shown(lines: list[bytes], noise: quiet.Noise | None) -> list[bytes]:
    if noise is None:
        return lines
    return [line for line in lines if not noise.drops(line.decode("utf-8", errors="replace"))]


def _log(lines: list[bytes], log: BinaryIO | None) -> BinaryIO | None:
    """Append ``lines`` to ``log`` and flush; return the file, or None once it failed."""
    if log is None or not lines:
        return log
    try:
        log.write(b"".join(line + b"\n" for line in lines))
        log.flush()
    except ValueError:
        return None  # Closed: the launch ended while a detached grandchild still writes.
    except OSError as err:
        warn(f"cannot write {log.name} ({err}); this worker's output goes on to the terminal only")
        return None
    return log


def _emit(lines: list[bytes], head: str, lock: threading.Lock, out: TextIO) -> None:
    text = "".join(f"{head}{line.decode('utf-8', errors='replace')}\n" for line in lines)
    with lock:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # Closed stdout (e.g. piped into head): keep draining so workers don't block.


def _wait_first_failure(procs: Sequence[_Popen],
                        end_time: float | None = None) -> tuple[int, int] | None:
    # A preempted worker (75) is not a failure: the others stop at the same step and exit 75
    # too. Only one that does not within PREEMPT_WAIT_S, or exits otherwise, is.
    preempted_since: float | None = None
    while True:
        if end_time is not None and time.time() >= end_time:
            raise _StopError("the time limit (--time-limit) is reached; stopping the workers as "
                           "Slurm would (SIGTERM, then SIGKILL after --grace-period): what they "
                           "did not save is lost", EXIT_TIME_LIMIT)
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes)
                  if code and code != EXIT_PREEMPTED]
        preempted = [(rank, code) for rank, code in enumerate(codes) if code == EXIT_PREEMPTED]
        if failed:
            return failed[0]
        if all(code is not None for code in codes):
            return preempted[0] if preempted else None
        if preempted:
            preempted_since = preempted_since or time.monotonic()
            if time.monotonic() - preempted_since > PREEMPT_WAIT_S:
                return preempted[0]
        time.sleep(_POLL_S)


def _stop(procs: Sequence[_Popen], grace_period: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:  # Also sweeps what a finished worker left behind in its group.
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc: _Popen, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):  # The group is already gone.
        os.killpg(proc.pid, sig)


def _collective_timeout(spec: WorkerSpec) -> float | None:
    """The worker's collective timeout in seconds, if it has a valid one (the worker itself
    reports an invalid one)."""
    from tfdist.settings import resolve

    try:
        return resolve("collective_timeout", environ=spec.env)
    except ConfigError:
        return None


def _describe(rank: int, returncode: int) -> str:
    if returncode == EXIT_PREEMPTED:
        return f"worker {rank} was preempted and saved its state (exit code {EXIT_PREEMPTED})"
    if returncode < 0:
        return f"worker {rank} was killed by signal {-returncode}"
    return f"worker {rank} exited with code {returncode}"


def warn(message: str) -> None:
    """One line of the launcher's own on stderr, after ``tfdist launch: ``."""
    print(f"tfdist launch: {message}", file=sys.stderr, flush=True)
