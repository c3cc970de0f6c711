"""Render a :class:`~tfdist.jobs.config.JobConfig` as an sbatch script: a pure function.

The script reads like one written by hand: ``#SBATCH`` lines, the software, the environment
(with the RoCE/InfiniBand settings as comments), then one launch line. Values in the body are
shell words (:func:`tfdist.jobs.shell.word`); values on ``#SBATCH`` lines were checked when the
config was built. The same function writes ``jobscripts/*.sbatch`` from ``jobscripts/configs``.
"""

from __future__ import annotations

import posixpath

from tfdist.backend_facts import JAX, Backend, job_backend
from tfdist.env.slurm import PORT_BLOCK, PORT_RANGE
from tfdist.jobs.config import JobConfig
from tfdist.jobs.options import option_name
from tfdist.jobs.shell import word, words
from tfdist.settings import resolve

__all__ = ["render", "rendezvous_port_expression"]

_TITLES = {
    ("mwms", "srun"): "MultiWorkerMirroredStrategy: one srun task per {unit}",
    ("jax", "srun"): "Keras 3 on JAX (DataParallel): one srun task per {unit}",
    ("horovod", "srun"): "Horovod: one srun task per {unit}, MPI started through PMIx",
    ("horovod", "mpirun"): "Horovod: one rank per {unit}, started by Open MPI's mpirun",
    ("horovod", "horovodrun"): "Horovod: one rank per {unit}, started by horovodrun",
    ("torch", "torchrun"): "PyTorch DDP: srun starts one torchrun per node, one process per GPU",
    ("torch", "srun"): "PyTorch DDP (tfdist.torch): one srun task per {unit}",
    ("torch-horovod", "srun"): "PyTorch with Horovod: one srun task per {unit}, MPI started "
                               "through PMIx",
    ("torch-horovod", "mpirun"): "PyTorch with Horovod: one rank per {unit}, started by Open "
                                 "MPI's mpirun",
    ("torch-horovod", "horovodrun"): "PyTorch with Horovod: one rank per {unit}, started by "
                                     "horovodrun",
    ("torch-deepspeed", "torchrun"): "PyTorch with DeepSpeed: srun starts one torchrun per node, "
                                     "one process per GPU",
    ("torch-deepspeed", "srun"): "PyTorch with DeepSpeed (tfdist.torch): one srun task per "
                                 "{unit}",
}
_RUNTIME_TITLES = {"venv": "", "apptainer": ", in Apptainer", "enroot": ", in enroot (pyxis)"}
_NCCL_HINTS = (
    "# RoCE / InfiniBand: uncomment what your site documents for its network.",
    '# export NCCL_DEBUG=INFO             # log the transport: want "NET/IB", not "NET/Socket"',
    "# export NCCL_SOCKET_IFNAME=ib0      # interface for NCCL's bootstrap and socket fallback",
    "# export NCCL_IB_HCA=mlx5_0,mlx5_1   # the HCAs to use (ibv_devices lists them)",
    "# export NCCL_IB_GID_INDEX=3         # RoCE v2: GID index of the RoCE v2 address (show_gids)",
    "# export NCCL_IB_TC=106              # RoCE: traffic class of the lossless queue",
    "# export NCCL_NET_GDR_LEVEL=PHB      # GPUDirect RDMA up to this PCIe distance",
)
_TF_HOST_HINT = ("# export TFDIST_HOST_TEMPLATE='{host}-ib0'  # TensorFlow's gRPC: dial nodes by "
                 "their IPoIB names")
_VENV_CHECK = '''python - <<'EOF'
import importlib.util

for name in ("tfdist", "tensorflow", "torch"):
    if importlib.util.find_spec(name) is None:
        print(name, "is not installed")
    elif name == "tensorflow":
        import tensorflow as tf
        print("tensorflow", tf.__version__, "GPUs:", len(tf.config.list_physical_devices("GPU")))
    elif name == "torch":
        import torch
        print("torch", torch.__version__, "GPUs:", torch.cuda.device_count())
    else:
        print(name, importlib.import_module(name).__version__)
EOF'''


def render(config: JobConfig, *, source: str | None = None) -> str:
    """Return the sbatch script of ``config``.

    Args:
        config: The job.
        source: The config file it came from, named in the header (``jobscripts/configs/...``).

    Returns:
        The script text, ending in a newline.
    """
    blocks: list[str | None] = [_header(config, source), _directives(config),
                                "set -eo pipefail", _modules(config)]
    if config.kind == "train":
        blocks += [_venv(config), _environment(config), _network(config), _doctor(config),
                   _launch(config)]
    elif config.kind == "scaling":
        blocks += [_venv(config), _environment(config), _network(config), _doctor(config),
                   _scaling(config)]
    else:
        blocks += [_environment(config), _build(config)]
    return "\n\n".join(block for block in blocks if block) + "\n"


def rendezvous_port_expression() -> str:
    """The bash arithmetic of torchrun's rendezvous port: the first port of the block that
    :func:`tfdist.env.slurm.port_base` derives for the job's step 0."""
    low, high = PORT_RANGE
    return f"$(({low} + (SLURM_JOB_ID % {(high - low) // PORT_BLOCK}) * {PORT_BLOCK}))"


def _header(c: JobConfig, source: str | None) -> str:
    if c.kind == "build-venv":
        title = "Build a Python venv on the node type that will train"
    else:
        title = _TITLES[(c.backend, c.effective_launcher)].format(unit=_unit(c))
        if _facts(c).horovod and c.effective_launcher == "srun" and not _horovod_mpi(c):
            title = title.replace("MPI started through PMIx", "Gloo rendezvous started by tfdist")
        title += _RUNTIME_TITLES[c.runtime]
    lines = ["#!/bin/bash", f"# {title}."]
    if c.kind == "scaling":
        lines[1:1] = [f"# Scaling efficiency: the training on {_listing(c.effective_scaling_nodes)}"
                      " node(s), one srun step each, then the report."]
    if source is not None:
        printable = "".join(ch if " " <= ch <= "~" else "?" for ch in source)
        lines += [f"# Rendered by `tfdist job {printable}`.",
                  "# Edit this copy, or edit the config and render again."]
    else:
        lines.append("# Rendered by `tfdist job` (`tfdist job --help` lists its keys).")
    return "\n".join(lines)


def _unit(c: JobConfig) -> str:
    """What one task drives: ``GPU``, ``2 GPUs`` or, without GPUs, ``worker``."""
    if c.gpus_per_node < 1:
        return "worker"
    per_task = 1 if c.gpus_per_task else c.gpus_per_node // c.effective_tasks_per_node
    return "GPU" if per_task == 1 else f"{per_task} GPUs"


def _directives(c: JobConfig) -> str:
    lines = [f"#SBATCH --job-name={c.job_name}"]
    if c.spare_nodes:
        lines.append(f"# {c.nodes} nodes train; {c.spare_nodes} more wait idle, each to take a "
                     "lost node's place (tfdist survive).")
    lines += [f"#SBATCH --nodes={c.nodes + c.spare_nodes}", *_task_comment(c),
              _tasks_directive(c)]
    gpus = _gpu_directive(c)
    if gpus:
        lines.append(gpus)
    optional = (("cpus-per-task", c.effective_cpus_per_task), ("partition", c.partition),
                ("account", c.account), ("time", c.time), ("constraint", c.constraint),
                ("mem", c.mem), ("array", c.array))
    lines += [f"#SBATCH --{name}={value}" for name, value in optional if value is not None]
    if c.signal is not None:
        lines += [f"# {_signal_lead(c.signal)} s before the time limit Slurm signals the tasks "
                  "(not only this shell): tfdist",
                  "# saves the state at one step on every rank and exits 75.",
                  f"#SBATCH --signal={c.signal}"]
    if c.requeue:
        lines += ["# A preempted job may go back into the queue and resume where it stopped.",
                  "#SBATCH --requeue"]
    if c.survives:
        lines += ["# A node that dies ends the step, not the job: the training goes on on the "
                  "others (below).", "#SBATCH --no-kill"]
    if (c.requeue or c.survives) and not any(
            option_name(option) == "--open-mode" for option in c.sbatch_args):
        run = "requeued run" if c.requeue else "step started again"
        lines += [f"# Each run appends to the output files, so the {run} keeps the "
                  "first one's.", "#SBATCH --open-mode=append"]
    if c.task_output is not None:
        lines.append("# The batch shell writes to --output; each task to its own file "
                     "(srun --output below).")
    lines.append(f"#SBATCH --output={c.output}")
    lines += [f"#SBATCH {option}" for option in c.sbatch_args]
    return "\n".join(lines)


def _task_comment(c: JobConfig) -> list[str]:
    tasks, gpus = c.effective_tasks_per_node, c.gpus_per_node
    if c.kind == "build-venv":
        return ["# One task on one node of the type that will train: the venv is built against "
                "its CPU,", "# driver and modules."]
    if c.effective_launcher == "torchrun":
        return ["# One task per node: it runs torchrun, which starts one process per GPU."]
    if c.gpus_per_task:
        return ["# One task per GPU, and Slurm binds each task to its own GPU (--gpus-per-task). "
                "Where the site", "# confines devices with cgroups, a task cannot see the "
                "others' GPUs and NCCL can lose", "# NVLink/PCIe peer-to-peer between them: "
                "prefer --gpus-per-node, where tfdist assigns", "# each task its GPU."]
    if gpus == 0:
        return [f"# CPU only: {tasks} task(s) per node, each one worker."]
    if tasks == gpus:
        return ["# One task per GPU: tfdist gives each task its own GPU of the node's "
                "CUDA_VISIBLE_DEVICES."]
    return [f"# {tasks} task(s) per node, each driving {gpus // tasks} GPUs of the node's "
            "CUDA_VISIBLE_DEVICES."]


def _tasks_directive(c: JobConfig) -> str:
    if c.kind == "build-venv":
        return "#SBATCH --ntasks=1"
    return f"#SBATCH --ntasks-per-node={c.effective_tasks_per_node}"


def _gpu_directive(c: JobConfig) -> str | None:
    if c.gpus_per_node < 1:
        return None
    prefix = f"{c.gpu_type}:" if c.gpu_type else ""
    if c.kind == "build-venv":
        return f"#SBATCH --gpus={prefix}{c.gpus_per_node}"
    if c.gpus_per_task:
        # Slurm 22.05 binds no GPU to the tasks for a typed --gpus-per-task alone.
        return "\n".join([f"#SBATCH --gpus-per-task={prefix}1",
                          "# Each task sees only its own GPU (needed with a GPU type).",
                          "#SBATCH --gpu-bind=per_task:1"])
    return f"#SBATCH --gpus-per-node={prefix}{c.gpus_per_node}"


def _modules(c: JobConfig) -> str:
    if not c.modules:
        return ""
    return "\n".join([
        "# Software: a clean module environment, then exact versions, so the job does not depend",
        "# on what the submitting shell had loaded.",
        "module purge",
        f"module load {words(c.modules)}",
    ])


def _activate(venv: str) -> list[str]:
    return ["# shellcheck source=/dev/null",
            f"source {word(venv.rstrip('/') + '/bin/activate')}"]


def _venv(c: JobConfig) -> str:
    if c.venv is None:
        return ""
    comment = "# The venv built for these nodes and modules (jobscripts/build-venv.sbatch)."
    return "\n".join([comment, *_activate(c.venv)])


def _signal_lead(signal: str) -> str:
    """The seconds before the end at which ``--signal`` (``USR1@120``) signals: sbatch's
    default, 60, where it names none."""
    return signal.partition("@")[2] or "60"


def _environment(c: JobConfig) -> str:
    lines = []
    if c.kind != "build-venv" and _facts(c).job_sets_backend:
        lines += ["# tfdist reads TFDIST_* variables (README: Settings and their precedence).",
                  f"export TFDIST_BACKEND={_facts(c).name}"]
        if _facts(c).framework == JAX:
            lines += ["# Keras 3 trains on JAX (set before Keras is imported).",
                      "export KERAS_BACKEND=jax"]
    if c.kind != "build-venv":
        lines += ["# Python prints each line when it is written, not in blocks.",
                  "export PYTHONUNBUFFERED=1"]
    if (c.kind != "build-venv" and c.effective_cpus_per_task
            and c.effective_launcher in ("srun", "torchrun")):
        lines += ["# srun of Slurm 22.05 to 23.02 does not pass the job's --cpus-per-task on to "
                  "its tasks;", "# SRUN_CPUS_PER_TASK does.",
                  'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"']
    if c.kind != "build-venv" and c.signal is not None:
        lines += ["# A save has this long between the signal and the kill: tfdist names a "
                  "state too big for it.",
                  f"export TFDIST_SIGNAL_LEAD={_signal_lead(c.signal)}"]
    if c.kind != "build-venv" and c.survives and c.requeue:
        lines += ["# A lost node of this shell (and of tfdist survive's step loop): the tasks "
                  "left requeue the job,", "# which would otherwise idle to its time limit.",
                  "export TFDIST_REQUEUE_IF_BATCH_LOST=1"]
    if c.env:
        lines.append("# Variables of this job (env):")
        lines += [f"export {name}={word(value)}" for name, value in c.env.items()]
    return "\n".join(lines)


def _network(c: JobConfig) -> str:
    if c.gpus_per_node < 1:
        return ""
    lines = list(_NCCL_HINTS)
    if _facts(c).dials_hosts:
        lines.append(_TF_HOST_HINT)
    if c.effective_launcher == "mpirun":
        lines.append("# With mpirun, also forward each one you set: -x NCCL_IB_HCA ...")
    return "\n".join(lines)


def _doctor(c: JobConfig) -> str | None:
    """A step of its own before training: ``tfdist doctor`` on the same tasks, in seconds."""
    if not c.doctor:
        return None
    python = word(c.python) if c.python else "python"
    command = f"{python} -m tfdist doctor"
    comment = ["# Check the launch before training, in seconds: every rank's host, cores, GPUs "
               "and versions,", "# the ports between the nodes and one all-reduce. A problem "
               "names the rank, the host and", "# the fix, and ends the job here; the report "
               "goes to this job's output. (doctor: false", "# in the config, or --no-doctor, "
               "leaves this step out.)"]
    torch = _facts(c).framework == "torch"
    if _facts(c).horovod and c.effective_launcher != "srun":
        # The training's launcher starts Horovod; this step checks the nodes with the
        # framework's own collectives over srun, which the job has too.
        command += " --framework torch --backend ddp" if torch else " --backend mwms"
        comment.append("# (Horovod starts under the launcher below; this step uses srun and "
                       + ("torch's all-reduce.)" if torch else "TensorFlow's all-reduce.)"))
    elif torch:
        command += " --framework torch"
    step = _lines(comment, _srun_segments(c, doctor=True), _apptainer(c), command)
    return _again_after_cleanup(step) if c.requeue or c.survives else step


# A requeued job runs under the same job id: a node back from a network cut may still be
# cleaning up the earlier run, and Slurm's cleanup then ends the new run's tasks there (the
# test cluster: the doctor's task, SIGTERM, the job FAILED 143). The training step under tfdist
# survive restarts such a task on the same nodes; the doctor's step runs again.
_AGAIN = ["for attempt in 1 2 3; do", "    code=0"]
_AGAIN_END = [
    "    case $code in",
    "        137|143) echo \"tfdist: a signal ended a task of the doctor's step (exit $code, "
    "attempt $attempt of 3: Slurm's cleanup of an earlier run?)\" >&2 ;;",
    "        *) break ;;",
    "    esac",
    "done",
    '[ "$code" -eq 0 ] || exit "$code"',
]


def _again_after_cleanup(step: str) -> str:
    """``step`` (comment lines, then a command) run again when a signal ended one of its tasks,
    3 times at most; then the job ends with its code."""
    lines = step.split("\n")
    comments = [line for line in lines if line.startswith("#")]
    command = [line for line in lines if not line.startswith("#")]
    return "\n".join([
        *comments,
        "# A task ended by a signal (exit 143 or 137: Slurm's cleanup of an earlier run of "
        "this job, on a", "# node back from a network cut) runs the step again, 3 times at "
        "most.",
        *_AGAIN, *("    " + line for line in command[:-1]), "    " + command[-1] + " || code=$?",
        *_AGAIN_END])


def _launch(c: JobConfig) -> str:
    launcher = c.effective_launcher
    if launcher == "torchrun":
        text = _torchrun(c)
    elif launcher == "mpirun":
        text = _mpirun(c)
    elif launcher == "horovodrun":
        text = _horovodrun(c)
    else:
        text = _srun(c)
    return _with_requeue(text, c.signal, survive=c.survives) if c.requeue else text


# After a preemption every task exits 75 (tfdist.preemption.EXIT_PREEMPTED) once the state is
# saved, and rank 0 requeues the job with scontrol; inside a container it may have none, so the
# batch shell, which has, does it too (a second request for a job already requeued fails
# harmlessly). The launcher runs in the background so that this shell can pass on a signal
# that reached it alone (`scancel --batch`, `--signal=B:...` set by hand): srun forwards USR1
# and USR2 to its tasks, but answers TERM by killing them, so TERM goes on as USR1. Without the
# trap Slurm's TERM would end this shell at once, and with it the job, before the tasks had
# saved.
# tfdist survive exits 75 too, when fewer nodes than min_nodes answer: its own line says so.
_WHY_REQUEUE = {False: "preempted",
                True: "preempted, or too few nodes left: the line above says which"}


def _requeue(survive: bool) -> list[str]:
    return [
        'if [ "$code" -eq 75 ] && [ "${SLURM_RESTART_COUNT:-0}" -lt '
        '"${TFDIST_MAX_REQUEUES:-20}" ]; then',
        '    job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"',
        f'    echo "tfdist: {_WHY_REQUEUE[survive]}; requeueing job ${{job:-$SLURM_JOB_ID}}" >&2',
        '    scontrol requeue "${job:-$SLURM_JOB_ID}" || true',
        "fi",
        'exit "$code"',
    ]


def _with_requeue(launch: str, signal: str | None, *, survive: bool = False) -> str:
    lines = launch.split("\n")
    comments = [line for line in lines if line.startswith("#")]
    command = [line for line in lines if not line.startswith("#")]
    # srun answers TERM by killing its tasks at once (SIGKILL): TERM is passed on as USR1.
    names = {"TERM": "USR1", "USR1": "USR1"}
    name = (signal or "").partition("@")[0].upper().removeprefix("SIG")
    if name and name not in names:
        names[name] = name if name in ("USR1", "USR2") else "USR1"
    # Set before the tasks start, so that no signal finds the shell without them (it would
    # end the shell); one that comes before srun's pid is known is passed on right after.
    traps = [f"trap '[ -n \"$launched\" ] && kill -{sent} \"$launched\" 2>/dev/null || "
             f"pending={sent}' {got}" for got, sent in names.items()]
    return "\n".join([
        *comments,
        "# Preempted (exit code 75): requeue from this shell too, in case the tasks had no "
        "scontrol.",
        f"# A signal to this shell alone ({', '.join(names)}) goes on to the tasks.",
        "launched=", "pending=", *traps,
        *command[:-1], command[-1] + " &",
        "launched=$!",
        '[ -z "$pending" ] || kill -"$pending" "$launched" 2>/dev/null || true',
        'while kill -0 "$launched" 2>/dev/null; do wait "$launched" || true; done',
        'code=0',
        'wait "$launched" || code=$?',
        *_requeue(survive)])


def _program(c: JobConfig) -> str:
    python = word(c.python) if c.python else "python"
    return " ".join([python, word(c.script or ""), words(c.args)]).rstrip()


def _srun_segments(c: JobConfig, *, per_node: bool = False, doctor: bool = False,
                   step: tuple[str, ...] = ()) -> list[str]:
    """``srun`` and its options (binding, PMIx for Horovod, per-task output), then pyxis's.

    ``doctor``: for the doctor's step (and the scaling report's), which writes to the job's
    output and takes the launcher's options only when the launcher is srun itself. ``step``:
    the step's own size, when it is not the job's.
    """
    own = c.effective_launcher == "srun" or not doctor
    options = ["srun", "--kill-on-bad-exit=1"]  # one failed task ends the step, not a hang
    if per_node:
        options.append("--ntasks-per-node=1")
    if c.cpu_bind:
        options.append(word(f"--cpu-bind={c.cpu_bind}"))
    if _horovod_mpi(c) and own:
        options.append("--mpi=pmix")
    if c.task_output is not None and not doctor:
        options.append(word(f"--output={c.task_output}"))
    container = []
    if c.runtime == "enroot":
        container.append(word(f"--container-image={c.image}"))
        if c.binds:
            container.append(word(f"--container-mounts={','.join(c.binds)}"))
    extra = [] if per_node or not own else [word(arg) for arg in c.launcher_args]
    return [" ".join(options), " ".join(step), *container, " ".join(extra)]


def _horovod_mpi(c: JobConfig) -> bool:
    """Horovod under srun uses MPI through PMIx, unless the job forces tfdist's Gloo rendezvous."""
    return _facts(c).horovod and resolve("horovod_controller", environ=c.env) != "gloo"


def _facts(c: JobConfig) -> Backend:
    """The facts of the job's backend (:mod:`tfdist.backend_facts`); its ``name`` is what the
    job's TFDIST_BACKEND names: ``mwms``, ``horovod``, ``ddp`` or ``deepspeed``."""
    return job_backend(c.backend)


def _apptainer(c: JobConfig) -> str | None:
    if c.runtime != "apptainer":
        return None
    parts = ["apptainer exec"]
    if c.gpus_per_node:
        parts.append("--nv")
    parts += [f"-B {word(bind)}" for bind in c.binds]
    parts.append(word(c.image or ""))
    return " ".join(parts)


def _container_comment(c: JobConfig) -> list[str]:
    if c.runtime == "apptainer":
        return ["# apptainer exec: --nv brings the host's NVIDIA driver into the container, "
                "-B binds host paths."]
    if c.runtime == "enroot":
        return ["# pyxis: --container-image runs each task in the image, with --container-mounts "
                "mounted;", "# paths are those inside the container."]
    return []


def _lines(comment: list[str], *segments: str | list[str] | None) -> str:
    flat = [part for segment in segments
            for part in (segment if isinstance(segment, list) else [segment])]
    command = " \\\n    ".join(part for part in flat if part)
    return "\n".join([*comment, command])


def _srun(c: JobConfig) -> str:
    pinned = ", bound to its cores" if c.cpu_bind else ""
    comment = [f"# Launch: one srun task per {_unit(c)} (--ntasks-per-node on each node){pinned}."]
    if _horovod_mpi(c):
        comment.append("# --mpi=pmix lets Horovod's MPI start under srun (`srun --mpi=list` "
                       "shows your site's plugins).")
    return _lines(comment + _container_comment(c) + _survive_comment(c), _survive(c),
                  _srun_segments(c), _apptainer(c), _program(c))


def _survive(c: JobConfig) -> str | None:
    if not c.survives:
        return None
    python = word(c.python) if c.python else "python"
    spares = f" --spares {c.spare_nodes}" if c.spare_nodes else ""
    return (f"{python} -m tfdist survive --min-nodes {c.effective_min_nodes} --restarts "
            f"{c.node_restarts} --tasks-per-node {c.effective_tasks_per_node}{spares} --")


def _survive_comment(c: JobConfig) -> list[str]:
    if not c.survives:
        return []
    exits = "; else it exits 75: requeued." if c.requeue else "; else it exits 75."
    if c.spare_nodes:
        return ["# A node lost: tfdist survive asks every node; a spare that answers takes the "
                "lost one's place", "# and the step starts again as large as before, from the "
                "last save (the uninterrupted run's", f"# continuation); without one, on those "
                f"left while at least {c.effective_min_nodes} are.", f"# {c.node_restarts} "
                f"restarts at most{exits}"]
    return ["# A node lost: tfdist survive asks every node, and the step starts again on those "
            "that answer", f"# (from the last save) while at least {c.min_nodes} are left, "
            f"{c.node_restarts} times at most{exits}"]


def _mpirun(c: JobConfig) -> str:
    forwarded = ["PATH", "PYTHONUNBUFFERED"]
    if _facts(c).job_sets_backend:
        forwarded.append("TFDIST_BACKEND")
    forwarded += list(c.env)
    comment = ["# Launch (Open MPI): ppr:N:node puts --ntasks-per-node ranks on each node, in "
               "Slurm's order;", "# --bind-to none leaves the cores to the framework's threads; "
               "-x forwards variables to", "# ranks that Open MPI starts over ssh."]
    return _lines(comment + _container_comment(c),
                  'mpirun -np "$SLURM_NTASKS" --map-by "ppr:${SLURM_NTASKS_PER_NODE}:node" '
                  "--bind-to none",
                  " ".join(f"-x {word(name)}" for name in forwarded),
                  words(c.launcher_args), _apptainer(c), _program(c))


def _horovodrun(c: JobConfig) -> str:
    hosts = ('hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" \\\n'
             '    | sed "s/\\$/:${SLURM_NTASKS_PER_NODE}/" | paste -sd, -)')
    options = " ".join(['horovodrun -np "$SLURM_NTASKS" -H "$hosts"',
                        *(word(arg) for arg in c.launcher_args)])
    comment = ["# Launch: horovodrun takes the job's nodes as host:slots (n1:4,n2:4), in Slurm's "
               "node order."]
    return "\n".join([*comment, hosts, _lines([], options, _program(c))])


def _torchrun(c: JobConfig) -> str:
    low, high = PORT_RANGE
    setup = [
        "# Rendezvous on the job's first node. The port comes from the job id, as tfdist derives "
        "its own",
        f"# ports: {low}-{high - 1}, below Linux's ephemeral ports, and different for jobs with "
        "neighbouring ids.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"rdzv_port={rendezvous_port_expression()}",
    ]
    # Each task's own shell fills in its node: torchrun's c10d rendezvous would number the nodes
    # by sorting host names as strings (n10 before n9), so the chief would not run on the first.
    if c.python:
        per_task = ("bash -c 'exec \"$0\" -m torch.distributed.run "
                    f"--node-rank=\"$SLURM_NODEID\" \"$@\"' {word(c.python)}")
    else:
        per_task = "bash -c 'exec \"$0\" --node-rank=\"$SLURM_NODEID\" \"$@\"' torchrun"
    torchrun = '--nnodes="$SLURM_NNODES" --nproc-per-node="${SLURM_GPUS_PER_NODE##*:}"'
    rendezvous = ('--master-addr="$head_node" --master-port="$rdzv_port" '
                  '--rdzv-id="$SLURM_JOB_ID"')
    program = " ".join([word(c.script or ""), words(c.args)]).rstrip()
    comment = ["# Launch: one srun task per node runs torchrun, which starts one process per "
               "GPU of the node.",
               "# Node ranks follow Slurm's node order (SLURM_NODEID, filled in by each task's "
               "shell), so the",
               "# chief runs on the first node; c10d would order the nodes by name (n10 before "
               "n9).",
               "# shellcheck disable=SC2016  # $0, $@ and SLURM_NODEID are the task shell's"]
    return "\n".join([*setup, "", _lines(comment + _container_comment(c),
                                         _srun_segments(c, per_node=True), _apptainer(c),
                                         per_task, torchrun, rendezvous, words(c.launcher_args),
                                         program)])


def _scaling(c: JobConfig) -> str:
    tasks = c.effective_tasks_per_node
    sizes = " ".join(map(str, c.effective_scaling_nodes))
    python = word(c.python) if c.python else "python"
    train = _lines([], _srun_segments(c, step=('--nodes="$nodes"', '--ntasks="$workers"',
                                               f"--ntasks-per-node={tasks}",
                                               '--nodelist="$nodelist"')),
                   _apptainer(c), _program(c))
    report = _lines([], _srun_segments(c, doctor=True, step=("--nodes=1", "--ntasks=1",
                                                             "--ntasks-per-node=1")),
                    _apptainer(c), f'{python} -m tfdist scaling --report "$scaling_dir"')
    return "\n".join([
        "# Scaling efficiency: the same training on each number of nodes in turn, one srun step "
        "each,",
        f"# {tasks} task(s) per node. The chief of each step writes its throughput per epoch to",
        "# TFDIST_THROUGHPUT_FILE (the meter of dist.callbacks()), in a folder next to the job's "
        "output",
        "# that every node must see. A failed step ends the job here (set -e). Each step runs on "
        "the",
        "# allocation's first nodes, so that the sizes compare the same machines (Slurm would "
        "otherwise",
        "# take any free nodes, and one that the last step still holds is not free yet).",
        *_container_comment(c),
        f"scaling_dir={_scaling_dir(c)}",
        'mkdir -p "$scaling_dir/runs"',
        'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"for nodes in {sizes}; do",
        f"    workers=$((nodes * {tasks}))",
        '    nodelist=$(head -n "$nodes" <<<"$hosts" | paste -sd, -)',
        '    echo "tfdist scaling: $nodes node(s), $workers worker(s)"',
        '    export TFDIST_THROUGHPUT_FILE="$scaling_dir/runs/n${workers}-r1.jsonl"',
        "\n".join(f"    {line}" for line in train.split("\n")),
        "done",
        "",
        "# The report, from the runs alone: scaling.md, scaling.csv and, with matplotlib "
        "(tfdist[plot]),",
        "# scaling.png. `tfdist scaling --report DIR` writes it again anywhere.",
        report,
    ])


def _listing(sizes: tuple[int, ...]) -> str:
    """``1, 2 and 4``."""
    words = [str(size) for size in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _scaling_dir(c: JobConfig) -> str:
    """``scaling-$SLURM_JOB_ID`` next to the job's output file (else in the job's directory),
    as an absolute path: a task in a container may start in another directory."""
    directory = posixpath.dirname(c.output)
    if "%" in directory or not directory:
        directory = "${PWD}"
    elif not directory.startswith("/"):
        directory = "${PWD}/" + directory
    return word(directory.rstrip("/") + "/scaling-${SLURM_JOB_ID}")


def _build(c: JobConfig) -> str:
    venv = c.venv or ""
    create = [word(c.python) if c.python else "python3", "-m venv"]
    if c.system_site_packages:
        create.append("--system-site-packages")
    create.append(word(venv))
    return "\n".join([
        "# Create the venv with the modules' Python and install into it. Running the job again "
        "on an",
        "# existing venv installs into it in place.",
        " ".join(create),
        *_activate(venv),
        "python -m pip install --upgrade pip",
        f"python -m pip install {words(c.packages)}",
        "# Alternatives: system_site_packages: true reuses a TensorFlow your modules provide "
        "(then",
        "# leave it out of packages); Keras 2 with tensorflow-cpu needs",
        "# `python -m pip install --no-deps tf_keras==<your TF minor>` (README).",
        "",
        "# Check on this node type: consistent requirements, versions, and the GPUs each "
        "framework sees.",
        "python -m pip check",
        _VENV_CHECK,
    ])
