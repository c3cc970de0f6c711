"""Which GPUs and how many CPU threads a process uses: one policy for every backend and torch.

GPU policy (one srun task per GPU is the common case):

1. Slurm bound GPUs to the task (``--gpus-per-task``), or one GPU is visible: use them all.
2. Several GPUs are visible to several tasks on the node: each task takes its own equal,
   contiguous share by local rank, keeping the physical ids (``CUDA_VISIBLE_DEVICES=2,3``, two
   tasks: task 1 gets ``3``, never renumbered to ``1``).
3. Nothing is set: the framework counts the GPUs, and each task takes its share of that count
   by local rank (:func:`share`).

``tfdist launch --gpus-per-worker K`` sets the first ``N*K`` ids for its N workers
(:func:`launch_gpus`), so that rule 2 gives each worker its own K.

:func:`narrow_visible_gpus` is the one place in tfdist that writes ``CUDA_VISIBLE_DEVICES``, and
it must run before the framework first looks at CUDA. Everything else here is pure and imports
no framework: the backends apply the choice through TensorFlow or torch.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import MutableMapping

from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError

__all__ = ["NO_GPUS", "affinity_thread_count", "count", "launch_gpus", "narrow_visible_gpus",
           "node_gpus", "one_gpu_per_process", "select_gpus", "share", "thread_count"]

NO_GPUS = ("", "NoDevFiles", "-1", "none")  # what schedulers write for "no GPU"
_GPU_FILE = re.compile(r"/dev/nvidia\d+$")


def select_gpus(visible: str | None, local_rank: int, local_world_size: int,
                bound_per_task: bool) -> str | None:
    """Chooses this task's ``CUDA_VISIBLE_DEVICES`` from what the launcher gave it (rules 1-2).

    Args:
        visible: the inherited ``CUDA_VISIBLE_DEVICES``; None when unset.
        local_rank: the task's index on its node.
        local_world_size: tasks on the node.
        bound_per_task: Slurm already bound GPUs to each task (``--gpus-per-task``).

    Returns:
        The ids to make visible (physical ids kept, e.g. ``"3"`` from ``"2,3"``), ``""`` for a
        CPU-only task, or None when nothing is known and the framework must count the GPUs.

    Raises:
        ConfigError: fewer GPUs than tasks on the node, or a count that does not divide.
    """
    if visible is None:
        return None
    if visible.strip() in NO_GPUS:
        return ""
    ids = [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    if bound_per_task or len(ids) == 1 or local_world_size == 1:
        return ",".join(ids)
    if len(ids) % local_world_size:
        raise ConfigError(
            f"{len(ids)} GPUs (CUDA_VISIBLE_DEVICES={visible}) cannot be shared evenly by "
            f"{local_world_size} tasks on this node: run one task per GPU "
            f"(`srun --ntasks-per-node={len(ids)}`) or bind them with `--gpus-per-task=1`")
    per_task = len(ids) // local_world_size
    return ",".join(ids[local_rank * per_task:(local_rank + 1) * per_task])


def share(count: int, local_rank: int, local_world_size: int) -> range:
    """The indices of this task's share of ``count`` GPUs the framework counted (rule 3).

    Raises:
        ConfigError: the GPUs cannot be shared evenly by the tasks on the node.
    """
    if count == 0 or local_world_size == 1:
        return range(count)
    if count % local_world_size:
        gpus = "1 GPU" if count == 1 else f"{count} GPUs"
        raise ConfigError(f"{gpus} cannot be shared evenly by {local_world_size} processes on "
                          f"this node: start {count} process{'es' * (count > 1)} per node, one "
                          "per GPU")
    per_task = count // local_world_size
    return range(local_rank * per_task, (local_rank + 1) * per_task)


def narrow_visible_gpus(environment: ClusterEnvironment,
                        environ: MutableMapping[str, str] | None = None) -> str | None:
    """Applies :func:`select_gpus` to ``CUDA_VISIBLE_DEVICES``, before any framework reads it.

    Args:
        environment: the detected launch.
        environ: the environment to write (default ``os.environ``).

    Returns:
        The ids now visible (``""``: none), or None when nothing was set and the framework must
        count the GPUs and take :func:`share` of them.
    """
    environ = os.environ if environ is None else environ
    chosen = select_gpus(environment.visible_devices, environment.local_rank,
                         environment.local_world_size, environment.gpus_per_task is not None)
    if chosen is not None and chosen != environment.visible_devices:
        environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def launch_gpus(visible: str | None, node_gpu_count: int, num_workers: int,
                per_worker: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that ``tfdist launch -n N --gpus-per-worker K`` gives all
    its workers: the first ``N*K`` of the inherited ids, else of the node's GPUs. Each worker's
    ``tfdist.init()`` then keeps its own contiguous K (:func:`select_gpus`).

    Args:
        visible: the launcher's ``CUDA_VISIBLE_DEVICES``; None when unset.
        node_gpu_count: GPUs of the node (:func:`node_gpus`), read when ``visible`` is None.
        num_workers: N.
        per_worker: K, at least 1.

    Raises:
        ConfigError: no GPU, or fewer than ``N*K``; the message names the fix.
    """
    if visible is None:
        ids = [str(i) for i in range(node_gpu_count)]
        where = f"CUDA_VISIBLE_DEVICES unset, {node_gpu_count} /dev/nvidiaN device files"
    else:
        ids = [] if visible.strip() in NO_GPUS else [i.strip() for i in visible.split(",")
                                                     if i.strip()]
        where = f"CUDA_VISIBLE_DEVICES={visible}"
    needed = num_workers * per_worker
    if not ids:
        stand_in = (f"; TFDIST_CPU_REPLICAS={per_worker} gives each worker {per_worker} CPU "
                    "replicas instead, the GPU-free stand-in" if per_worker > 1 else "")
        raise ConfigError(f"--gpus-per-worker {per_worker}: this machine shows no GPU ({where}). "
                          f"Leave the option out to train on the CPU{stand_in}")
    if needed > len(ids):
        fixes = [f"-n {len(ids) // per_worker}"] if len(ids) >= per_worker else []
        if len(ids) >= num_workers:
            fixes.append(f"--gpus-per-worker {len(ids) // num_workers}")
        raise ConfigError(
            f"-n {num_workers} --gpus-per-worker {per_worker} needs {needed} GPUs, but "
            f"{len(ids)} are visible ({where}): use " + (" or ".join(fixes) or
                                                          f"-n 1 --gpus-per-worker {len(ids)}"))
    return ",".join(ids[:needed])


def one_gpu_per_process(engine: str, given: int, alternative: str = "") -> str | None:
    """The warning for a process of an engine that drives one GPU per process (Horovod, DDP)
    when it was given ``given`` GPUs; None for one or none.

    Args:
        engine: what drives the GPU, for the message (``"Horovod"``).
        given: the GPUs in this process's share.
        alternative: a backend that drives them all, for the fix, or ``""``.
    """
    if given <= 1:
        return None
    other = f", or use {alternative}, which drives several GPUs per process" if alternative else ""
    return (f"{engine} drives one GPU per process, and this process was given {given}: it "
            f"trains on the first, and {given - 1} stay idle. Fix: start one process per GPU "
            f"(`srun --ntasks-per-node={given}` on each node, `tfdist launch -n {given}`){other}")


def node_gpus() -> int:
    """NVIDIA GPU device files on this node (``/dev/nvidia0`` ...): no framework, no driver
    call. Inside a job they may exceed the GPUs the job was given."""
    return len([path for path in glob.glob("/dev/nvidia*") if _GPU_FILE.match(path)])


def count(chosen: str | None) -> int | None:
    """How many GPUs a :func:`select_gpus` result names; None when the framework must count."""
    return None if chosen is None else len([gpu for gpu in chosen.split(",") if gpu])


def thread_count(threads: int | None, pinned_cores: int, machine_cores: int,
                 local_processes: int = 1) -> int | None:
    """Threads a framework should use: ``threads``, else the pinned cores when pinned, else the
    machine's cores shared by the processes on it.

    Several processes on one machine that nothing pins (srun without CPU binding, horovodrun,
    ``mpirun --bind-to none``) would each start a thread per core: 4 ranks of torch on 2 cores
    ran a training 2.5 times slower than with one thread each (OpenMP's threads spin while
    they wait). torchrun sets one thread per process there; tfdist gives each process its
    share of the cores.

    Args:
        threads: what the user asked for (``init(threads=)``, ``TFDIST_NUM_THREADS``).
        pinned_cores: cores in this process's affinity mask (0 when unknown).
        machine_cores: cores of the machine.
        local_processes: the job's processes on this machine.

    Returns:
        The count to apply, or None to keep the framework's default (one process, not pinned:
        its defaults fit the whole machine).
    """
    if threads is not None:
        return threads
    if pinned_cores and pinned_cores < machine_cores:
        return pinned_cores
    if local_processes > 1 and machine_cores:
        return max(1, machine_cores // local_processes)
    return None


def affinity_thread_count(threads: int | None, local_processes: int = 1,
                          framework_variable: str | None = None) -> int | None:
    """:func:`thread_count` for this process (srun ``--cpu-bind``, ``tfdist launch``); None
    where the user set the framework's own variable (``OMP_NUM_THREADS`` for torch,
    ``TF_NUM_INTRAOP_THREADS`` for TensorFlow) and asked tfdist for nothing: it reads it."""
    if threads is None and framework_variable and os.environ.get(framework_variable):
        return None
    pinned = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return thread_count(threads, pinned, os.cpu_count() or pinned, local_processes)
