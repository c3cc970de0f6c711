"""A Slurm cluster resolver for tf.distribute that fixes the stock one's defects.

``tf.distribute.cluster_resolver.SlurmClusterResolver`` (TF 2.21) is fragile on real clusters;
``tests/test_resolver.py`` shows each defect on the stock resolver. This resolver reads tfdist's
pure Slurm detection instead:

1. no ``nvidia-smi`` call: GPUs come from Slurm's ``CUDA_VISIBLE_DEVICES`` (or are counted by
   TensorFlow when Slurm sets none, see :mod:`tfdist.devices`);
2. CPU-only steps and 3. per-task GPU binding (``--gpus-per-task``) are ordinary cases;
4. hosts keep Slurm's node order (n9 before n10), never string-sorted;
5. physical GPU ids (``CUDA_VISIBLE_DEVICES=2,3``) are kept, each local task gets its own;
6. every hostlist form Slurm accepts is expanded (``n[1-2]-ib``, ``rack[1-2]-n[01-02]``);
7. in the batch shell it says to use srun instead of failing with a bare RuntimeError;
8. ports derive from the job and step id (``TFDIST_PORT_BASE`` overrides);
9. block, cyclic and plane distributions are laid out as Slurm does, and
   ``TFDIST_HOST_TEMPLATE`` (e.g. ``{host}-ib0``) picks the interface name to dial.

The resolver never mutates ``os.environ``: :mod:`tfdist.devices` chooses the GPUs and applies the
choice once, before TensorFlow starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tensorflow.python.distribute.cluster_resolver.cluster_resolver import ClusterResolver
from tensorflow.python.training.server_lib import ClusterSpec

from tfdist import devices
from tfdist.env import slurm
from tfdist.env.base import ClusterEnvironment
from tfdist.errors import LaunchError

__all__ = ["SlurmClusterResolver"]

class SlurmClusterResolver(ClusterResolver):
    """Cluster resolver for one srun task per GPU (or per CPU worker), in Slurm's order.

    Args:
        environment: a detected Slurm environment; read from ``environ`` when None.
        num_gpus: GPUs this task uses; derived from ``CUDA_VISIBLE_DEVICES`` when None.
        environ: variables to read instead of ``os.environ`` (tests).
        rpc_layer: the protocol TensorFlow's servers speak.

    Raises:
        LaunchError: not inside an srun step (e.g. the batch shell), with the srun command.
    """

    def __init__(self, environment: ClusterEnvironment | None = None, *,
                 num_gpus: int | None = None, environ: Mapping[str, str] | None = None,
                 rpc_layer: str = "grpc") -> None:
        environ = os.environ if environ is None else environ
        if environment is None:
            environment = slurm.detect(environ)
        if environment is None or not environment.facts.slurm_addresses:
            missing = [name for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")
                       if name not in environ]
            raise LaunchError(f"SlurmClusterResolver needs an srun step ({' and '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} not set): start the "
                              "script with `srun python train.py` inside a Slurm job, one task "
                              "per GPU")
        self._env = environment
        if num_gpus is None:
            num_gpus = devices.count(devices.select_gpus(
                environment.visible_devices, environment.local_rank,
                environment.local_world_size, environment.gpus_per_task is not None)) or 0
        self._num_gpus = num_gpus
        self.task_type = "worker"
        self.task_id = environment.rank
        self.rpc_layer = rpc_layer

    @property
    def environment_info(self) -> ClusterEnvironment:
        return self._env

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec({"worker": list(self._env.worker_addresses)})

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task, ``grpc://HOST:PORT``; this task's by default.

        Raises:
            ValueError: no such job (there is only ``worker``) or task index.
        """
        address = self.cluster_spec().task_address(
            task_type or self.task_type, self.task_id if task_id is None else task_id)
        protocol = rpc_layer or self.rpc_layer
        return f"{protocol}://{address}" if protocol else address

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: object = None) -> dict[str, int]:
        return {"GPU": self._num_gpus} if self._num_gpus else {}

    @property
    def environment(self) -> str:
        return ""
