"""Every check of a :class:`~tfdist.jobs.config.JobConfig`, run when one is built; they read its
fields (:class:`~tfdist.jobs.fields.JobFields`).

Each error names the key, the value and what is allowed, so the fix is in the message.
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING

from tfdist.backend_facts import job_backend
from tfdist.errors import ConfigError
from tfdist.jobs.choices import (
    BACKEND_LAUNCHERS,
    BACKENDS,
    KINDS,
    LAUNCHERS,
    RUNTIME_LAUNCHERS,
    RUNTIMES,
    TORCH_BACKENDS,
)
from tfdist.jobs.fields import JobFields
from tfdist.jobs.options import (
    SBATCH_FLAGS,
    SBATCH_SHORT,
    SBATCH_VALUES,
    option_name,
    takes_value,
)
from tfdist.jobs.shell import check_body_value, check_sbatch_value

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["validate", "TIME_FORMATS"]

TIME_FORMATS = ("MINUTES", "MINUTES:SECONDS", "HOURS:MINUTES:SECONDS", "DAYS-HOURS",
                "DAYS-HOURS:MINUTES", "DAYS-HOURS:MINUTES:SECONDS", "UNLIMITED")
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Keys that belong to some kinds of job only; the others apply to every kind.
_TRAIN_KEYS = ("backend", "launcher", "launcher_args", "script", "args", "runtime", "image",
               "binds", "gpus_per_task", "tasks_per_node", "task_output", "doctor",
               "min_nodes", "node_restarts", "spare_nodes")
_KEY_KINDS: dict[str, tuple[str, ...]] = {
    **{key: ("train", "scaling") for key in _TRAIN_KEYS},
    "packages": ("build-venv",), "system_site_packages": ("build-venv",),
    "scaling_nodes": ("scaling",),
}
# sbatch options that have their own key: setting them twice would leave the winner to the order.
_OWN_KEYS = {
    "--job-name": "job_name", "-J": "job_name", "--nodes": "nodes", "-N": "nodes",
    "--ntasks-per-node": "tasks_per_node", "--ntasks": "tasks_per_node", "-n": "tasks_per_node",
    "--gpus-per-node": "gpus_per_node", "--gpus": "gpus_per_node", "-G": "gpus_per_node",
    "--gpus-per-task": "gpus_per_task", "--cpus-per-task": "cpus_per_task",
    "-c": "cpus_per_task", "--partition": "partition", "-p": "partition", "--account": "account",
    "-A": "account", "--time": "time", "-t": "time", "--constraint": "constraint",
    "-C": "constraint", "--output": "output", "-o": "output", "--mem": "mem",
    "--array": "array", "-a": "array", "--signal": "signal", "--requeue": "requeue",
    "--no-kill": "min_nodes", "-k": "min_nodes",
}
_SIGNAL = re.compile(r"(?:R:)?(?:SIG)?([A-Z0-9]+)(?:@(\d+))?")
_MEM = re.compile(r"(\d+)([KMGT]?)", re.IGNORECASE)


def validate(config: JobFields) -> None:
    """Check every value and combination of ``config``.

    Raises:
        ConfigError: the first problem found, with what is allowed.
    """
    _check_choices(config)
    _check_counts(config)
    _check_kind_keys(config)
    if config.kind == "build-venv":
        _check_build(config)
    else:
        _check_train(config)
    if config.kind == "scaling":
        _check_scaling(config)
    _check_sbatch_values(config)
    _check_software(config)
    _check_env(config)
    _check_body_values(config)


def _choice(key: str, value: str | None, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value is not None and value not in allowed:
        raise ConfigError(f"{key} {value!r} is not one of: {', '.join(allowed)}")


def _check_choices(c: JobFields) -> None:
    _choice("kind", c.kind, KINDS)
    _choice("backend", c.backend, BACKENDS)
    _choice("launcher", c.launcher, LAUNCHERS)
    _choice("runtime", c.runtime, RUNTIMES)


def _check_counts(c: JobFields) -> None:
    for key, value, least in (("nodes", c.nodes, 1), ("gpus_per_node", c.gpus_per_node, 0),
                              ("tasks_per_node", c.tasks_per_node, 1),
                              ("cpus_per_task", c.cpus_per_task, 1),
                              ("cores_per_node", c.cores_per_node, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{key} must be at least {least}, got {value}")


def _check_kind_keys(c: JobFields) -> None:
    defaults = type(c).__dataclass_fields__
    foreign = [key for key, kinds in _KEY_KINDS.items() if c.kind not in kinds]
    for key in foreign:
        if getattr(c, key) != defaults[key].default:
            kinds = _KEY_KINDS[key]
            which = f"kind {kinds[0]}" if len(kinds) == 1 else f"kinds {' and '.join(kinds)}"
            raise ConfigError(f"{key} applies to {which} only, not to kind {c.kind}; remove it "
                              f"(keys that kind {c.kind} does not take: {', '.join(foreign)})")


def _check_train(c: JobFields) -> None:
    launcher = c.effective_launcher
    if not c.script:
        raise ConfigError(f"kind {c.kind} needs the training script: give SCRIPT [ARGS ...] "
                          "after the flags of `tfdist job`, or set script: (and args:) in the "
                          "config")
    allowed = BACKEND_LAUNCHERS[c.backend]
    if launcher not in allowed:
        raise ConfigError(f"launcher {launcher} cannot start backend {c.backend}; allowed with "
                          f"backend {c.backend}: {', '.join(allowed)}")
    allowed = RUNTIME_LAUNCHERS[c.runtime]
    if launcher not in allowed:
        raise ConfigError(f"launcher {launcher} cannot run in runtime {c.runtime}; allowed with "
                          f"runtime {c.runtime}: {', '.join(allowed)}")
    if c.task_output is not None and launcher not in ("srun", "torchrun"):
        raise ConfigError(f"task_output is srun's per-task --output, and launcher {launcher} "
                          "starts its ranks without srun; use launcher srun or torchrun, or "
                          "remove task_output (all ranks then write to output)")
    if launcher == "torchrun":
        _check_torchrun(c)
    else:
        _check_tasks(c)
    _check_min_nodes(c)


def _check_min_nodes(c: JobFields) -> None:
    if c.node_restarts < 0:
        raise ConfigError(f"node_restarts must be at least 0, got {c.node_restarts}")
    if c.spare_nodes < 0:
        raise ConfigError(f"spare_nodes must be at least 0, got {c.spare_nodes}")
    if not c.survives:
        if c.node_restarts != JobFields.node_restarts:  # an option that needs another
            raise ConfigError(f"node_restarts {c.node_restarts} counts the restarts on the "
                              "nodes left after one is lost, which min_nodes turns on: add "
                              "min_nodes (--min-nodes M, at most nodes), or leave node_restarts "
                              "out")
        return
    if c.min_nodes is not None and not 1 <= c.min_nodes <= c.nodes:
        raise ConfigError(f"min_nodes {c.min_nodes} must be between 1 and nodes {c.nodes}: the "
                          "training goes on on the nodes left after one dies while at least "
                          "min_nodes are")
    key = "min_nodes" if c.min_nodes is not None else "spare_nodes"
    if c.effective_launcher != "srun" or c.runtime != "venv" or c.kind != "train":
        raise ConfigError(f"{key} restarts the training's srun step on the nodes left, "
                          f"with tfdist from the job's venv: it needs kind train, launcher "
                          f"srun and runtime venv (here kind {c.kind}, launcher "
                          f"{c.effective_launcher}, runtime {c.runtime}); remove {key}")


def _check_torchrun(c: JobFields) -> None:
    if c.tasks_per_node not in (None, 1):
        raise ConfigError(f"tasks_per_node {c.tasks_per_node} with launcher torchrun: srun "
                          "starts one torchrun per node, which starts one process per GPU; "
                          "allowed: tasks_per_node 1 (or unset), with gpus_per_node the "
                          "processes per node")
    if c.gpus_per_task:
        raise ConfigError("gpus_per_task with launcher torchrun: the one task per node must see "
                          "all of its node's GPUs; remove gpus_per_task (gpus_per_node applies)")
    if c.gpus_per_node < 1:
        raise ConfigError("launcher torchrun starts gpus_per_node processes per node, so "
                          "gpus_per_node must be at least 1; for a CPU-only run use launcher "
                          "srun with tasks_per_node")


def _check_tasks(c: JobFields) -> None:
    tasks, gpus = c.effective_tasks_per_node, c.gpus_per_node
    if c.gpus_per_task:
        if gpus < 1:
            raise ConfigError("gpus_per_task gives each task one GPU: set gpus_per_node to the "
                              "GPUs (= tasks) per node, at least 1")
        if tasks != gpus:
            raise ConfigError(f"tasks_per_node {tasks} with gpus_per_node {gpus} and "
                              f"gpus_per_task: each task gets one GPU, so tasks_per_node must "
                              f"be {gpus} (allowed: {gpus}, or unset); or remove gpus_per_task")
    elif gpus and gpus % tasks:
        divisors = [str(n) for n in range(1, gpus + 1) if gpus % n == 0]
        raise ConfigError(f"tasks_per_node {tasks} with gpus_per_node {gpus}: each task drives "
                          f"gpus_per_node / tasks_per_node GPUs, so tasks_per_node must divide "
                          f"{gpus}; allowed: {', '.join(divisors)}")
    elif gpus > tasks and not (facts := job_backend(c.backend)).several_devices:
        engine = facts.engine
        raise ConfigError(f"tasks_per_node {tasks} with gpus_per_node {gpus} and backend "
                          f"{c.backend}: {engine} drives one GPU per process, so "
                          f"{gpus - tasks} GPU(s) per node would stay idle; set tasks_per_node "
                          f"to {gpus} (or leave it out), or use backend mwms, which drives "
                          "several GPUs per task")


def _check_scaling(c: JobFields) -> None:
    if c.backend in TORCH_BACKENDS:
        raise ConfigError("kind scaling reads the throughput that tfdist's Keras callbacks "
                          f"(dist.callbacks()) write per epoch, which backend {c.backend} does "
                          "not have; use backend mwms or horovod")
    if c.effective_launcher != "srun":
        raise ConfigError(f"kind scaling runs one srun step per size (srun --nodes=K), so it "
                          f"needs launcher srun, not {c.effective_launcher}; remove launcher or "
                          "set it to srun")
    if len(c.effective_scaling_nodes) < 2:
        raise ConfigError(f"kind scaling with nodes {c.nodes} and scaling_nodes "
                          f"{list(c.effective_scaling_nodes)} measures one size only: set nodes "
                          "to the most nodes to measure (e.g. --nodes 4 measures 1, 2 and 4), "
                          "or give two sizes or more in scaling_nodes")
    too_many = [n for n in c.effective_scaling_nodes if n > c.nodes]
    if too_many:
        raise ConfigError(f"scaling_nodes {too_many[0]} is more than the job's nodes {c.nodes}; "
                          f"allowed: 1 to {c.nodes} (or raise nodes to {max(too_many)})")
    if c.task_output is not None and "%s" not in c.task_output:
        raise ConfigError(f"task_output {c.task_output!r} with kind scaling: each size runs as "
                          "an srun step of its own, and the steps would overwrite each other's "
                          "files; add %s (the step), e.g. %x-%j-%s-%t.out, or remove "
                          "task_output")
    if c.requeue:
        raise ConfigError("requeue with kind scaling: a requeued job would measure every size "
                          "again from the first; remove requeue (submit the job again instead)")


def _check_build(c: JobFields) -> None:
    if c.nodes != 1:
        raise ConfigError(f"kind build-venv runs on one node (nodes 1), got nodes {c.nodes}")
    if not c.venv:
        raise ConfigError("kind build-venv needs venv: the path of the venv to create, on a "
                          "file system the compute nodes share (e.g. venv: /project/me/venvs/tf)")
    if not c.packages:
        raise ConfigError("kind build-venv needs packages: what pip installs, e.g. packages: "
                          "['tfdist[gpu,examples]', 'tensorflow[and-cuda]==2.21.0'] or a "
                          "checkout of tfdist ('/path/to/tfdist[gpu]')")


def _check_sbatch_values(c: JobFields) -> None:
    for key in ("job_name", "gpu_type", "partition", "account", "time", "constraint", "output",
                "mem", "array", "signal"):
        value = getattr(c, key)
        if value is not None:
            check_sbatch_value(key, value)
    _check_signal(c.signal)
    if c.gpu_type is not None and c.gpus_per_node < 1:
        raise ConfigError(f"gpu_type {c.gpu_type!r} needs gpus_per_node of at least 1")
    if c.time is not None and not _TIME.fullmatch(c.time):
        raise ConfigError(f"time {c.time!r} is not a Slurm time limit; use one of "
                          f"{', '.join(TIME_FORMATS)} (e.g. 90, 01:30:00 or 2-00:00:00), or a "
                          "duration such as 90min or 2h")
    for index, option in enumerate(c.sbatch_args):
        check_sbatch_value(f"sbatch_args[{index}]", option)
        name = option_name(option)
        if not option.startswith("-"):
            raise ConfigError(f"sbatch_args[{index}] {option!r} is not an sbatch option; write "
                              "options as --name=value, e.g. --qos=high or --exclusive")
        if name in _OWN_KEYS:
            raise ConfigError(f"sbatch_args[{index}] {option!r} sets what key "
                              f"{_OWN_KEYS[name]} sets; use {_OWN_KEYS[name]} instead")
        if option == name and takes_value(name):
            raise ConfigError(f"sbatch_args[{index}] {option!r} needs a value, and sbatch would "
                              f"refuse the job; write {SBATCH_SHORT.get(name, name)}=VALUE, "
                              f"e.g. --sbatch-arg={SBATCH_SHORT.get(name, name)}=VALUE")
        if takes_value(name) is None:
            near = difflib.get_close_matches(name, sorted(SBATCH_VALUES | SBATCH_FLAGS), n=1)
            raise ConfigError(f"sbatch_args[{index}] {option!r}: sbatch has no option {name}"
                              + (f"; did you mean {near[0]}?" if near else
                                 " (`sbatch --help` lists them)")
                              + " If it is an option of a newer sbatch than tfdist knows, add "
                              "its #SBATCH line by hand to the script --save writes")
    _check_mem(c.mem)


def _check_mem(mem: str | None) -> None:
    """sbatch's --mem: a whole number with a unit; without one Slurm reads megabytes."""
    if mem is None:
        return
    match = _MEM.fullmatch(mem.strip())
    if match is None:
        raise ConfigError(f"mem {mem!r} is not a memory size: write a whole number and a unit, "
                          "K, M, G or T (e.g. 64G), or 0 for all of a node's memory")
    if not match.group(2) and match.group(1) != "0":
        raise ConfigError(f"mem {mem!r} has no unit, and Slurm would read {mem} megabytes: "
                          f"write {mem}G for gigabytes (or {mem}M if megabytes are meant)")


def _check_signal(signal: str | None) -> None:
    if signal is None:
        return
    if signal.upper().startswith("B:"):
        raise ConfigError(f"signal {signal!r} goes to the batch shell only (B:), and the Python "
                          "processes under srun would never see it; drop the B: so that Slurm "
                          "signals the tasks, e.g. signal: USR1@120")
    match = _SIGNAL.fullmatch(signal.upper())
    if not match or match.group(1) not in ("USR1", "USR2", "TERM", "10", "12", "15"):
        raise ConfigError(f"signal {signal!r} is not SIGNAL@SECONDS with a signal tfdist saves "
                          "the state on: USR1 or TERM (USR2 with TFDIST_PREEMPT_SIGNAL=USR2), "
                          "e.g. USR1@120 (sbatch --signal)")


def _check_software(c: JobFields) -> None:
    if c.venv is not None and c.python is not None and c.kind != "build-venv":
        raise ConfigError("venv and python both say which Python runs the script; set one: "
                          "venv (activated) or python (an interpreter path)")
    if c.runtime == "venv":
        if c.image is not None:
            raise ConfigError("image needs runtime apptainer or enroot; with runtime venv Python "
                              "comes from venv, python or the modules")
        if c.binds:
            raise ConfigError("binds mount paths into a container: they need runtime apptainer "
                              "or enroot, not venv")
        return
    if not c.image:
        raise ConfigError(f"runtime {c.runtime} needs image: the container image to run "
                          "(a .sif file for apptainer, a .sqsh file or image name for enroot)")
    if c.venv is not None:
        raise ConfigError(f"venv with runtime {c.runtime}: the Python comes from the image; set "
                          "python to an interpreter inside it instead (default: python)")
    least = 1 if c.runtime == "apptainer" else 2
    for index, bind in enumerate(c.binds):
        parts = bind.split(":")
        if "," in bind or not least <= len(parts) <= 3 or not all(parts[:2]):
            form = "SRC[:DST[:OPTIONS]]" if c.runtime == "apptainer" else "SRC:DST[:OPTIONS]"
            raise ConfigError(f"binds[{index}] {bind!r} is not {form} ({c.runtime} splits "
                              "binds at ',' and ':', so paths cannot contain them)")


def _check_env(c: JobFields) -> None:
    for name in c.env:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"env: {name!r} is not a variable name; use letters, digits and "
                              "'_', not starting with a digit")
        if name == "TFDIST_BACKEND":
            raise ConfigError("env: TFDIST_BACKEND is set from backend; set backend instead")


def _check_body_values(c: JobFields) -> None:
    singles = ("task_output", "venv", "python", "image", "cpu_bind", "script")
    lists = ("modules", "binds", "launcher_args", "args", "packages")
    for key in singles:
        if getattr(c, key) is not None:
            check_body_value(key, getattr(c, key))
    for key in lists:
        for index, value in enumerate(getattr(c, key)):
            check_body_value(f"{key}[{index}]", value)
            if key in ("modules", "binds", "packages") and not value.strip():
                raise ConfigError(f"{key}[{index}] is empty: it would render as `''` in the job "
                                  f"script (e.g. `module load ''`); remove it")
    for name, value in c.env.items():
        check_body_value(f"env.{name}", value)
