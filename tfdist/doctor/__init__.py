"""``tfdist doctor``: check a launch in seconds, before hours of training depend on it.

Run it with the same launcher as the training, as its own step (the rendered job scripts do:
``srun python -m tfdist doctor``), or by hand on a login node with ``--dry-run``. Two phases:

1. **Meet** (:mod:`~tfdist.doctor.meet`): every rank reports what it found about itself
   (:mod:`~tfdist.doctor.probe`: host, cores, GPUs, versions, network settings) to rank 0 over a
   plain TCP connection to rank 0's port, with a deadline. Rank 0 checks them together
   (:mod:`~tfdist.doctor.report`: versions that differ, interfaces that do not exist, names that
   do not resolve, the launch's shape) and prints one table. Nothing slow has started yet.
2. **All-reduce** (:mod:`~tfdist.doctor.collective`): the engine starts as training will start
   it, and a tiny all-reduce across every rank must finish within the deadline; optionally a
   bandwidth probe of N MB.

With ``--model-dir D`` (:mod:`~tfdist.doctor.marks`) every rank writes a small mark into ``D``
before the meeting (a rank that cannot write there is an error), rank 0 reads every rank's mark
at the meeting (a mark it cannot read: that rank's ``D`` is another folder, node-local
scratch), and says whether a live training holds ``D`` (its lock, :mod:`tfdist.ownership`).

Every problem names the rank, its host and the fix; any error fails the launch: rank 0 exits 1
(after the ranks it stopped at the meeting have exited 0, so that a launcher that ends the
others at the first failure cuts no output), and a rank that fails by itself exits 1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tfdist import backend_facts as facts
from tfdist import hostlist, settings
from tfdist.backends import KERAS_BACKENDS, keras_backend
from tfdist.doctor import marks, meet, probe
from tfdist.doctor.report import Problem, RankReport, check, table
from tfdist.env import ClusterEnvironment, detect
from tfdist.env.base import local_ranks
from tfdist.errors import TfdistError

__all__ = ["Options", "run"]

# Below this bus bandwidth an all-reduce between nodes over NCCL has fallen back to TCP sockets
# (10/25 GbE gives ~1-3 GB/s; InfiniBand HDR 20+ GB/s, RoCE 100 GbE ~10 GB/s).
DEFAULT_NCCL_GBPS = 5.0


@dataclass(frozen=True)
class Options:
    """What ``tfdist doctor`` was asked to do (its command-line flags)."""

    timeout_s: float = 30.0
    bandwidth_mb: float = 0.0
    expect_gbps: float | None = None
    framework: str = "auto"
    backend: str | None = None
    dry_run: bool = False
    hosts: str | None = None
    model_dir: str | None = None


def run(options: Options) -> int:
    """Runs the doctor on this rank; returns the exit code (0: ready, 1: a problem)."""
    environment = detect()
    framework = _framework(options.framework)
    mine = probe.report(environment, framework=framework, backend=options.backend)
    if options.dry_run:
        return _dry_run(environment, mine, options)
    if options.model_dir:
        mine = marks.leave(mine, environment, options.model_dir)
    met = bool(environment.worker_addresses) and environment.is_distributed
    if met:  # rank 0 printed the table and the problems as soon as it had them
        problems = _meet(environment, mine, options.timeout_s, options.model_dir)
        if isinstance(problems, int):  # another rank: it could not connect, or rank 0 said no
            return problems
        if any(p.severity == "error" for p in problems):
            return 1
    line, reports, problems = _all_reduce(environment, mine, framework, options, met)
    if environment.is_chief:
        if not met:  # the reports came through the engine's own gather
            _report(environment, reports or [mine], problems)
        else:
            for problem in problems:
                print(f"tfdist doctor: {problem.line()}", file=sys.stderr, flush=True)
        print(line, flush=True)
    if any(p.severity == "error" for p in problems):
        return 1
    if environment.is_chief and options.model_dir:
        print(f"tfdist doctor: model_dir {options.model_dir}: every rank writes it and sees the "
              "same folder", flush=True)
        _save_time(options.model_dir)
    if environment.is_chief:
        print(f"tfdist doctor: ready: {environment.world_size} rank(s) on "
              f"{max(1, environment.num_nodes)} host(s)", flush=True)
    return 0


def _save_time(model_dir: str) -> None:
    """Rank 0: what a save into ``model_dir`` takes, and the limits it does not fit."""
    line, problems = marks.save_time(model_dir)
    if line:
        print(f"tfdist doctor: {line}", flush=True)
    for problem in problems:
        print(f"tfdist doctor: {problem.line()}", file=sys.stderr, flush=True)


def _framework(requested: str, installed: Callable[[str], bool] | None = None,
               keras: str | None = None) -> str:
    """The engine ``--framework auto`` checks: PyTorch's for one of its own backends, else
    Keras's (``"tf"``: TensorFlow, or JAX when Keras runs on it) where that is installed, else
    PyTorch's. ``installed`` and ``keras`` (Keras's backend) are read here unless given."""
    if requested != "auto":
        return requested
    with contextlib.suppress(TfdistError):  # an invalid value is reported by the probe
        if settings.resolve("backend") in set(facts.names(facts.TORCH)) - set(
                facts.names(facts.TF)):
            return "torch"  # one of PyTorch's only backends
    installed = installed or (lambda name: importlib.util.find_spec(name) is not None)
    keras = keras_backend() if keras is None else keras
    # A JAX install holds no TensorFlow: Keras 3 on JAX is still Keras's engine.
    on_jax = KERAS_BACKENDS.get(keras) == facts.JAX and installed("jax")
    return "tf" if installed("tensorflow") or on_jax else "torch"


def _stopped(rank: int, verdict: dict[str, Any]) -> bool:
    """Whether rank 0's verdict stops this rank (not rank 0); if so, says so with its own
    problems again, for a launch that writes each task's output to its own file (srun
    --output=task-%t.out)."""
    if verdict.get("ok"):
        return False
    own = "".join(f"\ntfdist doctor: {line}"
                  for line in verdict.get("lines", {}).get(str(rank), []))
    print(f"tfdist doctor: rank {rank} stops: rank 0's output lists "
          f"{verdict.get('errors', 'the')} problem(s){own}", file=sys.stderr, flush=True)
    return True


def _meet(environment: ClusterEnvironment, mine: RankReport,
          timeout_s: float, model_dir: str | None = None) -> list[Problem] | int:
    """Phase 1. Rank 0 gets every report, prints the table and returns the problems; the others
    get ``[]`` to go on, else (after saying why) their exit code: 1 when they could not reach
    rank 0; 0 when rank 0 stops them, so that rank 0, which exits 1 once every rank has hung up,
    is the only task to fail. A launcher that ends the others at the first failure (srun
    --kill-on-bad-exit) then has nothing left to end: on the Slurm test cluster, a step ended so
    lost lines its tasks had written up to a second before (what they had printed after their
    first line), the ending task's own too."""
    coordinator = environment.worker_addresses[0]
    if environment.rank != 0:
        try:
            verdict = meet.report_to(coordinator, mine.to_dict(), timeout_s,
                                     heard=functools.partial(_stopped, environment.rank))
        except (ConnectionError, TimeoutError) as error:
            print(f"tfdist doctor: error: rank {environment.rank} (host {mine.host}): cannot "
                  f"reach rank 0 at {coordinator} within {timeout_s:g} s: {error}. Fix: open "
                  "the port range between the nodes, or set TFDIST_HOST_TEMPLATE to an "
                  "interface that routes; `nc -zv HOST PORT` from this node tests it",
                  file=sys.stderr, flush=True)
            return 1
        return [] if verdict.get("ok") else 0  # _stopped said why before it hung up
    port = int(coordinator.rsplit(":", 1)[1])
    hosts = [address.rsplit(":", 1)[0] for address in environment.worker_addresses]

    def judge(meeting: meet.Meeting) -> dict[str, Any]:
        found = sorted((RankReport.from_dict(r) for r in meeting.reports.values()),
                       key=lambda report: report.rank)
        meeting.problems += check(found)
        if model_dir:  # every rank's mark, read before any rank hears the verdict
            meeting.problems += marks.problems(found, environment, model_dir)
        # Printed before any rank hears the verdict and hangs up.
        _report(environment, found, meeting.problems)
        errors = sum(p.severity == "error" for p in meeting.problems)
        lines: dict[str, list[str]] = {}
        for problem in meeting.problems:
            if problem.rank is not None:
                lines.setdefault(str(problem.rank), []).append(problem.line())
        return {"ok": errors == 0, "errors": errors, "lines": lines}

    meeting = meet.gather(port, environment.world_size, mine.to_dict(), timeout_s, judge,
                          hosts=hosts, host=mine.host)
    if not meeting.judged:  # it could not listen: nobody to answer, only this rank to show
        _report(environment, [mine], meeting.problems)
    return meeting.problems


def _report(environment: ClusterEnvironment, reports: list[RankReport],
            problems: list[Problem]) -> bool:
    """Rank 0 prints the table and the problems; whether any is an error."""
    if environment.is_chief:
        print(f"tfdist doctor: {environment.world_size} rank(s), {environment.reason}\n"
              + table(reports), flush=True)
        for problem in problems:
            print(f"tfdist doctor: {problem.line()}", file=sys.stderr, flush=True)
    return any(p.severity == "error" for p in problems)


def _all_reduce(environment: ClusterEnvironment, mine: RankReport, framework: str,
                options: Options, met: bool
                ) -> tuple[str, list[RankReport], list[Problem]]:
    """Phase 2: the engine's all-reduce (and bandwidth) within the deadline."""
    from tfdist.doctor import collective

    def hung() -> str:
        return (f"tfdist doctor: error: rank {environment.rank} (host {mine.host}): the "
                f"{framework} engine did not start or its first all-reduce across "
                f"{environment.world_size} ranks did not finish within {options.timeout_s:g} s"
                + (", although every rank reached rank 0's port" if met else "")
                + ". Fix: the framework's own connections are blocked or slow: TensorFlow "
                "dials every rank's own port, NCCL uses NCCL_SOCKET_IFNAME and InfiniBand "
                "(run with NCCL_DEBUG=INFO and look for NET/IB); a rank that crashed says why "
                "in its own output")

    if framework == "tf" and KERAS_BACKENDS.get(keras_backend()) == facts.JAX:  # the import is
        import jax  # noqa: F401  slow and not the collective's fault
    elif framework == "tf":
        from tfdist import quiet

        quiet.import_tensorflow()  # without TensorFlow's start-up lines, as training imports it
    with collective.watchdog(options.timeout_s, hung):
        engine = collective.start(framework, options.backend)
        correct, took = engine.sum_check()
        reports: list[RankReport] = []
        gathered = None if met or engine.gather is None else engine.gather(mine.to_dict())
        if gathered is not None:
            reports = [RankReport.from_dict(r) for r in gathered]
        rate = engine.bandwidth(options.bandwidth_mb) if options.bandwidth_mb > 0 else None
    # Met ranks were checked at the meeting; otherwise the engine's gather, or this one rank.
    problems = [] if met else check(reports or [mine])
    if not met and options.model_dir:
        problems += marks.problems(reports or [mine], environment, options.model_dir)
    if not correct:
        problems.append(Problem(environment.rank, mine.host, "the all-reduce summed wrong",
                                "report this with the output of every rank"))
    line = (f"tfdist doctor: all-reduce across {engine.world_size} rank(s) over {engine.name}: "
            f"{'correct' if correct else 'WRONG'}, {took * 1e3:.1f} ms")
    if rate is not None:
        median, spread = rate
        line += (f"; {options.bandwidth_mb:g} MB all-reduce: {median:.2f} GB/s bus bandwidth "
                 f"(median of {collective.ROUNDS}, spread {spread:.2f})")
        problems += _bandwidth_problems(median, options, mine, environment)
    return line, reports, problems


def _bandwidth_problems(median: float, options: Options, mine: RankReport,
                        environment: ClusterEnvironment) -> list[Problem]:
    expected, severity = options.expect_gbps, "error"
    if expected is None and mine.collective == "nccl" and environment.num_nodes > 1:
        expected, severity = DEFAULT_NCCL_GBPS, "warning"
    if expected is None or median >= expected:
        return []
    return [Problem(None, "", f"all-reduce bus bandwidth {median:.2f} GB/s is below the "
                    f"expected {expected:g} GB/s",
                    "run with NCCL_DEBUG=INFO: NET/Socket instead of NET/IB means NCCL missed "
                    "InfiniBand (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, the container's libraries)",
                    severity)]


def _dry_run(environment: ClusterEnvironment, mine: RankReport, options: Options) -> int:
    """Prints the plan this launch would run and the checks one process can make alone."""
    if options.hosts:
        template = settings.resolve("host_template")
        names = [template.format(host=host) for host in hostlist.expand_hostlist(options.hosts)]
        mine = RankReport.from_dict({**mine.to_dict(),
                                     "resolved": {**mine.resolved, **probe.resolve(names)}})
    if options.model_dir:  # this process alone: can it write there, does a live run hold it
        mine = marks.leave(mine, environment, options.model_dir)
    reports = [mine, *_planned(environment, mine)]
    problems = check([mine])
    if options.model_dir:
        problems += marks.problems([mine], environment, options.model_dir)
    print(f"tfdist doctor --dry-run: {environment.world_size} rank(s), {environment.reason}\n"
          + table(reports))
    for problem in problems:
        print(f"tfdist doctor: {problem.line()}", file=sys.stderr)
    if options.model_dir and not any(p.severity == "error" for p in problems):
        _save_time(options.model_dir)
    print("tfdist doctor: dry run: nothing was dialled; run `srun python -m tfdist doctor` "
          "(one task per GPU) in the job to check the ranks together", flush=True)
    return 1 if any(p.severity == "error" for p in problems) else 0


def _planned(environment: ClusterEnvironment, mine: RankReport) -> list[RankReport]:
    """The other ranks as the launch plans them (no facts of theirs: they were not asked)."""
    addresses = environment.worker_addresses
    hosts = [address.rsplit(":", 1)[0] for address in addresses]
    local = local_ranks(hosts)
    counts = {host: hosts.count(host) for host in hosts}
    return [RankReport(rank=r, host=hosts[r] if hosts[r] != socket.gethostname() else mine.host,
                       local_rank=local[r], local_world_size=counts[hosts[r]],
                       address=addresses[r], gpus="?", backend=mine.backend,
                       collective=mine.collective, versions=mine.versions, why=mine.why)
            for r in range(len(addresses)) if r != environment.rank]
