"""What tfdist knows about each backend, in one table (pure: no framework is imported).

A backend is the engine that keeps the replicas in sync. Its name is the value of
``TFDIST_BACKEND`` (``init(backend=)``, ``tfdist launch --backend``); ``tfdist job`` names the
torch ones after their framework (``torch``, ``torch-horovod``, ``torch-deepspeed``). Every room
that must behave differently per backend (the settings' choices, the CLI, the doctor, the
replica sync check, ``tfdist launch``, ``tfdist job``) reads a column of this table instead of
comparing names, so a new backend is one row here and its own module.

Keras 3 on JAX is the framework ``jax`` with one backend, ``jax`` (Keras's ``DataParallel`` over
JAX's multi-process runtime): it is chosen when ``KERAS_BACKEND`` is ``jax``.

"horovod" is a row twice: Horovod under TensorFlow and under torch are different modules with
the same engine, and :func:`backend` takes the framework to tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdist.errors import ConfigError

__all__ = ["BACKENDS", "Backend", "backend", "job_backend", "names"]

TF, TORCH, JAX = "tf", "torch", "jax"


@dataclass(frozen=True)
class Backend:
    """One backend's facts.

    Attributes:
        name: its ``TFDIST_BACKEND`` value.
        framework: ``"tf"``, ``"torch"`` or ``"jax"`` (Keras 3 on JAX).
        engine: what does the work, as its users name it (for messages).
        module: the module that implements it (its ``create``).
        devices_per_process: ``"several"`` when one process drives all its GPUs (a replica
            each), ``"one"`` when each process drives one device.
        crosses_processes: whether it joins several processes (False: one process, nothing
            crosses processes, so there is no collective between processes to check).
        collective: the setting that picks its collective between processes
            (:mod:`tfdist.settings`), or ``""`` when it has none.
        collective_on_gpus, collective_on_cpus: what ``auto`` of that setting picks; ``""`` when
            the engine decides when it starts (Horovod's controller).
        horovod: it starts Horovod (``hvd.init``): Horovod's controller, its rendezvous and its
            variables under ``tfdist launch``.
        keras2_synced_batch_norm: tf_keras keeps BatchNormalization's moving statistics as
            sync-on-read means under its strategy, so tfdist need not average them (Keras 3
            does not: there tfdist averages them on every backend).
        dials_hosts: its workers dial each other's host names (TensorFlow's gRPC), so
            ``TFDIST_HOST_TEMPLATE`` picks the interface they use.
        launchable: ``tfdist launch --backend`` starts local workers for it.
        job_name: its name in ``tfdist job``, or ``""`` when ``tfdist job`` has no script for it.
        job_launchers: the launchers ``tfdist job`` can start it with; the first is the default.
        job_sets_backend: the job script exports ``TFDIST_BACKEND`` (not where ``auto`` picks
            it under every launcher the script uses).
        several_gpus_instead: for a one-device engine, the backend to name when a process was
            given several GPUs (``""``: none to suggest).
    """

    name: str
    framework: str
    engine: str
    module: str
    devices_per_process: str
    crosses_processes: bool
    collective: str
    collective_on_gpus: str
    collective_on_cpus: str
    horovod: bool = False
    keras2_synced_batch_norm: bool = False
    dials_hosts: bool = False
    launchable: bool = False
    job_name: str = ""
    job_launchers: tuple[str, ...] = ()
    job_sets_backend: bool = True
    several_gpus_instead: str = ""

    @property
    def several_devices(self) -> bool:
        """One process drives several devices, a replica on each."""
        return self.devices_per_process == "several"


# Horovod's launchers: horovodrun starts remote ranks itself; mpirun and srun (PMIx) start MPI
# ranks. TensorFlow's workers take their address table from the srun step (tfdist.env.slurm);
# mpirun and horovodrun give no per-rank addresses. tfdist.torch reads torchrun's store, or
# derives a rendezvous from the srun step.
_HOROVOD_LAUNCHERS = ("srun", "mpirun", "horovodrun")

BACKENDS: tuple[Backend, ...] = (
    Backend("mwms", TF, "MultiWorkerMirroredStrategy", "tfdist.backends.mwms", "several",
            True, "collective", "nccl", "ring", keras2_synced_batch_norm=True,
            dials_hosts=True, launchable=True, job_name="mwms", job_launchers=("srun",)),
    Backend("horovod", TF, "Horovod", "tfdist.backends.horovod", "one", True,
            "horovod_controller", "", "", horovod=True, launchable=True, job_name="horovod",
            job_launchers=_HOROVOD_LAUNCHERS, several_gpus_instead="backend mwms"),
    Backend("mirrored", TF, "MirroredStrategy", "tfdist.backends.mirrored", "several", False,
            "", "", "", keras2_synced_batch_norm=True),
    Backend("single", TF, "TensorFlow's default strategy", "tfdist.backends.single", "one",
            False, "", "", "", several_gpus_instead="backend auto (MirroredStrategy)"),
    Backend("jax", JAX, "Keras DataParallel on JAX", "tfdist.backends.keras_jax", "several",
            True, "", "", "", job_name="jax", job_launchers=("srun",)),
    Backend("ddp", TORCH, "DistributedDataParallel", "tfdist.torch.ddp", "one", True,
            "torch_collective", "nccl", "gloo", job_name="torch",
            job_launchers=("torchrun", "srun"), job_sets_backend=False),
    Backend("horovod", TORCH, "Horovod", "tfdist.torch.horovod", "one", True,
            "horovod_controller", "", "", horovod=True, job_name="torch-horovod",
            job_launchers=_HOROVOD_LAUNCHERS),
    Backend("deepspeed", TORCH, "DeepSpeed", "tfdist.torch.deepspeed", "one", True,
            "torch_collective", "nccl", "gloo", job_name="torch-deepspeed",
            job_launchers=("torchrun", "srun")),
)


def names(framework: str) -> tuple[str, ...]:
    """The backend names of ``framework`` (``"tf"``, ``"torch"``, ``"jax"``), in the table's
    order."""
    return tuple(row.name for row in BACKENDS if row.framework == framework)


def backend(name: str, framework: str = TF) -> Backend:
    """The row of backend ``name`` under ``framework``.

    Raises:
        ConfigError: no such backend; the message lists the framework's.
    """
    for row in BACKENDS:
        if (row.name, row.framework) == (name, framework):
            return row
    raise ConfigError(f"backend {name!r} is not one of {framework}'s: "
                      f"{', '.join(names(framework))}")


def job_backend(job_name: str) -> Backend:
    """The row that ``tfdist job``'s ``backend`` key names (``mwms`` ... ``torch-deepspeed``).

    Raises:
        ConfigError: no such job backend.
    """
    for row in BACKENDS:
        if row.job_name and row.job_name == job_name:
            return row
    raise ConfigError(f"backend {job_name!r} is not one of tfdist job's: "
                      f"{', '.join(row.job_name for row in BACKENDS if row.job_name)}")
