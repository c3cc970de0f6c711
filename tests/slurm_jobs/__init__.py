"""Rendered jobs on the Slurm test cluster: render a config, submit it with sbatch, collect.

The end-to-end tests (``tests/test_slurm_jobs.py``) go through ``tfdist job``'s renderer, as a
user would: a :class:`~tfdist.jobs.JobConfig` is rendered, saved next to the job's files and
submitted with sbatch; then the batch output and the per-task outputs (``task_output``, one file
per task) are read back::

    config = cluster_config(slurm_cluster, script=EXAMPLE, args=train_args(data_dir))
    job = run_rendered(slurm_cluster, config, timeout=240)
    assert job.ok, job.describe()
    weights = final_weights(job.task_outputs())   # {rank: (world size, digest)}

A Horovod or torchrun job is the same three lines with ``backend=``/``launcher=`` given to
:func:`cluster_config`. With ``mpirun`` or ``horovodrun`` there are no per-task files (srun's
``--output`` is not used): read :meth:`RenderedJob.all_output` instead.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import final_weights, tensorboard_logs
from slurmtest import JobResult, SlurmCluster, SlurmJobTimeoutError

from tfdist.jobs import JobConfig, check_output_dirs, render, save

__all__ = ["EXAMPLE", "HERE", "NODELIST", "RECORDING_PYTHON", "ROOT", "TASK_OUTPUT", "TWO_NODES",
           "RenderedJob", "check_saved_models", "cluster_config", "final_weights", "run_rendered",
           "saved_digest", "submit_rendered", "train_args"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EXAMPLE = ROOT / "examples" / "keras_train.py"
# Runs the real python after recording each task's view (see the script's header).
RECORDING_PYTHON = HERE / "recording-python"
# Other pytest sessions may share the cluster: the 2-node jobs name their nodes. Slurm's order
# is n9, n10; string order is n10, n9 (the stock resolver's host-order defect).
TWO_NODES = ("n9", "n10")
NODELIST = "--nodelist=n[9-10]"
TASK_OUTPUT = "%x-%j-%t.out"


def cluster_config(cluster: SlurmCluster, **keys: Any) -> JobConfig:
    """A :class:`JobConfig` for the test cluster; ``keys`` override or add to its defaults.

    Defaults: 2 nodes (n9, n10) with both fake GPUs each (one task per GPU), the cluster's
    partition and GPU type, per-task output files, the checkout's python, a 5-minute limit, no
    ``--cpu-bind`` (the cluster has no task plugin) and one TensorFlow thread per task (4 tasks
    share 2 cores). ``env`` is merged with the default one by name; paths may be ``Path``s.
    The job's doctor step stays where the test's subject is the rendered job as a user runs it
    (the MWMS, JAX and torch jobs, ``tfdist job --submit``); a job about something else passes
    ``doctor=False``: the step costs about 10 s a job, 20 under CI's load.
    """
    env = {"TFDIST_NUM_THREADS": "1", **keys.pop("env", {})}
    defaults: dict[str, Any] = {
        "job_name": "tfdist-test", "nodes": 2, "gpus_per_node": cluster.gpus_per_node,
        "gpu_type": cluster.gres_type, "partition": cluster.partition, "time": "00:05:00",
        "sbatch_args": [NODELIST], "task_output": TASK_OUTPUT, "python": cluster.python,
        "cpu_bind": None,
    }
    keys = {key: str(value) if isinstance(value, Path) else value for key, value in keys.items()}
    return JobConfig.from_mapping({**defaults, **keys, "env": env}, origin="the test")


def train_args(data_dir: Path | str, *extra: str, epochs: int = 2) -> list[str]:
    """examples/keras_train.py's arguments for a short run; the model goes to
    ``runs/${SLURM_JOB_ID}`` in the job's directory, as in ``jobscripts/configs/mwms.yaml``."""
    return [f"--epochs={epochs}", "--batch_size=64", "--scale_lr", f"--data_dir={data_dir}",
            "--model_dir=runs/${SLURM_JOB_ID}", *extra]


@dataclass(frozen=True)
class RenderedJob:
    """A rendered job that ran: its config, script, Slurm result and output files."""

    config: JobConfig
    script: Path
    result: JobResult

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def job_id(self) -> str:
        return self.result.job_id

    @property
    def workdir(self) -> Path:
        return self.result.workdir

    @property
    def model_dir(self) -> Path:
        """Where :func:`train_args` puts the model: ``runs/JOB_ID`` in the job's directory."""
        return self.workdir / "runs" / self.job_id

    def path(self, name: str) -> Path:
        """A file in the job's directory."""
        return self.workdir / name

    def task_files(self) -> dict[int, Path]:
        """Each task's output file (``task_output``), by rank; {} without per-task output."""
        return _task_files(self.config, self.job_id, self.workdir)

    def task_outputs(self) -> dict[int, str]:
        """Each task's output, by rank."""
        return {rank: path.read_text(errors="replace")
                for rank, path in self.task_files().items()}

    def all_output(self) -> str:
        """The batch output, then every task's output in rank order."""
        return "\n".join([self.result.output, *self.task_outputs().values()])

    def describe(self) -> str:
        """The job's state and batch output, then the end of each task's output."""
        return _describe(self.result.describe(), self.script, self.task_files())


def submit_rendered(cluster: SlurmCluster, config: JobConfig, *, text: str | None = None,
                    workdir: Path | None = None,
                    env: Mapping[str, str] | None = None) -> tuple[str, Path]:
    """Renders ``config`` (or takes ``text``, a changed rendering), saves it as
    ``JOB_NAME.sbatch`` in ``workdir`` (default: a fresh one) and submits it with sbatch from
    there, in the cluster's clean environment plus ``env``. Returns the job id and the script."""
    workdir = workdir or cluster.new_workdir()
    check_output_dirs(config, workdir)
    script = save(render(config) if text is None else text, workdir / f"{config.job_name}.sbatch")
    job_id = cluster.sbatch(script, env=cluster.job_env(**(env or {})), cwd=workdir)
    return job_id, script


def run_rendered(cluster: SlurmCluster, config: JobConfig, *, timeout: float,
                 text: str | None = None, workdir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> RenderedJob:
    """:func:`submit_rendered`, then waits at most ``timeout`` seconds for the job to end.

    Raises:
        SlurmJobTimeoutError: the job did not end in time; it is cancelled and the message
            holds the batch output and the end of every task's output.
    """
    job_id, script = submit_rendered(cluster, config, text=text, workdir=workdir, env=env)
    try:
        result = cluster.wait(job_id, timeout=timeout)
    except SlurmJobTimeoutError as err:
        tasks = _task_files(config, job_id, script.parent)
        raise SlurmJobTimeoutError(_describe(str(err), script, tasks)) from None
    return RenderedJob(config=config, script=script, result=result)


def _task_files(config: JobConfig, job_id: str, workdir: Path) -> dict[int, Path]:
    if config.task_output is None:
        return {}
    pattern = re.escape(config.task_output)
    for placeholder, value in (("%x", re.escape(config.job_name)), ("%j", job_id),
                               ("%t", r"(\d+)")):
        pattern = pattern.replace(re.escape(placeholder), value)
    if "%" in pattern.replace(r"(\d+)", ""):
        raise ValueError(f"task_output {config.task_output!r}: only %x, %j and %t are known here")
    files = {}
    for path in workdir.rglob("*"):
        match = re.fullmatch(pattern, str(path.relative_to(workdir)))
        if match and path.is_file():
            files[int(match.group(1))] = path
    return dict(sorted(files.items()))


def _describe(head: str, script: Path, tasks: Mapping[int, Path]) -> str:
    parts = [head, f"script: {script}"]
    for rank, path in tasks.items():
        text = path.read_text(errors="replace") if path.exists() else "(missing)"
        parts.append(f"--- task {rank} ({path.name}), last 1500 characters:\n{text[-1500:]}")
    if not tasks:
        parts.append("(no per-task output files)")
    return "\n".join(parts)


def check_saved_models(job: RenderedJob, digest: str, runs: int = 1,
                       python: str | Path | None = None) -> None:
    """The chief alone wrote ``checkpoint.keras`` and ``final.keras`` (atomically) and the
    TensorBoard logs (one chief process per run of a requeued job; none where ``python``, the
    ranks' Python, default this one, lacks tensorboard), and both models load in this process
    holding the ranks' final ``digest``."""
    saved = sorted(str(p.relative_to(job.workdir)) for p in job.workdir.rglob("*.keras"))
    model_dir = job.model_dir.relative_to(job.workdir)
    assert saved == [f"{model_dir}/checkpoint.keras", f"{model_dir}/final.keras"], \
        f"exactly one checkpoint and one final model, by the chief: {saved}\n{job.describe()}"
    partial = [p.name for p in job.model_dir.rglob(".partial-*")]
    assert not partial, f"unfinished checkpoint writes left: {partial}\n{job.describe()}"
    # events.out.tfevents.TIME.HOST.PID.N.v2: one writer per run, the chief, on the first node.
    names = sorted(p.name for p in (job.model_dir / "logs").rglob("events.out.tfevents.*"))
    writers = {tuple(name.split(".")[4:6]) for name in names}
    chiefs = {TWO_NODES[0]} if tensorboard_logs(python) else set()
    assert len(writers) == len(chiefs) * runs and {host for host, _ in writers} == chiefs, \
        f"TensorBoard files by {len(writers)} processes in {runs} run(s): {names}\n" \
        f"{job.describe()}"
    for name in ("checkpoint.keras", "final.keras"):
        path = job.model_dir / name
        assert zipfile.is_zipfile(path), f"{name} is not a .keras (zip) file\n{job.describe()}"
        try:
            loaded = saved_digest(path)
        except Exception as err:  # any failure to load is the finding
            pytest.fail(f"{name} does not load: {type(err).__name__}: {err}\n{job.describe()}")
        assert loaded == digest, \
            f"{name} holds weights {loaded}, not the ranks' final {digest}\n{job.describe()}"


def saved_digest(path: Path) -> str:
    """Loads a .keras file in this process and returns the digest the examples print."""
    import tensorflow as tf

    import tfdist.sync

    model = tf.keras.models.load_model(path, compile=False)
    digest: str = tfdist.sync.digest(tfdist.sync.model_variables(model))
    return digest
