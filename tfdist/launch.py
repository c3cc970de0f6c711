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
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from tfdist import backend_facts as facts
from tfdist import quiet
from tfdist.backend_facts import BACKENDS
from tfdist.errors import EXIT_CONFIG, ConfigError, LaunchError
from tfdist.preemption import EXIT_PREEMPTED
from tfdist.supervisor import WorkerSpec, exit_code, run_workers, split_lines, warn

__all__ = [
    "WorkerSpec",
    "assign_cpus",
    "build_command",
    "build_horovod_workers",
    "build_workers",
    "busy_ports",
    "check_command",
    "env_changes",
    "exit_code",
    "format_plan",
    "free_ports",
    "given_ports",
    "horovod_worker_env",
    "launch",
    "log_path",
    "next_run",
    "port_range",
    "run_workers",
    "split_lines",
    "tf_config",
    "worker_env",
]

LOCALHOST = "127.0.0.1"
LAUNCH_BACKENDS = tuple(row.name for row in BACKENDS if row.launchable)


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


def busy_ports(ports: Sequence[int]) -> list[int]:
    """The ports of ``ports`` that another process listens on, on any address of this machine
    (a port left in TIME_WAIT by a run that ended counts as free, as it is for the workers)."""
    busy = []
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", port))
            except OSError:
                busy.append(port)
    return busy


def given_ports(port_base: int, count: int) -> list[int]:
    """:func:`port_range`, each port checked free now: a worker would otherwise fail deep in
    its framework's start ("Could not start gRPC server").

    Raises:
        ConfigError: a port is outside 1024..65535 or in use, with the fix.
    """
    ports = port_range(port_base, count)
    busy = busy_ports(ports)
    if busy:
        taken = ", ".join(map(str, busy))
        raise ConfigError(
            f"--port-base {port_base}: port{'s' if len(busy) > 1 else ''} {taken} of the "
            f"workers' {port_base}..{port_base + count - 1} {'are' if len(busy) > 1 else 'is'} "
            "in use by another process on this machine (`ss -ltnp` names it); choose another "
            "--port-base, or leave it out to use free ports.")
    return ports


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


@dataclass(frozen=True)
class LaunchOptions:
    """``tfdist launch``'s options (:func:`launch` takes them as keywords).

    Attributes:
        command: the workers' argv (:func:`build_command`); the script, module or executable
            must exist (:func:`check_command`).
        num_workers: how many local workers.
        port_base: the workers' ports ``P, P+1, ...`` (Horovod: its rendezvous' port); default:
            free ones.
        pin, cpus_per_worker: pin each worker to one core of the launcher's affinity (or to
            ``cpus_per_worker`` consecutive cores).
        grace_period: seconds between SIGTERM and SIGKILL when the workers are stopped.
        prefix: each output line starts with ``[rank] ``.
        backend: a ``launchable`` row of the backend table: ``mwms`` gives each worker a
            ``TF_CONFIG``; ``horovod`` serves Horovod's Gloo rendezvous and gives the workers
            horovodrun's variables.
        max_restarts: start every worker again after a failure or a preemption (exit code 75:
            every worker saved its state at an agreed step), as a requeue would; each run's
            workers see ``TFDIST_RESTART_COUNT``. Not after exit code 78, one of tfdist's own
            errors in the script's set-up, which every run would repeat (:func:`next_run`).
        log_dir: created if missing; each worker's output also goes, unprefixed, to
            :func:`log_path` (``log_dir/rank-R.log``, emptied at the start, the runs one after
            the other), flushed as it arrives.
        time_limit: each run's walltime in seconds: its workers get its end as
            ``TFDIST_END_TIME`` (:mod:`tfdist.walltime` stops, saves and exits 75 in time, or
            exits 78 at the first step when the limit leaves no time past its margin), and
            the launch stops them at the end as Slurm would (SIGTERM, then SIGKILL after
            ``grace_period``); the next run of ``max_restarts`` gets a new limit, as a requeued
            job does.
        gpus_per_worker: K: every worker gets the first ``num_workers * K`` GPU ids
            (:func:`tfdist.devices.launch_gpus`), of which its ``tfdist.init()`` keeps its own
            K; more than one is MultiWorkerMirroredStrategy's. Without it the workers share the
            GPUs they inherit equally.
    """

    command: tuple[str, ...]
    num_workers: int
    port_base: int | None = None
    pin: bool = True
    cpus_per_worker: int | None = None
    grace_period: float = 10.0
    prefix: bool = True
    backend: str = "mwms"
    max_restarts: int = 0
    log_dir: str | os.PathLike[str] | None = None
    gpus_per_worker: int | None = None
    time_limit: float | None = None

    def check(self) -> _Mode:
        """Checks the options before anything starts; returns the backend's launch mode.

        Raises:
            ConfigError: an option is impossible; the message says which to change.
        """
        if self.grace_period < 0:
            raise ConfigError(f"--grace-period must be >= 0 seconds, got {self.grace_period}.")
        if self.cpus_per_worker is not None and not self.pin:
            raise ConfigError("--cpus-per-worker pins workers; do not combine it with --no-pin.")
        if self.backend not in LAUNCH_BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} is not one of {LAUNCH_BACKENDS}.")
        mode = _HOROVOD if facts.backend(self.backend).horovod else _TF_CONFIG
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}.")
        if self.port_base is not None:
            port_range(self.port_base, mode.ports(self.num_workers))
        if self.gpus_per_worker is not None and self.gpus_per_worker < 1:
            raise ConfigError(f"--gpus-per-worker must be at least 1, got "
                              f"{self.gpus_per_worker}.")
        mode.check(self)
        return mode


@dataclass(frozen=True)
class _Plan:
    """What every run of a launch gives its workers: the variables (``env``: the launcher's,
    ``inherited`` before tfdist's changes) and the cores, and whether TensorFlow's start-up
    lines are hidden."""

    env: dict[str, str]
    inherited: Mapping[str, str]
    cpu_sets: list[frozenset[int]] | None
    quiet_output: bool


class _Mode:
    """How ``tfdist launch`` starts the workers of one kind of backend: the ports it needs, its
    checks, the workers of a dry run, and one run."""

    def ports(self, num_workers: int) -> int:
        return num_workers

    def check(self, options: LaunchOptions) -> None:
        del options

    def workers(self, options: LaunchOptions, env: Mapping[str, str],
                cpu_sets: Sequence[frozenset[int]] | None) -> list[WorkerSpec]:
        """The workers with ports picked now (a dry run's; a run picks them again)."""
        return build_workers(options.num_workers, options.command,
                             _ports(options.port_base, options.num_workers), env, cpu_sets)

    def run(self, options: LaunchOptions, env: Mapping[str, str],
            cpu_sets: Sequence[frozenset[int]] | None,
            supervise: Callable[[list[WorkerSpec]], int]) -> int:
        return supervise(self.workers(options, env, cpu_sets))


class _HorovodMode(_Mode):
    """Horovod's: one port, its Gloo rendezvous served by the launcher, horovodrun's
    variables."""

    def ports(self, num_workers: int) -> int:
        return 1

    def check(self, options: LaunchOptions) -> None:
        if (options.gpus_per_worker or 1) > 1:
            raise ConfigError(f"--gpus-per-worker {options.gpus_per_worker} with --backend "
                              "horovod: Horovod drives one GPU per process. Start one worker "
                              "per GPU (--gpus-per-worker 1), or leave out --backend horovod: "
                              "MultiWorkerMirroredStrategy drives several GPUs per worker.")
        _require_horovod()

    def workers(self, options: LaunchOptions, env: Mapping[str, str],
                cpu_sets: Sequence[frozenset[int]] | None) -> list[WorkerSpec]:
        port = (free_ports(1)[0] if options.port_base is None
                else given_ports(options.port_base, 1)[0])
        return build_horovod_workers(options.num_workers, options.command, port, env, cpu_sets)

    def run(self, options: LaunchOptions, env: Mapping[str, str],
            cpu_sets: Sequence[frozenset[int]] | None,
            supervise: Callable[[list[WorkerSpec]], int]) -> int:
        from tfdist.horovod.rendezvous import RendezvousServer, slots

        port = 0 if options.port_base is None else given_ports(options.port_base, 1)[0]
        server = RendezvousServer(port, slots(["localhost"] * options.num_workers))
        try:
            return supervise(build_horovod_workers(options.num_workers, options.command,
                                                   server.port, env, cpu_sets))
        finally:
            server.stop()


_TF_CONFIG, _HOROVOD = _Mode(), _HorovodMode()


def launch(command: Sequence[str], num_workers: int, *, base_env: Mapping[str, str] | None = None,
           out: TextIO | None = None, dry_run: bool = False, **options: Any) -> int:
    """Run ``command`` as ``num_workers`` local workers: ``tfdist launch``.

    ``options`` are :class:`LaunchOptions`' fields. The workers get ``base_env`` (default: this
    process's variables) with tfdist's changes; their output goes to ``out`` (default: stdout).
    With ``dry_run`` the options are checked as for a launch, then :func:`format_plan` of the
    first run's workers is written to ``out`` and nothing is started (no process, no rendezvous
    server, no ``log_dir``); its free ports are picked again by a real launch.

    SIGUSR1 to the launcher goes to every worker (a walltime warning, as srun forwards it), and
    SIGTERM too, before they are stopped (:func:`tfdist.supervisor.run_workers`).

    Returns:
        0 if every worker succeeds (or for a dry run); 75 if they were preempted; else the first
        failing worker's exit code (128 + N if killed by signal N); 130 on Ctrl-C and 143 on
        SIGTERM to the launcher, 124 when ``time_limit`` ran out (75 if every worker then saved
        its state and exited preempted).

    Raises:
        ConfigError: If an option is impossible; the message says which to change.
        LaunchError: If a worker cannot be started.
    """
    checked = LaunchOptions(tuple(command), num_workers, **options)
    mode = checked.check()
    plan = _plan(checked, os.environ if base_env is None else base_env)
    if not dry_run:
        return _run(checked, mode, plan, out)
    workers = mode.workers(checked, {**plan.env, "TFDIST_RESTART_COUNT": "0"}, plan.cpu_sets)
    (out or sys.stdout).write(_plan_header(checked) + format_plan(workers, plan.inherited,
                                                                  log_dir=checked.log_dir))
    return 0


def _plan(options: LaunchOptions, base: Mapping[str, str]) -> _Plan:
    """The variables and cores of every run's workers (a dry run's too)."""
    quiet_output = quiet.wanted(base)  # TensorFlow's start-up noise off (TFDIST_VERBOSE=1: on)
    env = inherited = quiet.quiet_env(base)
    if options.gpus_per_worker is not None:
        from tfdist import devices

        env = {**env, "CUDA_VISIBLE_DEVICES": devices.launch_gpus(
            env.get("CUDA_VISIBLE_DEVICES"), devices.node_gpus(), options.num_workers,
            options.gpus_per_worker)}
    cpu_sets = None
    if options.pin and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        cpu_sets = assign_cpus(options.num_workers, cores, options.cpus_per_worker)
        if options.cpus_per_worker is None and options.num_workers > len(cores):
            warn(f"{options.num_workers} workers on {len(cores)} cores {cores}: workers share "
                 "cores (worker i runs on core i mod cores); pass --no-pin to leave it to the "
                 "OS.")
    check_command(options.command)
    return _Plan(dict(env), inherited, cpu_sets, quiet_output)


def _run(options: LaunchOptions, mode: _Mode, plan: _Plan, out: TextIO | None) -> int:
    """Every run of the launch: the first, and up to ``max_restarts`` more."""
    restarts = options.max_restarts
    with ExitStack() as files:
        logs = None if options.log_dir is None else _open_logs(options.log_dir,
                                                               options.num_workers, files)

        deadline: list[float | None] = [None]

        def supervise(workers: list[WorkerSpec]) -> int:
            return run_workers(workers, grace_period=options.grace_period,
                               prefix=options.prefix, out=out, logs=logs,
                               hide_noise=plan.quiet_output, end_time=deadline[0])

        for restart in range(restarts + 1):
            env = {**plan.env, "TFDIST_RESTART_COUNT": str(restart)}
            if options.time_limit is not None:  # each run a new limit, as a requeued job
                deadline[0] = time.time() + options.time_limit
                env["TFDIST_END_TIME"] = f"{deadline[0]:.3f}"
            code = mode.run(options, env, plan.cpu_sets, supervise)
            again, line = next_run(code, restart, restarts)
            if line is not None:
                warn(line)
            if not again:
                break
    return code


def next_run(code: int, restart: int, restarts: int) -> tuple[bool, str | None]:
    """Whether the launch starts every worker again after a run that ended with ``code``, and
    the line it says (pure). ``restart``: the run's number (0 for the first); ``restarts``:
    ``--max-restarts``.

    A preemption (75) or a failure is restarted while restarts are left; success, Ctrl-C
    (130) and SIGTERM to the launcher (143) are not, and neither is
    :data:`tfdist.errors.EXIT_CONFIG` (78): a worker ended with one of tfdist's own errors (a
    setting, the order of the script's calls, the model_dir: :mod:`tfdist.uncaught`), and
    every run would stop there again.
    """
    if code == 0 or code in (130, 128 + signal.SIGTERM):
        return False, None
    if code == EXIT_CONFIG:
        return False, (f"not restarting (--max-restarts {restarts}): a worker exited "
                       f"{EXIT_CONFIG}, an error in the script's set-up that tfdist named above, "
                       "and every run would stop there again" if restarts else None)
    if restart >= restarts:
        return False, (f"giving up after {restarts} restart(s): the last run ended with code "
                       f"{code}" if restarts else None)
    return True, (f"restarting all workers ({restart + 1} of --max-restarts {restarts}) after "
                  + ("a preemption" if code == EXIT_PREEMPTED else f"exit code {code}"))


def _ports(port_base: int | None, num_workers: int) -> list[int]:
    return free_ports(num_workers) if port_base is None else given_ports(port_base, num_workers)


def _plan_header(options: LaunchOptions) -> str:
    lines = [f"tfdist launch --dry-run: {options.num_workers} worker(s), --backend "
             f"{options.backend}; nothing was started."]
    if options.port_base is None:
        lines.append("Ports are free ones picked now; a launch picks them again (--port-base P "
                     "fixes them).")
    if options.max_restarts:
        lines.append(f"Up to {options.max_restarts} restart(s): each run's workers get "
                     "TFDIST_RESTART_COUNT=0, 1, ...")
    if options.time_limit is not None:
        lines.append(f"--time-limit: each run ends {options.time_limit:g} s after its start; its "
                     "workers get that end as TFDIST_END_TIME (seconds since the epoch).")
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
