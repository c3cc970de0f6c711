"""Which GPUs and how many CPU threads a process uses: one policy for every backend and torch.

GPU policy (one srun task per GPU is the common case):

1. Slurm bound GPUs to the task (``--gpus-per-task``), or one GPU is visible: use them all.
2. Several GPUs are visible to several tasks on the node: each task takes its own equal,
   contiguous share by local rank, keeping the physical ids (``CUDA_VISIBLE_DEVICES=2,3``, two
   tasks: task 1 gets ``3``, never renumbered to ``1``).
3. Nothing is set: the framework counts the GPUs, and each task takes its share of that count
   by local rank (:func:`share`).

:func:`narrow_visible_gpus` is the one place in tfdist that writes ``CUDA_VISIBLE_DEVICES``, and
it must run before the framework first looks at CUDA. Everything else here is pure and imports
no framework: the backends apply the choice through TensorFlow or torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError

__all__ = ["NO_GPUS", "affinity_thread_count", "count", "narrow_visible_gpus", "select_gpus",
           "share", "thread_count"]

NO_GPUS = ("", "NoDevFiles", "-1", "none")  # what schedulers write for "no GPU"


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
        raise ConfigError(f"{count} GPUs cannot be shared evenly by {local_world_size} processes "
                          f"on this node: start {count} processes per node, one per GPU")
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


def count(chosen: str | None) -> int | None:
    """How many GPUs a :func:`select_gpus` result names; None when the framework must count."""
    return None if chosen is None else len([gpu for gpu in chosen.split(",") if gpu])


def thread_count(threads: int | None, pinned_cores: int, machine_cores: int) -> int | None:
    """Threads a framework should use: ``threads``, else the pinned cores when pinned.

    Args:
        threads: what the user asked for (``init(threads=)``, ``TFDIST_NUM_THREADS``).
        pinned_cores: cores in this process's affinity mask (0 when unknown).
        machine_cores: cores of the machine.

    Returns:
        The count to apply, or None to keep the framework's default (not pinned: its defaults
        fit the whole machine).
    """
    if threads is not None:
        return threads
    if not pinned_cores or pinned_cores >= machine_cores:
        return None
    return pinned_cores


def affinity_thread_count(threads: int | None) -> int | None:
    """:func:`thread_count` for this process (srun ``--cpu-bind``, ``tfdist launch``)."""
    pinned = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return thread_count(threads, pinned, os.cpu_count() or pinned)
