"""Cluster environment detection: how were this process and its peers launched?

Pure: reads environment variables, imports no TensorFlow, runs no subprocess, caches nothing
(the environment is the input; tests patch it). The order is the one place that decides:

1. ``TF_CONFIG``: an explicit per-process cluster, written by ``tfdist launch`` or the user. It
   wins inside srun too, since an inner launcher's variables describe the process better than
   the allocation around it.
2. torchrun: its agent may itself run as an srun task (one per node); its ``RANK`` is the
   process's, Slurm's ``SLURM_PROCID`` is the agent's.
3. horovodrun / mpirun: they start processes inside a Slurm allocation, often through an srun
   step of their own daemons, whose ``SLURM_PROCID`` counts nodes, not processes.
4. Slurm: an srun step, one task per GPU. In the batch shell of a multi-task job it raises
   instead of training as one process.
5. Otherwise one plain process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tfdist.env import mpi, slurm, tf_config, torchrun
from tfdist.env.base import ClusterEnvironment, common

__all__ = ["ClusterEnvironment", "detect"]

_DETECTORS = (tf_config.detect, torchrun.detect, mpi.detect, slurm.detect)


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Detects how this process was launched.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        The first match in the order above, or a one-process environment.

    Raises:
        LaunchError: the launch cannot train correctly (e.g. the batch shell of a multi-task
            Slurm job), with the command that fixes it.
        ConfigError: a malformed variable, named in the message.
    """
    environ = os.environ if environ is None else environ
    for detector in _DETECTORS:
        found = detector(environ)
        if found is not None:
            return found
    return ClusterEnvironment(launcher="single", **common(environ),
                              reason="no launcher variables: one process")
