"""Slurm: one srun task per GPU, or the batch shell that must not train alone.

An srun step exports ``SLURM_STEP_ID`` and ``SLURM_PROCID``; the batch script itself has the job's
variables but no step. Everything here is derived from the variables, in Slurm's node order.
"""

from __future__ import annotations

from collections.abc import Mapping

from tfdist.env.base import ClusterEnvironment, common, get_int, local_ranks
from tfdist.errors import ConfigError, LaunchError
from tfdist.hostlist import expand_hostlist, expand_tasks_per_node
from tfdist.settings import resolve

__all__ = ["detect", "job_allocation", "step_task", "task_nodes", "port_base", "PORT_RANGE",
           "PORT_BLOCK"]

# Ports are derived from the job and step ids so that two jobs sharing a node don't collide
# (the stock resolver always uses 8888+). The range stays below Linux's ephemeral ports
# (32768+), which the kernel hands out to outgoing connections at random.
PORT_RANGE = (20000, 32768)
PORT_BLOCK = 32  # ports reserved per step and node: one per local task


def detect(environ: Mapping[str, str]) -> ClusterEnvironment | None:
    """Reads an srun step; raises in the batch shell of a job with several tasks.

    Raises:
        LaunchError: outside srun in a multi-task job, or a layout Slurm's variables contradict.
        ConfigError: a malformed Slurm or ``TFDIST_*`` variable.
    """
    if "SLURM_JOB_ID" not in environ:
        return None
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return _batch_shell(environ)
    return _step(environ)


def step_task(environ: Mapping[str, str]) -> str | None:
    """``"step J.S, task R"`` where this process is a task of an srun step, else None (the
    batch shell, or no job) (pure)."""
    if "SLURM_JOB_ID" not in environ or "SLURM_STEP_ID" not in environ \
            or "SLURM_PROCID" not in environ:
        return None
    return (f"step {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}, task "
            f"{environ['SLURM_PROCID']}")


def job_allocation(environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """The job's id and its nodes in Slurm's order, read in the batch shell (``tfdist
    survive``).

    Raises:
        LaunchError: not inside a Slurm job.
    """
    job, nodelist = environ.get("SLURM_JOB_ID"), environ.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        raise LaunchError("tfdist survive runs in a Slurm job's batch script: SLURM_JOB_ID and "
                          "SLURM_JOB_NODELIST are not set here")
    return job, expand_hostlist(nodelist)


def _step(environ: Mapping[str, str]) -> ClusterEnvironment:
    rank = get_int(environ, "SLURM_PROCID")
    world_size = get_int(environ, "SLURM_STEP_NUM_TASKS", get_int(environ, "SLURM_NTASKS", 1))
    if not 0 <= rank < world_size:
        raise LaunchError(f"SLURM_PROCID={rank} is outside the step's {world_size} tasks "
                          "(SLURM_STEP_NUM_TASKS): the variables come from different steps")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("an srun step without a node list: neither SLURM_STEP_NODELIST nor "
                          "SLURM_JOB_NODELIST is set. srun sets both; if the script clears or "
                          "filters the environment, keep the SLURM_* variables")
    hosts = expand_hostlist(nodelist)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE")
    if per_node is None and len(hosts) > 1:
        raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE is not set, and the step has "
                          f"{len(hosts)} nodes ({nodelist}): tfdist cannot tell which tasks run "
                          "where. srun sets it; keep the SLURM_* variables in the environment")
    counts = expand_tasks_per_node(per_node or str(world_size))
    if len(counts) != len(hosts) or sum(counts) != world_size:
        raise LaunchError(f"Slurm's step variables disagree: {len(hosts)} nodes "
                          f"(SLURM_STEP_NODELIST={nodelist}), tasks per node {counts} "
                          f"(SLURM_STEP_TASKS_PER_NODE={per_node}), {world_size} tasks in all "
                          "(SLURM_STEP_NUM_TASKS): the variables come from different steps")
    nodes = task_nodes(counts, _distribution(environ))
    node_rank = nodes[rank]
    local = local_ranks(nodes)
    _check_layout(environ, nodes, rank, local[rank])
    base = port_base(environ, max(counts))
    template = resolve("host_template", environ=environ)
    addresses = tuple(f"{template.format(host=hosts[n])}:{base + local[r]}"
                      for r, n in enumerate(nodes))
    return ClusterEnvironment(
        launcher="slurm", rank=rank, world_size=world_size, local_rank=local[rank],
        local_world_size=counts[node_rank], node_rank=node_rank, num_nodes=len(hosts),
        hosts=tuple(hosts), worker_addresses=addresses, coordinator=addresses[0],
        mpi_plugin=_mpi_plugin(environ), **common(environ),
        reason=f"srun step {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']} "
               f"(SLURM_PROCID={rank}, SLURM_STEP_NUM_TASKS={world_size})")


def _mpi_plugin(environ: Mapping[str, str]) -> str | None:
    # srun --mpi=pmix exports PMIX_RANK, --mpi=pmi2 PMI_RANK (as MPICH's hydra does; hydra's
    # own launch is detected before Slurm's by its MPI_LOCALRANKID).
    if "PMIX_RANK" in environ:
        return "pmix"
    return "pmi2" if "PMI_RANK" in environ else None


def task_nodes(tasks_per_node: list[int], distribution: str) -> list[int]:
    """Returns the node index of every rank for Slurm's task distribution across nodes.

    ``distribution`` is ``SLURM_DISTRIBUTION``: ``block`` (the default), ``cyclic`` or
    ``plane=N``; only the part before ``:`` (distribution across nodes) matters here. ``pack``
    and ``nopack`` (``srun -m pack``, clusters with ``CR_Pack_Nodes``) change how many tasks
    each node gets, which ``SLURM_STEP_TASKS_PER_NODE`` already says, not their order: the
    order is then block, as in Slurm.

    Raises:
        LaunchError: a distribution whose layout the variables do not determine (arbitrary),
            or a plane size that is not a positive integer.
    """
    across_nodes = _across_nodes(distribution)
    if across_nodes in ("block", "*"):
        return [node for node, count in enumerate(tasks_per_node) for _ in range(count)]
    if across_nodes == "cyclic":
        return _round_robin(tasks_per_node, 1)
    if across_nodes.startswith("plane="):
        size = across_nodes.split("=", 1)[1]
        if not size.isdigit() or int(size) < 1:
            raise LaunchError(f"SLURM_DISTRIBUTION={distribution!r}: the plane size must be a "
                              "positive integer, as in `srun --distribution=plane=2`")
        return _round_robin(tasks_per_node, int(size))
    raise LaunchError(f"SLURM_DISTRIBUTION={distribution!r}: tfdist can derive every task's node "
                      "only for block, cyclic and plane=N distributions; launch with "
                      "`srun --distribution=block` (the default)")


def _across_nodes(distribution: str) -> str:
    """The method across nodes: ``block,pack`` -> ``block``, ``pack`` -> ``block``."""
    words = [word.strip() for word in distribution.split(":")[0].split(",")]
    methods = [word for word in words if word and word.lower() not in ("pack", "nopack")]
    return methods[0] if methods else "block"


def _distribution(environ: Mapping[str, str]) -> str:
    # `srun --distribution=plane=2` exports SLURM_DISTRIBUTION=plane and the size apart, in
    # SLURM_DIST_PLANESIZE (Slurm's env.c).
    distribution = environ.get("SLURM_DISTRIBUTION", "block")
    if _across_nodes(distribution) == "plane":
        return f"plane={get_int(environ, 'SLURM_DIST_PLANESIZE')}"
    return distribution


def _round_robin(tasks_per_node: list[int], chunk: int) -> list[int]:
    left, nodes = list(tasks_per_node), []
    while any(left):
        for node, remaining in enumerate(left):
            take = min(chunk, remaining)
            nodes += [node] * take
            left[node] -= take
    return nodes


def _check_layout(environ: Mapping[str, str], nodes: list[int], rank: int, local: int) -> None:
    # Every task computes the whole table independently; if Slurm placed tasks otherwise, the
    # workers would dial the wrong addresses and wait forever. Better to stop here and say so.
    expected = {"SLURM_NODEID": nodes[rank], "SLURM_LOCALID": local}
    gtids = environ.get("SLURM_GTIDS")
    for name, value in expected.items():
        if name in environ and get_int(environ, name) != value:
            raise LaunchError(f"rank {rank} computed {name}={value} from SLURM_STEP_NODELIST, "
                              f"SLURM_STEP_TASKS_PER_NODE and SLURM_DISTRIBUTION, but Slurm says "
                              f"{environ[name]}; launch with `srun --distribution=block`")
    if gtids:
        mine = [r for r, node in enumerate(nodes) if node == nodes[rank]]
        if [int(g) for g in gtids.split(",")] != mine:
            raise LaunchError(f"SLURM_GTIDS={gtids} but the computed layout puts ranks {mine} on "
                              "this node; launch with `srun --distribution=block`")


def port_base(environ: Mapping[str, str], tasks_on_node: int) -> int:
    """First port of this step's block: ``TFDIST_PORT_BASE``, else derived from the job id.

    Raises:
        ConfigError: the ports would leave the valid range, or more tasks share a node than a
            derived block holds.
    """
    base = resolve("port_base", environ=environ)
    if base is not None:
        if base > 65535 - tasks_on_node:
            raise ConfigError(f"TFDIST_PORT_BASE={base} leaves no room for {tasks_on_node} "
                              f"ports: choose a value in 1024..{65535 - tasks_on_node}")
        return base
    if tasks_on_node > PORT_BLOCK:
        raise ConfigError(f"{tasks_on_node} tasks on one node need more than the {PORT_BLOCK} "
                          "ports tfdist derives per job: set TFDIST_PORT_BASE to a free range")
    slots = (PORT_RANGE[1] - PORT_RANGE[0]) // PORT_BLOCK
    # Consecutive job ids get neighbouring blocks; concurrent steps of one job are spread out.
    slot = (get_int(environ, "SLURM_JOB_ID") + 131 * get_int(environ, "SLURM_STEP_ID", 0)) % slots
    return PORT_RANGE[0] + slot * PORT_BLOCK


def _batch_shell(environ: Mapping[str, str]) -> ClusterEnvironment:
    job = environ["SLURM_JOB_ID"]
    tasks = get_int(environ, "SLURM_NTASKS", 1)
    nodes = get_int(environ, "SLURM_JOB_NUM_NODES", get_int(environ, "SLURM_NNODES", 1))
    if tasks > 1 or nodes > 1:
        raise LaunchError(
            f"this process runs in the batch script of Slurm job {job}, outside srun, but the "
            f"job has {tasks} tasks on {nodes} node(s): only this one process would train. "
            "Start the script with srun, one task per GPU, e.g. "
            "`srun python train.py ...` inside the job script (or `srun --ntasks-per-node=GPUS`)."
        )
    return ClusterEnvironment(launcher="single", **common(environ),
                              reason=f"batch shell of one-task Slurm job {job}")
