"""Run one script as N worker processes on this machine, each with its own ``TF_CONFIG``, or
with Horovod's Gloo variables (``--backend horovod``, like ``horovodrun --gloo``).

The ``build_*``/``assign_cpus``/``split_lines``/``env_changes``/``format_plan``/``check_command``
functions are pure and tested as tables; :func:`run_workers` is the thin runner: it starts the
processes, streams their output with a ``[rank] `` prefix (and, with ``--log-dir``, unprefixed
to one file per rank) and stops every worker as soon as one fails. ``--dry-run`` prints
:func:`format_plan` instead. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TextIO

from tfdist import quiet, timeouts
from tfdist.backends import facts
from tfdist.backends.facts import BACKENDS
from tfdist.errors import ConfigError, LaunchError
from tfdist.preemption import EXIT_PREEMPTED

__all__ = [
    "WorkerSpec",
    "assign_cpus",
    "build_command",
    "build_horovod_workers",
    "build_workers",
    "check_command",
    "env_changes",
    "exit_code",
    "format_plan",
    "free_ports",
    "horovod_worker_env",
    "launch",
    "log_path",
    "port_range",
    "run_workers",
    "split_lines",
    "tf_config",
    "worker_env",
]

LOCALHOST = "127.0.0.1"
LAUNCH_BACKENDS = tuple(row.name for row in BACKENDS if row.launchable)
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


def build_command(
    target: str, args: Sequence[str] = (), *, module: bool = False, python: str = sys.executable
) -> tuple[str, ...]:
    """Build the workers' argv the way ``python`` reads its command line.

    Args:
        target: A ``.py`` script, a module name (with ``module=True``) or an executable.
        args: The target's own arguments, passed through unparsed.
        module: Run ``python -m target``.
        python: Interpreter for scripts and modules (default: the launcher's).
    """
    if module:
        return (python, "-m", target, *args)
    if target.endswith(".py"):
        return (python, target, *args)
    return (target, *args)


def free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """Return ``count`` distinct free TCP ports on ``host``.

    Every socket stays bound until all ports are picked, so no port comes back twice.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_range(port_base: int, count: int) -> list[int]:
    """Return ports ``port_base .. port_base + count - 1``.

    Raises:
        ConfigError: If a port would fall outside 1024..65535.
    """
    highest = 65536 - count
    if not 1024 <= port_base <= highest:
        raise ConfigError(
            f"--port-base {port_base} does not fit {count} workers (ports {port_base}.."
            f"{port_base + count - 1}); choose a base between 1024 and {highest}, or leave out "
            "--port-base to use free ports."
        )
    return list(range(port_base, port_base + count))


def tf_config(ports: Sequence[int], rank: int, host: str = LOCALHOST) -> str:
    """Return the compact ``TF_CONFIG`` JSON of worker ``rank`` of a cluster on ``host``."""
    config = {
        "cluster": {"worker": [f"{host}:{port}" for port in ports]},
        "task": {"type": "worker", "index": rank},
    }
    return json.dumps(config, separators=(",", ":"))


def worker_env(base_env: Mapping[str, str], ports: Sequence[int], rank: int) -> dict[str, str]:
    """Return ``base_env`` plus ``TF_CONFIG`` (replacing an inherited one),
    ``TFDIST_LAUNCHER=local``, ``TFDIST_LOCAL_RANK``, ``TFDIST_LOCAL_WORLD_SIZE`` and
    ``PYTHONUNBUFFERED=1`` (so output streams line by line) for worker ``rank``."""
    env = dict(base_env)
    env.update(
        TF_CONFIG=tf_config(ports, rank),
        TFDIST_LAUNCHER="local",
        TFDIST_LOCAL_RANK=str(rank),
        TFDIST_LOCAL_WORLD_SIZE=str(len(ports)),
        PYTHONUNBUFFERED="1",
    )
    return env


def horovod_worker_env(
    base_env: Mapping[str, str], rendezvous_port: int, rank: int, size: int
) -> dict[str, str]:
    """Return ``base_env`` plus what horovodrun's Gloo mode sets for worker ``rank`` on this
    machine (rendezvous at ``127.0.0.1:rendezvous_port``), without ``TF_CONFIG``, plus
    ``TFDIST_LAUNCHER=local``, ``TFDIST_BACKEND=horovod``, ``TFDIST_LOCAL_RANK``,
    ``TFDIST_LOCAL_WORLD_SIZE`` and ``PYTHONUNBUFFERED=1``."""
    from tfdist.horovod.rendezvous import Slot, gloo_env
    from tfdist.settings import resolve

    env = dict(base_env)
    env.pop("TF_CONFIG", None)
    slot = Slot("localhost", rank, rank, 0, size, size, 1)
    env.update(gloo_env(slot, LOCALHOST, rendezvous_port,
                        resolve("horovod_gloo_iface", environ=base_env) or "lo",
                        resolve("horovod_gloo_timeout", environ=base_env)))
    env.update(
        TFDIST_LAUNCHER="local",
        TFDIST_BACKEND="horovod",
        TFDIST_LOCAL_RANK=str(rank),
        TFDIST_LOCAL_WORLD_SIZE=str(size),
        PYTHONUNBUFFERED="1",
    )
    return env


def assign_cpus(
    num_workers: int, cores: Sequence[int], cpus_per_worker: int | None = None
) -> list[frozenset[int]]:
    """Return the cores of each worker.

    Args:
        num_workers: Number of workers.
        cores: Cores available to the launcher, any order.
        cpus_per_worker: Give worker i the i-th block of this many consecutive cores. ``None``
            pins worker i to ``sorted(cores)[i % len(cores)]``: with more workers than cores,
            workers share cores.

    Raises:
        ConfigError: If there are no cores, or fewer than ``num_workers * cpus_per_worker``.
    """
    ordered = sorted(cores)
    if not ordered:
        raise ConfigError("no CPU cores to pin the workers to; pass --no-pin.")
    if cpus_per_worker is None:
        return [frozenset({ordered[i % len(ordered)]}) for i in range(num_workers)]
    k = cpus_per_worker
    if k < 1 or num_workers * k > len(ordered):
        raise ConfigError(
            f"--cpus-per-worker {k} with {num_workers} workers needs {num_workers * k} cores "
            f"but {len(ordered)} are available ({ordered}); lower --cpus-per-worker or -n, or "
            "leave out --cpus-per-worker to pin one core per worker."
        )
    return [frozenset(ordered[i * k : (i + 1) * k]) for i in range(num_workers)]


def build_workers(
    num_workers: int,
    command: Sequence[str],
    ports: Sequence[int],
    base_env: Mapping[str, str],
    cpu_sets: Sequence[frozenset[int]] | None = None,
) -> list[WorkerSpec]:
    """Describe the workers: one command, each with its own ``TF_CONFIG`` and cores.

    Raises:
        ConfigError: If ``num_workers < 1`` or ``ports``/``cpu_sets`` lack one entry per worker.
    """
    if num_workers < 1:
        raise ConfigError(f"-n/--num-workers must be at least 1, got {num_workers}.")
    if len(ports) != num_workers or (cpu_sets is not None and len(cpu_sets) != num_workers):
        raise ConfigError(f"need one port and one CPU set per worker ({num_workers} workers).")
    cpus = [None] * num_workers if cpu_sets is None else list(cpu_sets)
    argv = tuple(command)
    return [WorkerSpec(i, argv, worker_env(base_env, ports, i), cpus[i]) for i in range(len(cpus))]


def build_horovod_workers(
    num_workers: int,
    command: Sequence[str],
    rendezvous_port: int,
    base_env: Mapping[str, str],
    cpu_sets: Sequence[frozenset[int]] | None = None,
) -> list[WorkerSpec]:
    """Describe Horovod workers: one command, each with its ``HOROVOD_*`` variables and cores.

    Raises:
        ConfigError: If ``num_workers < 1`` or ``cpu_sets`` lacks one entry per worker.
    """
    if num_workers < 1:
        raise ConfigError(f"-n/--num-workers must be at least 1, got {num_workers}.")
    if cpu_sets is not None and len(cpu_sets) != num_workers:
        raise ConfigError(f"need one CPU set per worker ({num_workers} workers).")
    cpus = [None] * num_workers if cpu_sets is None else list(cpu_sets)
    return [
        WorkerSpec(i, tuple(command), horovod_worker_env(base_env, rendezvous_port, i,
                                                         num_workers), cpus[i])
        for i in range(num_workers)
    ]


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


def log_path(log_dir: str | os.PathLike[str], rank: int) -> Path:
    """Return the file that holds worker ``rank``'s output with ``--log-dir``."""
    return Path(log_dir) / f"rank-{rank}.log"


def check_command(
    command: Sequence[str], *, cwd: str | None = None, python: str = sys.executable
) -> None:
    """Refuse a :func:`build_command` command that no worker could start.

    When ``command`` runs ``python``, its ``.py`` script must exist (relative to ``cwd``,
    default: the current folder), or with ``-m`` the module's top-level package must be
    importable by this Python from ``cwd``, as ``python -m`` finds it; any other executable must
    be on ``PATH`` or be an executable path.

    Raises:
        ConfigError: The script, module or executable is missing; the message names it.
    """
    cwd = os.getcwd() if cwd is None else cwd
    if len(command) > 2 and command[0] == python and command[1] == "-m":
        if not _module_found(command[2].partition(".")[0], cwd):
            raise ConfigError(
                f"module {command[2]!r} not found by {python} (from {cwd}): check the name, "
                "install its package in this Python or run from the folder that holds it; for a "
                "script give its path ending in .py, without -m."
            )
    elif len(command) > 1 and command[0] == python and command[1].endswith(".py"):
        if not os.path.isfile(os.path.join(cwd, command[1])):
            raise ConfigError(
                f"script {command[1]!r} not found (from {cwd}): check the path; for a module use "
                "-m MODULE."
            )
    elif not (_is_executable(os.path.join(cwd, command[0])) if os.sep in command[0]
              else shutil.which(command[0])):
        raise ConfigError(
            f"{command[0]!r} is not an executable on PATH: check the name; scripts must end in "
            ".py and modules need -m."
        )


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _module_found(name: str, cwd: str) -> bool:
    # python -m searches its working folder first; the launcher's own sys.path may not hold it.
    if name in sys.modules or name in sys.builtin_module_names:
        return True
    saved = sys.path[:]
    sys.path.insert(0, cwd)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved


def env_changes(base_env: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str | None]:
    """Return the variables ``env`` adds to or changes in ``base_env`` (name -> new value) and
    those it removes (name -> None), sorted by name."""
    names = {name for name in env if base_env.get(name) != env[name]}
    names |= {name for name in base_env if name not in env}
    return {name: env.get(name) for name in sorted(names)}


def format_plan(
    workers: Sequence[WorkerSpec],
    base_env: Mapping[str, str],
    *,
    log_dir: str | os.PathLike[str] | None = None,
) -> str:
    """Return what ``--dry-run`` prints for each worker: its command, cores, GPUs, log file and
    the variables the launch sets or removes, against the launcher's ``base_env``.

    Variable lines are shell syntax (``NAME=value`` quoted with :func:`shlex.quote`, ``unset
    NAME``). The GPUs are those ``tfdist.init()`` (or ``tfdist.torch.init()``) would keep in that
    worker: the launch itself gives every worker the same ``CUDA_VISIBLE_DEVICES``.
    """
    from tfdist.doctor.report import ranges

    blocks = []
    for spec in workers:
        lines = [f"worker {spec.rank}:", f"  command: {shlex.join(spec.argv)}",
                 "  cores: " + ("not pinned" if spec.cpus is None else ranges(spec.cpus)),
                 f"  gpus: {_gpu_note(spec.env)}"]
        if log_dir is not None:
            lines.append(f"  log: {log_path(log_dir, spec.rank)}")
        for name, value in env_changes(base_env, spec.env).items():
            lines.append(f"  unset {name}" if value is None else f"  {name}={shlex.quote(value)}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks) + "\n"


def _gpu_note(env: Mapping[str, str]) -> str:
    from tfdist.devices import select_gpus
    from tfdist.env import detect

    try:
        environment = detect(env)
        chosen = select_gpus(environment.visible_devices, environment.local_rank,
                             environment.local_world_size, environment.gpus_per_task is not None)
    except (ConfigError, LaunchError) as err:
        return f"tfdist.init() would fail: {err}"
    if chosen is None:
        return (f"its share (local rank {environment.local_rank} of "
                f"{environment.local_world_size}) of the GPUs the framework counts; "
                "CUDA_VISIBLE_DEVICES is unset")
    visible = f"CUDA_VISIBLE_DEVICES={environment.visible_devices}"
    return f"{chosen} (tfdist.init() keeps these of {visible})" if chosen else f"none ({visible})"


def launch(
    command: Sequence[str],
    num_workers: int,
    *,
    port_base: int | None = None,
    pin: bool = True,
    cpus_per_worker: int | None = None,
    grace_period: float = 10.0,
    prefix: bool = True,
    base_env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    backend: str = "mwms",
    max_restarts: int = 0,
    log_dir: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    gpus_per_worker: int | None = None,
) -> int:
    """Run ``command`` as ``num_workers`` local workers: ``tfdist launch``.

    Ports are free ones unless ``port_base`` is given. With ``pin`` each worker is pinned to
    one core of the launcher's affinity (or ``cpus_per_worker`` consecutive cores). With
    ``backend="horovod"`` the launcher serves Horovod's Gloo rendezvous (on ``port_base`` when
    given) and gives the workers horovodrun's variables instead of ``TF_CONFIG``.

    With ``log_dir`` (created if missing) each worker's output also goes, unprefixed, to
    :func:`log_path` (``log_dir/rank-R.log``, emptied at the start, the runs of
    ``max_restarts`` one after the other), flushed as it arrives.

    With ``gpus_per_worker`` K every worker gets the first ``num_workers * K`` GPU ids
    (:func:`tfdist.devices.launch_gpus`), of which its ``tfdist.init()`` keeps its own K; more
    than one is MultiWorkerMirroredStrategy's (Horovod drives one GPU per process). Without it
    the workers share the GPUs they inherit equally.

    The script, module or executable must exist (:func:`check_command`). With ``dry_run`` the
    options are checked as for a launch, then :func:`format_plan` of the
    first run's workers is written to ``out`` and nothing is started (no process, no rendezvous
    server, no ``log_dir``); its free ports are picked again by a real launch.

    SIGUSR1 to the launcher goes to every worker (a walltime warning, as srun forwards it), and
    SIGTERM too, before they are stopped. Workers that exit with
    :data:`~tfdist.preemption.EXIT_PREEMPTED` (75) saved their state at an agreed step: the
    launcher waits for all of them and, with ``max_restarts``, starts them all again (as a
    requeue would), as it does after a failure; each run's workers see ``TFDIST_RESTART_COUNT``.

    Returns:
        0 if every worker succeeds (or for a dry run); 75 if they were preempted; else the first
        failing worker's exit code (128 + N if killed by signal N); 130 on Ctrl-C and 143 on
        SIGTERM to the launcher (75 if every worker then saved its state and exited preempted).

    Raises:
        ConfigError: If an option is impossible; the message says which to change.
        LaunchError: If a worker cannot be started.
    """
    if grace_period < 0:
        raise ConfigError(f"--grace-period must be >= 0 seconds, got {grace_period}.")
    if cpus_per_worker is not None and not pin:
        raise ConfigError("--cpus-per-worker pins workers; do not combine it with --no-pin.")
    if backend not in LAUNCH_BACKENDS:
        raise ConfigError(f"--backend {backend!r} is not one of {LAUNCH_BACKENDS}.")
    horovod = facts.backend(backend).horovod  # Horovod's rendezvous and variables
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}.")
    if port_base is not None:  # Checked before anything starts; used per run below.
        port_range(port_base, 1 if horovod else num_workers)
    if gpus_per_worker is not None and gpus_per_worker < 1:
        raise ConfigError(f"--gpus-per-worker must be at least 1, got {gpus_per_worker}.")
    if horovod and (gpus_per_worker or 1) > 1:
        raise ConfigError(f"--gpus-per-worker {gpus_per_worker} with --backend horovod: Horovod "
                          "drives one GPU per process. Start one worker per GPU "
                          "(--gpus-per-worker 1), or leave out --backend horovod: "
                          "MultiWorkerMirroredStrategy drives several GPUs per worker.")
    if horovod:
        _require_horovod()
    base = os.environ if base_env is None else base_env
    quiet_output = quiet.wanted(base)  # TensorFlow's start-up noise off (TFDIST_VERBOSE=1: on)
    base = inherited = quiet.quiet_env(base)
    if gpus_per_worker is not None:
        from tfdist import devices

        base = {**base, "CUDA_VISIBLE_DEVICES": devices.launch_gpus(
            base.get("CUDA_VISIBLE_DEVICES"), devices.node_gpus(), num_workers, gpus_per_worker)}
    cpu_sets = None
    if pin and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        cpu_sets = assign_cpus(num_workers, cores, cpus_per_worker)
        if cpus_per_worker is None and num_workers > len(cores):
            _warn(
                f"{num_workers} workers on {len(cores)} cores {cores}: workers share cores "
                "(worker i runs on core i mod cores); pass --no-pin to leave it to the OS."
            )
    check_command(command)
    if dry_run:
        env = {**base, "TFDIST_RESTART_COUNT": "0"}
        if horovod:
            port = free_ports(1)[0] if port_base is None else port_range(port_base, 1)[0]
            workers = build_horovod_workers(num_workers, command, port, env, cpu_sets)
        else:
            workers = build_workers(num_workers, command, _ports(port_base, num_workers), env,
                                    cpu_sets)
        (out or sys.stdout).write(_plan_header(backend, num_workers, port_base, max_restarts)
                                  + format_plan(workers, inherited, log_dir=log_dir))
        return 0
    with ExitStack() as files:
        logs = None if log_dir is None else _open_logs(log_dir, num_workers, files)
        options: dict[str, Any] = {"grace_period": grace_period, "prefix": prefix, "out": out,
                                   "logs": logs, "hide_noise": quiet_output}
        for restart in range(max_restarts + 1):
            env = {**base, "TFDIST_RESTART_COUNT": str(restart)}
            if horovod:
                code = _launch_horovod(command, num_workers, port_base, env, cpu_sets, options)
            else:
                workers = build_workers(num_workers, command, _ports(port_base, num_workers),
                                        env, cpu_sets)
                code = run_workers(workers, **options)
            if code == 0 or code in (130, 128 + signal.SIGTERM) or restart == max_restarts:
                break
            _warn(f"restarting all workers ({restart + 1} of --max-restarts {max_restarts}) "
                  "after " + ("a preemption" if code == EXIT_PREEMPTED else f"exit code {code}"))
    if code and max_restarts and code not in (130, 128 + signal.SIGTERM):
        _warn(f"giving up after {max_restarts} restart(s): the last run ended with code {code}")
    return code


def _ports(port_base: int | None, num_workers: int) -> list[int]:
    return free_ports(num_workers) if port_base is None else port_range(port_base, num_workers)


def _plan_header(backend: str, num_workers: int, port_base: int | None, max_restarts: int) -> str:
    lines = [f"tfdist launch --dry-run: {num_workers} worker(s), --backend {backend}; nothing "
             "was started."]
    if port_base is None:
        lines.append("Ports are free ones picked now; a launch picks them again (--port-base P "
                     "fixes them).")
    if max_restarts:
        lines.append(f"Up to {max_restarts} restart(s): each run's workers get "
                     "TFDIST_RESTART_COUNT=0, 1, ...")
    return "\n".join(lines) + "\n"


def _open_logs(
    log_dir: str | os.PathLike[str], num_workers: int, files: ExitStack
) -> dict[int, BinaryIO]:
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        return {rank: files.enter_context(log_path(log_dir, rank).open("wb"))
                for rank in range(num_workers)}
    except OSError as err:
        raise ConfigError(
            f"--log-dir {os.fspath(log_dir)!r}: cannot write the workers' logs there ({err}); "
            "choose a folder you can write to."
        ) from err


def _require_horovod() -> None:
    from tfdist.horovod.install import is_installed

    if not is_installed():
        raise ConfigError(
            f"tfdist launch --backend horovod serves Horovod's rendezvous, and needs horovod "
            f"in the launcher's Python ({sys.executable}): run the tfdist of the environment "
            "where Horovod is built (e.g. .venv-horovod/bin/tfdist, see `make venv-horovod`)."
        )


def _launch_horovod(
    command: Sequence[str],
    num_workers: int,
    port_base: int | None,
    env: Mapping[str, str],
    cpu_sets: Sequence[frozenset[int]] | None,
    options: dict[str, Any],
) -> int:
    from tfdist.horovod.rendezvous import RendezvousServer, slots

    port = 0 if port_base is None else port_range(port_base, 1)[0]
    server = RendezvousServer(port, slots(["localhost"] * num_workers))
    try:
        workers = build_horovod_workers(num_workers, command, server.port, env, cpu_sets)
        return run_workers(workers, **options)
    finally:
        server.stop()


def run_workers(
    workers: Sequence[WorkerSpec],
    *,
    grace_period: float = 10.0,
    prefix: bool = True,
    out: TextIO | None = None,
    logs: Mapping[int, BinaryIO] | None = None,
    hide_noise: bool = False,
) -> int:
    """Start ``workers``, stream their output to ``out`` and wait; returns as :func:`launch`.

    ``logs`` maps a rank to a binary file that also gets that worker's lines, unprefixed and
    undecoded, flushed as they arrive; the caller closes it. With ``hide_noise``, TensorFlow's
    start-up lines (:func:`tfdist.quiet.is_noise`) reach the logs only, not ``out``. Each worker
    runs in its own session (process group). When one fails, or the launcher gets Ctrl-C or
    SIGTERM, every group gets SIGTERM, then SIGKILL after ``grace_period`` seconds; their output
    is read to the end.
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
            failure = _wait_first_failure(procs)
            if failure is None:
                return 0
            rank, returncode = failure
            others = any(proc.poll() is None for proc in procs)
            _warn(_describe(rank, returncode) + ("; stopping the other workers" if others else ""))
            if returncode < 0:  # killed: its own last words may be missing, say them for it
                threads[rank].join(_JOIN_S)
                said = timeouts.crashed("\n".join(tails[rank]), workers[rank].rank,
                                        _collective_timeout(workers[rank]))
                if said:
                    _warn(f"worker {rank}: {said}")
            return exit_code(returncode)
    except KeyboardInterrupt:
        _warn("interrupted; stopping the workers")
        return 130
    except _SigtermError:
        _warn("got SIGTERM; stopping the workers (SIGTERM first: they save their state if they "
              "can)")
        return 128 + signal.SIGTERM
    finally:
        # A second Ctrl-C while stopping must not leave workers behind; the stop is bounded.
        with _handle([signal.SIGINT, signal.SIGTERM], signal.SIG_IGN):
            _stop(procs, grace_period)
        for thread in threads:  # Before returning: the last lines reach the terminal and logs.
            thread.join(_JOIN_S)  # Bounded: a detached grandchild may still hold the pipe.
        if procs and all(proc.returncode == EXIT_PREEMPTED for proc in procs):
            return EXIT_PREEMPTED  # noqa: B012 (every worker saved its state: say so)


class _SigtermError(Exception):
    """The launcher got SIGTERM."""


def _raise_terminated(*_: object) -> NoReturn:
    raise _SigtermError


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


def _start(spec: WorkerSpec) -> _Popen:
    cpus = spec.cpus
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    try:
        return subprocess.Popen(
            spec.argv,
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=pin,  # Safe: no reader thread runs yet (see run_workers).
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
    while chunk := os.read(fd, 65536):
        lines, rest = split_lines(rest + chunk)
        _emit(_shown(lines, quiet_output), head, lock, out or sys.stdout)
        log = _log(lines, log)
        if tail is not None:
            tail.extend(line.decode("utf-8", errors="replace") for line in lines)
    rest = rest.rstrip(b"\r")
    _emit(_shown([rest] if rest else [], quiet_output), head, lock, out or sys.stdout)
    _log([rest] if rest else [], log)
    proc.stdout.close()


def _shown(lines: list[bytes], quiet_output: bool) -> list[bytes]:
    if not quiet_output:
        return lines
    return [line for line in lines if not quiet.is_noise(line.decode("utf-8", errors="replace"))]


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
        _warn(f"cannot write {log.name} ({err}); this worker's output goes on to the terminal only")
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


def _wait_first_failure(procs: Sequence[_Popen]) -> tuple[int, int] | None:
    # A preempted worker (75) is not a failure: the others stop at the same step and exit 75
    # too. Only one that does not within PREEMPT_WAIT_S, or exits otherwise, is.
    preempted_since: float | None = None
    while True:
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


def _warn(message: str) -> None:
    print(f"tfdist launch: {message}", file=sys.stderr, flush=True)
