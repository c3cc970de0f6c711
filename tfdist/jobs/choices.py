"""The values a job's ``kind``, ``backend``, ``launcher`` and ``runtime`` may take, and which
combine: shared by the config (:mod:`tfdist.jobs.config`) and its checks
(:mod:`tfdist.jobs.checks`), so that neither imports the other for them."""

from __future__ import annotations

__all__ = ["BACKENDS", "BACKEND_LAUNCHERS", "ENGINES", "KINDS", "LAUNCHERS", "RUNTIMES",
           "RUNTIME_LAUNCHERS", "TORCH_BACKENDS"]

# train: one training run; scaling: the same training on 1..nodes nodes, one srun step each,
# and the report of `tfdist scaling`; build-venv: a venv built on a compute node.
KINDS = ("train", "build-venv", "scaling")
BACKENDS = ("mwms", "horovod", "torch", "torch-horovod", "torch-deepspeed")
# The PyTorch backends (tfdist.torch), and the engine each backend's TFDIST_BACKEND names.
TORCH_BACKENDS = ("torch", "torch-horovod", "torch-deepspeed")
ENGINES = {"mwms": "mwms", "horovod": "horovod", "torch": "ddp", "torch-horovod": "horovod",
           "torch-deepspeed": "deepspeed"}
LAUNCHERS = ("srun", "mpirun", "horovodrun", "torchrun")
RUNTIMES = ("venv", "apptainer", "enroot")

# The launchers that can start each backend; the first is its default.
BACKEND_LAUNCHERS: dict[str, tuple[str, ...]] = {
    # TensorFlow's workers take their address table from the srun step (tfdist.env.slurm);
    # mpirun and horovodrun give no per-rank addresses.
    "mwms": ("srun",),
    "horovod": ("srun", "mpirun", "horovodrun"),
    # tfdist.torch reads torchrun's store, or derives a rendezvous from the srun step.
    "torch": ("torchrun", "srun"),
    "torch-horovod": ("srun", "mpirun", "horovodrun"),
    "torch-deepspeed": ("torchrun", "srun"),
}
# The launchers that can run inside each runtime.
RUNTIME_LAUNCHERS: dict[str, tuple[str, ...]] = {
    "venv": LAUNCHERS,
    # horovodrun starts remote ranks over ssh, outside any container srun or mpirun started.
    "apptainer": ("srun", "mpirun", "torchrun"),
    # pyxis adds --container-image and --container-mounts to srun only.
    "enroot": ("srun", "torchrun"),
}
