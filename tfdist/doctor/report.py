"""The doctor's verdict: every rank's report, the checks across them, and the table. Pure.

A :class:`RankReport` is what one rank found out about itself (host, cores, GPUs, versions,
network settings) without touching the network or TensorFlow. :func:`check` turns the reports
of all ranks into :class:`Problem` s, each naming the rank, the host and the fix; :func:`table`
prints the plan. Nothing here reads the environment: tests build reports by hand.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfdist import backend_facts as facts
from tfdist.backend_facts import Backend
from tfdist.devices import one_gpu_per_process

__all__ = ["INTERFACE_VARIABLES", "TESTED_TENSORFLOW", "Problem", "RankReport", "check",
           "interface_problem", "model_dir_problems", "untested_tensorflow",
           "ranges", "table", "version_problems"]

# Variables naming network interfaces, and how each reads them: NCCL's and Gloo's take a list of
# prefixes (NCCL: `^` excludes, `=` matches exactly); Horovod's Gloo takes one name.
INTERFACE_VARIABLES = {"NCCL_SOCKET_IFNAME": "nccl", "GLOO_SOCKET_IFNAME": "list",
                       "HOROVOD_GLOO_IFACE": "exact"}
# Packages whose versions must agree on every rank (absent ones are left out of the table).
PACKAGES = ("python", "tensorflow", "keras", "tf_keras", "jax", "jaxlib", "tfdist", "horovod",
            "torch", "deepspeed")
# The TensorFlow releases `make test` runs tfdist's tests on, oldest and newest (major, minor):
# the TensorFlow 2.15 lane's and the 2.22 lane's pins (tests/test_doctor.py holds them to the
# files; .venv's 2.21 lies between).
TESTED_TENSORFLOW = ((2, 15), (2, 22))


@dataclass(frozen=True)
class Problem:
    """Something that stops training or slows it: where, what, and the fix.

    ``rank`` is None for a problem of the whole launch; ``severity`` is ``"error"`` (the doctor
    exits non-zero) or ``"warning"``.
    """

    rank: int | None
    host: str
    what: str
    fix: str = ""
    severity: str = "error"

    def line(self) -> str:
        where = (f"rank {self.rank} (host {self.host})" if self.rank is not None
                 else f"host {self.host}" if self.host else "the launch")
        fix = f" Fix: {self.fix}." if self.fix else ""
        return f"{self.severity}: {where}: {self.what.rstrip('.')}.{fix}"


@dataclass(frozen=True)
class RankReport:
    """What one rank found out about itself before any collective.

    Attributes:
        rank, local_rank, local_world_size: from the launch.
        host: the machine's name (``socket.gethostname()``), not the launcher's.
        address: ``host:port`` this rank's framework will listen on, or ``""``.
        cpus: the cores it may run on, as ranges (``"0-3,8"``).
        gpus: the CUDA ids it will drive (``"3"``), ``""`` for none, ``"?"`` when the framework
            counts them.
        slurm_gpus: the physical ids Slurm gave the step on this node, or ``""``.
        node_gpus: GPU device files on the node (``/dev/nvidia0`` ...).
        gpus_per_task: ``srun --gpus-per-task``, or None.
        replicas: the devices this rank will train a replica on: its GPUs under MWMS or
            MirroredStrategy, one under Horovod and torch, ``TFDIST_CPU_REPLICAS`` on a CPU.
        gpu_share: the GPUs this rank was given (its ids, or its share of the node's when
            the framework counts them); more than ``replicas`` leaves some idle.
        backend, collective, why: the engine this rank will use and why.
        versions: package -> version (see :data:`PACKAGES`).
        interfaces: the network interfaces of the node.
        network: interface and host variables as set (see :data:`INTERFACE_VARIABLES`).
        resolved: name -> address for the host names this rank will dial, or ``"error: ..."``.
        step_nodes, job_nodes: nodes of the step and of the job around it (Slurm).
        job_tasks_per_node: tasks per node the job asked for, or None.
        errors: problems found while probing (an invalid ``TFDIST_*`` value, ...).
    """

    rank: int
    host: str
    local_rank: int = 0
    local_world_size: int = 1
    address: str = ""
    cpus: str = ""
    gpus: str = ""
    slurm_gpus: str = ""
    node_gpus: int = 0
    gpus_per_task: int | None = None
    replicas: int = 1
    gpu_share: int = 0
    backend: str = ""
    collective: str = ""
    why: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    interfaces: tuple[str, ...] = ()
    network: Mapping[str, str] = field(default_factory=dict)
    resolved: Mapping[str, str] = field(default_factory=dict)
    step_nodes: int = 1
    job_nodes: int | None = None
    job_tasks_per_node: int | None = None
    errors: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankReport:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        for key in ("interfaces", "errors"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


def check(reports: Sequence[RankReport]) -> list[Problem]:
    """Every problem in the reports of all ranks: each rank's own, then across ranks."""
    problems = [problem for report in reports for problem in _own(report)]
    problems += version_problems(reports)
    problems += untested_tensorflow(reports)
    problems += _plan_problems(reports)
    problems += _shared_gpus(reports)
    return problems


def model_dir_problems(reports: Sequence[RankReport], visible: Mapping[int, bool],
                       model_dir: str) -> list[Problem]:
    """The ranks whose mark in ``model_dir`` rank 0 could not read (``visible``: rank -> whether
    rank 0 read that rank's mark): their ``model_dir`` is not rank 0's folder (pure)."""
    return [Problem(report.rank, report.host,
                    f"model_dir {model_dir} is not the folder rank 0 sees: rank 0 cannot read "
                    "the file this rank wrote there",
                    "put model_dir on a file system every node mounts (not node-local scratch "
                    "such as $TMPDIR), at the same path on every rank")
            for report in reports if not visible.get(report.rank, True)]


def interface_problem(variable: str, value: str, interfaces: Iterable[str]) -> str | None:
    """Why ``variable=value`` selects no interface of ``interfaces``, or None if it selects one.

    NCCL reads ``NCCL_SOCKET_IFNAME`` as comma-separated prefixes (``ib`` matches ``ib0``),
    ``=`` before the list for exact names, ``^`` to exclude; Gloo's variable is a list of
    names; Horovod's one name.
    """
    names = sorted(set(interfaces))
    kind = INTERFACE_VARIABLES.get(variable, "exact")
    text = value.strip()
    if not text:
        return None
    if kind == "nccl":
        exclude = text.startswith("^")
        text = text.lstrip("^")
        exact = text.startswith("=")
        wanted = [w.strip() for w in text.lstrip("=").split(",") if w.strip()]

        def hit(name: str) -> bool:
            return any(name == w if exact else name.startswith(w) for w in wanted)

        chosen = [n for n in names if hit(n) != exclude]
    elif kind == "list":
        chosen = [n for n in names if n in {w.strip() for w in text.split(",")}]
    else:
        chosen = [n for n in names if n == text]
    if chosen:
        return None
    return f"{variable}={value} selects no network interface here (it has {', '.join(names)})"


def version_problems(reports: Sequence[RankReport]) -> list[Problem]:
    """Ranks whose package versions differ from the most common ones."""
    problems = []
    for package in PACKAGES:
        seen = Counter(r.versions.get(package, "-") for r in reports)
        if len(seen) < 2:
            continue
        usual, _ = seen.most_common(1)[0]
        for report in reports:
            mine = report.versions.get(package, "-")
            if mine != usual:
                problems.append(Problem(
                    report.rank, report.host,
                    f"runs {package} {_shown(mine)} where {seen[usual]} of {len(reports)} "
                    f"ranks run {_shown(usual)}",
                    "start every rank with the same environment (the same venv, module or "
                    "image on every node); `python -m pip list` there shows what differs"))
    return problems


def untested_tensorflow(reports: Sequence[RankReport]) -> list[Problem]:
    """A warning for the launch when the TensorFlow the ranks mostly run lies outside
    :data:`TESTED_TENSORFLOW` (not for the torch backends, which do not use it)."""
    if not reports or all(r.backend not in facts.names(facts.TF) for r in reports):
        return []
    version = Counter(r.versions.get("tensorflow", "") for r in reports).most_common(1)[0][0]
    try:
        found = tuple(int("".join(c for c in part if c.isdigit())) for part in
                      version.split(".")[:2])
    except ValueError:
        return []
    oldest, newest = TESTED_TENSORFLOW
    if len(found) != 2 or oldest <= found <= newest:
        return []
    side = "older than the oldest" if found < oldest else "newer than the newest"
    tested = f"{'.'.join(map(str, oldest))} to {'.'.join(map(str, newest))}"
    return [Problem(None, "", f"TensorFlow {version} is {side} release tfdist is tested on "
                    f"({tested}); the README's Supported versions says what was checked on "
                    "others",
                    f"if something fails, load a TensorFlow module of {tested}, or install one "
                    "into a venv", severity="warning")]


def ranges(cores: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    ordered = sorted(set(cores))
    parts, start = [], None
    for i, core in enumerate(ordered):
        if start is None:
            start = core
        if i + 1 == len(ordered) or ordered[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def table(reports: Sequence[RankReport]) -> str:
    """The plan, one row per rank, then the versions every rank shares."""
    heads = ("rank", "host", "local", "cpus", "gpus", "replicas", "address", "backend")
    rows = [(str(r.rank), r.host, f"{r.local_rank}/{r.local_world_size}", r.cpus or "-",
             _gpus(r), str(r.replicas), r.address or "-", f"{r.backend} {r.collective}".strip())
            for r in sorted(reports, key=lambda r: r.rank)]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
             for row in (heads, *rows)]
    if reports:
        first = reports[0]
        versions = ", ".join(f"{package} {first.versions[package]}" for package in PACKAGES
                             if package in first.versions)
        lines += [f"versions: {versions}", f"backend: {first.backend}: {first.why}",
                  f"replicas: {sum(r.replicas for r in reports)} in all (the global batch is "
                  "the per-replica batch times this)"]
    return "\n".join(lines)


def _gpus(report: RankReport) -> str:
    if report.gpus == "?":
        return f"{report.node_gpus} on node" if report.node_gpus else "none (CPU)"
    if not report.gpus:
        return "none (CPU)"
    physical = f" (slurm {report.slurm_gpus})" if report.slurm_gpus else ""
    return report.gpus + physical


def _shown(version: str) -> str:
    return "(not installed)" if version == "-" else version


def _own(report: RankReport) -> list[Problem]:
    problems = [Problem(report.rank, report.host, error) for error in report.errors]
    for variable, value in report.network.items():
        if variable not in INTERFACE_VARIABLES:
            continue
        why = interface_problem(variable, value, report.interfaces)
        if why:
            problems.append(Problem(report.rank, report.host, why,
                                    f"set {variable} to an interface every node has "
                                    "(`ip -br addr` lists them), or unset it"))
    for name, address in report.resolved.items():
        if address.startswith("error"):
            template = report.network.get("TFDIST_HOST_TEMPLATE", "{host}")
            problems.append(Problem(
                report.rank, report.host,
                f"cannot resolve {name} ({address.removeprefix('error: ')}), the name "
                f"TFDIST_HOST_TEMPLATE={template} gives",
                "set TFDIST_HOST_TEMPLATE to names of the nodes' interfaces that resolve "
                "(`getent hosts NAME`), or unset it"))
    problems += _shape(report)
    return problems


def _shape(r: RankReport) -> list[Problem]:
    problems = []
    if r.gpus == "" and r.slurm_gpus:  # Slurm gave the step GPUs; something hid them all
        problems.append(Problem(
            r.rank, r.host, f"CUDA_VISIBLE_DEVICES is empty, though Slurm gave this step "
            f"GPU(s) {r.slurm_gpus}: this rank trains on the CPU",
            "unset CUDA_VISIBLE_DEVICES (or remove the line of the job script or module that "
            "empties it); to train on the CPU on purpose, ask Slurm for no GPUs", "warning"))
    # gpus "" (CUDA_VISIBLE_DEVICES="", "-1"...): a CPU run, which shares none of the node's GPUs.
    if (r.gpus and r.node_gpus and r.local_world_size > r.node_gpus
            and r.gpus_per_task is None):
        problems.append(Problem(
            r.rank, r.host, f"{r.local_world_size} tasks share the node's "
            + ("only GPU" if r.node_gpus == 1 else f"{r.node_gpus} GPUs"),
            f"start one task per GPU: `srun --ntasks-per-node={r.node_gpus}`"))
    if r.gpus_per_task is not None and r.local_world_size > 1 and r.collective == "nccl":
        problems.append(Problem(
            r.rank, r.host, "--gpus-per-task gives each task only its own GPU, so NCCL cannot "
            "use NVLink or PCIe peer-to-peer between the tasks of a node",
            "request the GPUs per node (`--gpus-per-node`) with one task per GPU; tfdist gives "
            "each task its own", "warning"))
    if r.gpu_share > r.replicas == 1 and (row := _facts(r.backend)):  # one GPU per process
        engine = row.engine if row.crosses_processes else f"{row.engine} (backend {row.name})"
        idle = one_gpu_per_process(engine, r.gpu_share, row.several_gpus_instead)
        if idle:
            what, _, fix = idle.partition(" Fix: ")
            problems.append(Problem(r.rank, r.host, what, fix, "warning"))
    if r.job_nodes is not None and r.step_nodes < r.job_nodes and r.rank == 0:
        problems.append(Problem(
            r.rank, r.host, f"this step runs on {r.step_nodes} of the job's {r.job_nodes} "
            "nodes: the others stay idle",
            "start training with plain `srun` in the job script, which uses every node",
            "warning"))
    if (r.job_tasks_per_node is not None and r.local_world_size < r.job_tasks_per_node
            and r.local_rank == 0):
        problems.append(Problem(
            r.rank, r.host, f"{r.local_world_size} task(s) on this node, where the job asked "
            f"for {r.job_tasks_per_node} per node (--ntasks-per-node)",
            "start training with plain `srun` (it inherits the job's layout), not "
            "`srun -n 1`", "warning"))
    return problems


def _plan_problems(reports: Sequence[RankReport]) -> list[Problem]:
    problems = []
    for attribute in ("backend", "collective"):
        seen = Counter(getattr(r, attribute) for r in reports)
        if len(seen) > 1:
            usual, _ = seen.most_common(1)[0]
            problems += [Problem(r.rank, r.host,
                                 f"will use {attribute} {getattr(r, attribute)!r} where the "
                                 f"others use {usual!r}",
                                 f"set the same TFDIST_{attribute.upper()} on every rank")
                         for r in reports if getattr(r, attribute) != usual]
    return problems


def _shared_gpus(reports: Sequence[RankReport]) -> list[Problem]:
    owners: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in reports:
        if r.gpus and r.gpus != "?" and r.gpus_per_task is None:
            for gpu in r.gpus.split(","):
                owners[(r.host, gpu)].append(r.rank)
    return [Problem(ranks[1], host, f"GPU {gpu} is driven by ranks {', '.join(map(str, ranks))}",
                    "give each task its own GPU: one task per GPU, or `--gpus-per-task=1`")
            for (host, gpu), ranks in sorted(owners.items()) if len(ranks) > 1]


def _facts(name: str) -> Backend | None:
    """The facts of the backend a rank reported: TensorFlow's of that name, else torch's (the
    Horovod rows agree on what the report reads); None for a name that is no backend's (the
    rank reported that error)."""
    return next((row for row in facts.BACKENDS if row.name == name), None)
