"""TF_CONFIG: written per process by ``tfdist launch``, or by the user."""

from __future__ import annotations

import json
from collections.abc import Mapping

from tfdist.env.base import ClusterEnvironment, common, get_int, local_ranks
from tfdist.errors import ConfigError, LaunchError

__all__ = ["detect"]

# MultiWorkerMirroredStrategy numbers a chief first, then the workers.
_TASK_TYPES = ("chief", "worker")


def detect(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """Reads ``TF_CONFIG``; the launch by ``tfdist launch`` also sets ``TFDIST_LOCAL_RANK``.

    Raises:
        ConfigError: ``TF_CONFIG`` is not valid JSON, names task types MultiWorkerMirroredStrategy
            does not use, or points at a task that is not in its cluster.
        LaunchError: every task of an srun step inherited one ``TF_CONFIG`` (exported in the
            batch script), which would make several tasks claim the same worker.
    """
    raw = environ.get("TF_CONFIG", "").strip()
    if not raw:
        return None
    cluster, task_type, index = _parse(raw)
    addresses = tuple(a for kind in _TASK_TYPES for a in cluster.get(kind, ()))
    rank = (len(cluster.get("chief", ())) if task_type == "worker" else 0) + index
    host_of = [address.rsplit(":", 1)[0] for address in addresses]
    hosts = tuple(dict.fromkeys(host_of))
    my_host = host_of[rank]
    local_rank = get_int(environ, "TFDIST_LOCAL_RANK", local_ranks(host_of)[rank])
    launched_by_tfdist = environ.get("TFDIST_LAUNCHER") == "local"
    if not launched_by_tfdist:
        _check_not_inherited(environ, rank, len(addresses))
    return ClusterEnvironment(
        launcher="local" if launched_by_tfdist else "tf_config", rank=rank,
        world_size=len(addresses), local_rank=local_rank,
        local_world_size=get_int(environ, "TFDIST_LOCAL_WORLD_SIZE", host_of.count(my_host)),
        node_rank=hosts.index(my_host), num_nodes=len(hosts), hosts=hosts,
        worker_addresses=addresses, coordinator=addresses[0],
        launched_for="mwms" if launched_by_tfdist else None, **common(environ),
        reason=("tfdist launch" if launched_by_tfdist else "TF_CONFIG")
        + f" ({task_type} {index} of {len(addresses)} tasks)")


def _check_not_inherited(environ: Mapping[str, str], rank: int, size: int) -> None:
    # An srun step of as many tasks as TF_CONFIG has workers, where this task's place differs
    # from TF_CONFIG's: the usual cause is `export TF_CONFIG=...` in the batch script, which
    # every task inherits unchanged, so several tasks start the same worker and the job hangs.
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return
    procid = get_int(environ, "SLURM_PROCID")
    tasks = get_int(environ, "SLURM_STEP_NUM_TASKS", get_int(environ, "SLURM_NTASKS", 1))
    if tasks == size > 1 and procid != rank:
        raise LaunchError(
            f"TF_CONFIG makes this srun task {procid} of {tasks} worker {rank}: it was most "
            "likely exported in the batch script, so every task inherited the same one. Fix: "
            "`unset TF_CONFIG` before srun (tfdist builds the cluster from Slurm's variables), "
            "or write a TF_CONFIG per task whose index follows SLURM_PROCID")


def _parse(raw: str) -> tuple[dict[str, list[str]], str, int]:
    try:
        config = json.loads(raw)
        cluster, task = config["cluster"], config["task"]
        task_type, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"TF_CONFIG is not a valid cluster config ({error!r}); expected "
                          '{"cluster": {"worker": ["host:port", ...]}, '
                          '"task": {"type": "worker", "index": 0}}') from None
    unknown = set(cluster) - set(_TASK_TYPES)
    if unknown or task_type not in _TASK_TYPES:
        raise ConfigError(f"TF_CONFIG uses task types {sorted(unknown | {task_type})}; "
                          f"MultiWorkerMirroredStrategy runs only {list(_TASK_TYPES)} tasks "
                          "(parameter servers and evaluators need another strategy)")
    if not 0 <= index < len(cluster.get(task_type, ())):
        raise ConfigError(f"TF_CONFIG task {task_type}:{index} is not in its cluster "
                          f"{cluster}; the index must be 0..{len(cluster.get(task_type, ())) - 1}")
    return cluster, task_type, index
