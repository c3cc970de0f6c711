"""The values a job's ``kind``, ``backend``, ``launcher`` and ``runtime`` may take, and which
combine: shared by the config (:mod:`tfdist.jobs.config`) and its checks
(:mod:`tfdist.jobs.checks`), so that neither imports the other for them."""

from __future__ import annotations

from tfdist.backend_facts import BACKENDS as _FACTS

__all__ = ["BACKENDS", "BACKEND_LAUNCHERS", "ENGINES", "KINDS", "LAUNCHERS", "RUNTIMES",
           "RUNTIME_LAUNCHERS", "TORCH_BACKENDS"]

# train: one training run; scaling: the same training on 1..nodes nodes, one srun step each,
# and the report of `tfdist scaling`; build-venv: a venv built on a compute node.
KINDS = ("train", "build-venv", "scaling")
# The backends of tfdist.backend_facts that have a job script, under their job names; the
# engine each one's TFDIST_BACKEND names; the PyTorch ones (tfdist.torch).
BACKENDS = tuple(row.job_name for row in _FACTS if row.job_name)
ENGINES = {row.job_name: row.name for row in _FACTS if row.job_name}
TORCH_BACKENDS = tuple(row.job_name for row in _FACTS if row.job_name and row.framework == "torch")
LAUNCHERS = ("srun", "mpirun", "horovodrun", "torchrun")
RUNTIMES = ("venv", "apptainer", "enroot")

# The launchers that can start each backend; the first is its default (the facts' reasons).
BACKEND_LAUNCHERS: dict[str, tuple[str, ...]] = {
    row.job_name: row.job_launchers for row in _FACTS if row.job_name}
# The launchers that can run inside each runtime.
RUNTIME_LAUNCHERS: dict[str, tuple[str, ...]] = {
    "venv": LAUNCHERS,
    # horovodrun starts remote ranks over ssh, outside any container srun or mpirun started.
    "apptainer": ("srun", "mpirun", "torchrun"),
    # pyxis adds --container-image and --container-mounts to srun only.
    "enroot": ("srun", "torchrun"),
}
