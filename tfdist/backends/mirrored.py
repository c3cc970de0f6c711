"""One process driving several devices: MirroredStrategy, one replica per GPU.

Chosen by ``auto`` for one plain process that sees more than one GPU (an interactive ``salloc``
on a 4-GPU node, a job with one task): TensorFlow's default strategy would train on the first
GPU and leave the others idle without a word. ``backend="single"`` keeps that on request;
``backend="mirrored"`` asks for this one. The all-reduce is NCCL where TensorFlow has it, else
TensorFlow's copy to one device (``MirroredStrategy`` picks). ``TFDIST_CPU_REPLICAS=N`` splits
the CPU into N logical devices instead: the same code paths without GPUs.
"""

from __future__ import annotations

import logging
from typing import Any

from tfdist import devices, quiet
from tfdist.backends.base import Distributed, Settings, configure_threads, split_cpu, too_late
from tfdist.backends.single import SingleDistributed
from tfdist.env import ClusterEnvironment

__all__ = ["MirroredDistributed", "create", "local_devices"]

logger = logging.getLogger("tfdist")


class MirroredDistributed(SingleDistributed):
    """The handle for one process (rank 0 of 1) with MirroredStrategy over its devices."""

    backend = "mirrored"

    @property
    def local_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)


def local_devices(tf: Any, cpu_replicas: int | None) -> tuple[list[str], str]:
    """The devices one process trains on, and their kind (``"GPU"`` or ``"CPU"``): every
    visible GPU, else ``cpu_replicas`` logical CPUs (configured here, before the runtime
    starts), else the CPU."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(len(gpus))], "GPU"
    if cpu_replicas and cpu_replicas > 1:
        return split_cpu(tf, cpu_replicas), "CPU"
    return ["/cpu:0"], "CPU"


def create(environment: ClusterEnvironment, settings: Settings) -> Distributed:
    """MirroredStrategy over this process's devices; with one device (and ``auto``), the
    single-process handle instead."""
    devices.narrow_visible_gpus(environment)
    tf = quiet.import_tensorflow()
    try:
        found, kind = local_devices(tf, settings["cpu_replicas"])
    except RuntimeError as error:  # the logical CPUs come too late: the runtime started
        if "initialized" not in str(error):
            raise
        raise too_late(environment) from None
    if len(found) == 1 and settings["backend"] == "auto":
        from tfdist.backends import single

        return single.create(environment, settings)
    configure_threads(settings["threads"])
    strategy = tf.distribute.MirroredStrategy(devices=found)
    collective = "nccl" if kind == "GPU" and _nccl(strategy) else "local"
    logger.info("tfdist: MirroredStrategy over %d %s device(s) of one process (%s all-reduce)",
                len(found), kind, collective)
    return MirroredDistributed(environment, strategy, collective,
                               len(found) if kind == "GPU" else 0)


def _nccl(strategy: Any) -> bool:
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return type(ops).__name__ == "NcclAllReduce"
