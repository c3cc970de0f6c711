"""What tfdist knows about each launcher, in one table (pure).

A launcher is what started the processes (:attr:`tfdist.env.ClusterEnvironment.launcher`); a
module of this package detects it. What the rest of tfdist must know about it (is it Horovod's,
where do the ranks' addresses come from, where does torch meet, who serves Horovod's rendezvous)
is a column here, read as ``environment.facts``: the rooms outside ``tfdist/env/`` and
``tfdist/jobs/`` (whose ``launcher`` key names the commands of a job script) read a column instead
of comparing a launcher's name, so a new launcher is its detector and one row here.

``tfdist launch`` (launcher ``local``) is a row twice: its workers are set up for MWMS (a
``TF_CONFIG`` each) or for Horovod (horovodrun's variables), which ``launched_for`` tells apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.errors import ConfigError

__all__ = ["LAUNCHERS", "Launcher", "launcher"]


@dataclass(frozen=True)
class Launcher:
    """One launcher's facts.

    Attributes:
        name: its :attr:`~tfdist.env.ClusterEnvironment.launcher`: ``"slurm"`` (an srun step),
            ``"tf_config"``, ``"local"`` (``tfdist launch``), ``"torchrun"``, ``"horovodrun"``,
            ``"mpirun"`` (Open MPI, or MPICH's and Intel MPI's hydra) or ``"single"``.
        launched_for: for ``tfdist launch``, the backend its workers were set up for
            (``"mwms"`` or ``"horovod"``); None for the other launchers.
        horovod: every process carries Horovod's or MPI's variables and no address of its own:
            ``auto`` picks Horovod there (for torch too, unless ``MASTER_ADDR`` and
            ``MASTER_PORT`` are given).
        horovod_joins: ``hvd.init()`` can join its processes, with what
            :mod:`tfdist.horovod.join` adds.
        serves_rendezvous: rank 0's process serves Horovod's Gloo rendezvous and tfdist picks
            Horovod's controller (:mod:`tfdist.horovod.join`), so a heartbeat store that falls
            silent is rank 0 stopping (:mod:`tfdist.horovod.heartbeat`).
        one_process: no launcher, one plain process: nothing to meet (Horovod's Gloo without
            peers, torch's in-memory store).
        slurm_addresses: every rank's ``host:port`` is derived from Slurm's variables
            (:mod:`tfdist.env.slurm`): MWMS's cluster (:mod:`tfdist.backends.resolver`), and
            torch meets at rank 0's unless ``MASTER_ADDR``/``MASTER_PORT`` say otherwise.
        tf_config_addresses: every rank's address is in its ``TF_CONFIG``: MWMS's cluster
            (TensorFlow's ``TFConfigClusterResolver``), and torch meets at rank 0's.
        torch_store: torch's store already runs at ``MASTER_ADDR:MASTER_PORT`` (torchrun's
            agent): torch joins it (``env://``), JAX's runtime meets one port above it.
        output_per_task: each task's output can be a file of its own (``srun
            --output=...%t``), which the lines about a failed peer point at.
        batch_script_steps: the ranks are the tasks of a step that the job's batch script
            started on the job's first node: when that node is lost they are left without it,
            and may requeue the job (:func:`tfdist.survive.requeue_if_orphaned`).
    """

    name: str
    launched_for: str | None = None
    horovod: bool = False
    horovod_joins: bool = False
    serves_rendezvous: bool = False
    one_process: bool = False
    slurm_addresses: bool = False
    tf_config_addresses: bool = False
    torch_store: bool = False
    output_per_task: bool = False
    batch_script_steps: bool = False

    @property
    def tfdist_launch(self) -> bool:
        """``tfdist launch`` started the workers: it restarts them itself (``--max-restarts``)
        instead of a Slurm requeue."""
        return self.launched_for is not None


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("slurm", horovod_joins=True, serves_rendezvous=True, slurm_addresses=True,
             output_per_task=True, batch_script_steps=True),
    Launcher("tf_config", tf_config_addresses=True),
    Launcher("local", "mwms", tf_config_addresses=True),
    Launcher("local", "horovod", horovod=True, horovod_joins=True),
    Launcher("torchrun", torch_store=True),
    Launcher("horovodrun", horovod=True, horovod_joins=True),
    Launcher("mpirun", horovod=True, horovod_joins=True),
    Launcher("single", horovod_joins=True, one_process=True),
)


def launcher(name: str, launched_for: str | None = None) -> Launcher:
    """The row of launcher ``name``; for ``tfdist launch``, the one of ``launched_for`` (the
    first, MWMS's, when it is not said).

    Raises:
        ConfigError: no such launcher; the message lists the table's.
    """
    rows = [row for row in LAUNCHERS if row.name == name]
    if not rows:
        raise ConfigError(f"launcher {name!r} is not one of "
                          f"{', '.join(dict.fromkeys(row.name for row in LAUNCHERS))}")
    return next((row for row in rows if row.launched_for == launched_for), rows[0])
