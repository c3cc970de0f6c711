"""Horovod end to end on the Slurm test cluster: rendered Horovod jobs, submitted with sbatch.

Each test renders a :class:`~tfdist.jobs.JobConfig` with ``backend="horovod"`` (the renderer
users get from ``tfdist job``), submits it to the test cluster (``slurm_cluster``,
tests/slurmtest.py) on n9 and n10, 2 tasks each (one per fake GPU) where the test is about where
the ranks go (mpirun's mapping, the torch job), else one (half the TensorFlow processes on the
machine's 2 cores), and checks what
examples/keras_train.py produced: every rank's final-weights digest (all equal), the chief's
accuracy and backend line, and the chief's one checkpoint and final model, loaded in this process.
The ranks run in .venv-horovod/ (TensorFlow 2.18.1, Keras 3.15, Horovod 0.28.1 with Gloo and
MPI); the fake GPUs are no CUDA devices, so Horovod reduces on the CPU.

Launches, as rendered:

- srun, Gloo: with ``TFDIST_HOROVOD_CONTROLLER=gloo`` the renderer leaves out ``--mpi=pmix``;
  and the MPI line with a later ``--mpi=none`` and tfdist's ``auto`` (no PMI, so Gloo): tfdist's
  rank 0 serves Horovod's Gloo rendezvous on the step's derived port, the other ranks dial it
  across the nodes.
- srun, MPI: ``srun --mpi=pmix`` as it is: PMIx sets ``PMIX_RANK``, so tfdist's ``auto`` picks
  Horovod's MPI controller and Open MPI initialises from Slurm's PMIx server (the cluster gives
  each node its own ``TmpFS``, which pmix needs when nodes share a filesystem).
- Open MPI's ``mpirun`` in the batch shell, with no Open MPI settings: it starts its daemon on
  the second node through Slurm, and the ranks connect over TCP.
- horovodrun in the batch shell, on one node: as rendered (this MPI build: horovodrun runs
  mpirun) and with ``--gloo``.
- The control: the Gloo job again with tfdist's gradient averaging taken out (nothing else
  changes): the ranks end with different digests, so equal digests do prove averaging.

Not tested: multi-node ``horovodrun``. Before it starts anything, in Gloo and in MPI mode, it
checks that it can ssh into every other host, and the cluster's nodes run no ssh server (the
job fails with "could not connect to some hosts via ssh").

The srun and mpirun jobs' ``python`` is a wrapper written in the job's directory: it prints its
node and its rank as the launcher numbered it, then execs .venv-horovod's python. The horovodrun
jobs activate .venv-horovod instead (``venv``), which puts horovodrun on PATH.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from helpers import EXAMPLE_NEEDS, HOROVOD_PYTHON, full_matrix_only, horovod_facts, require
from slurm_jobs import (
    EXAMPLE,
    ROOT,
    TWO_NODES,
    RenderedJob,
    check_saved_models,
    cluster_config,
    final_weights,
    run_rendered,
    train_args,
)
from slurmtest import SlurmCluster

from tfdist.jobs import render

WORLD = 4  # 2 nodes x 2 fake GPUs
GPUS_PER_NODE = 2
HVD_PYTHON = HOROVOD_PYTHON
# A 2-epoch run of 4 ranks on the machine's 2 shared cores: about 30-60 s, start-up included.
JOB_TIMEOUT = 180
MIN_ACCURACY = 0.5  # 10 classes: chance is 0.1; 2 epochs reach about 0.9
_ACCURACY = re.compile(r"^test loss (\S+)\s+test accuracy (\S+)\s", re.M)
_HOST = re.compile(r"^host-python: rank (\d+) on (\S+)$", re.M)
_TAG = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:")
# Block distribution in Slurm's node order: ranks 0-1 on n9, 2-3 on n10.
RANK_HOSTS = {rank: TWO_NODES[rank // GPUS_PER_NODE] for rank in range(WORLD)}
# The srun jobs about the controller rather than the layout: one task (one fake GPU) per node.
ONE_PER_NODE = {"gpus_per_node": 1}
SMALL_WORLD = 2
SMALL_HOSTS = dict(enumerate(TWO_NODES))


def _horovod_problem() -> str | None:
    """Why .venv-horovod cannot run these jobs, or None."""
    facts = horovod_facts()
    if facts["missing"]:
        return str(facts["missing"])
    if facts["tensorflow"]:
        return f"horovod.tensorflow does not import in .venv-horovod: {facts['tensorflow']}"
    if not (facts["gloo"] and facts["mpi"]):
        return (f"Horovod in .venv-horovod lacks Gloo or MPI (gloo, mpi: {facts['gloo']}, "
                f"{facts['mpi']})")
    return None


_PROBLEM = _horovod_problem()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


@pytest.fixture(scope="module")
def data_dir(slurm_cluster: SlurmCluster) -> Path:
    """One tensorflow-datasets directory for the module's jobs: the first task to need the
    digits writes them (under a lock), the rest read them."""
    return slurm_cluster.new_workdir()


def host_python(workdir: Path) -> Path:
    """A job ``python`` that prints its node and launcher rank, then execs .venv-horovod's."""
    path = workdir / "host-python"
    path.write_text("#!/bin/bash\n"
                    'echo "host-python: rank ${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:?}} on '
                    '$(hostname)"\n'
                    f'exec {shlex.quote(str(HVD_PYTHON))} "$@"\n')
    path.chmod(0o755)
    return path


def horovod_job(cluster: SlurmCluster, data_dir: Path, *, workdir: Path | None = None,
                script: Path = EXAMPLE, script_args: tuple[str, ...] = (),
                **keys: Any) -> tuple[RenderedJob, str]:
    """Renders a Horovod job of examples/keras_train.py (by default for n9 and n10, 2 fake GPUs
    each) and runs it; returns it and its rendering. ``keys`` go to :func:`cluster_config`;
    without a ``venv``, ``python`` is the :func:`host_python` wrapper."""
    require(*EXAMPLE_NEEDS["keras_train.py"], python=HVD_PYTHON)  # the control runs it too
    workdir = workdir or cluster.new_workdir()
    # The doctor's step would run the wrapper and Horovod's start-up once more: the checks
    # below count their lines. The MWMS jobs of test_slurm_jobs.py run the doctor.
    keys.setdefault("doctor", False)
    if "venv" not in keys:
        keys["python"] = host_python(workdir)
    config = cluster_config(cluster, backend="horovod", script=script,
                            args=[*script_args, *train_args(data_dir)], **keys)
    text = render(config)
    assert f"#SBATCH --gpus-per-node={cluster.gres_type}:{config.gpus_per_node}" in text, text
    assert "\nexport TFDIST_BACKEND=horovod\n" in text, text
    return run_rendered(cluster, config, workdir=workdir, timeout=JOB_TIMEOUT), text


def rank_hosts(job: RenderedJob, output: str, world: int) -> dict[int, str]:
    """Each rank's node, as the wrapper printed it (rank as the launcher numbered it)."""
    found = _HOST.findall(output)
    hosts = {int(rank): host for rank, host in found}
    assert len(found) == world and sorted(hosts) == list(range(world)), \
        f"one host line per rank expected: {found}\n{job.describe()}"
    return hosts


def untagged(text: str) -> str:
    """``text`` without the ``[1,0]<stdout>:`` tags of ``mpirun --tag-output`` (horovodrun)."""
    return _TAG.sub("", text)


def check_training(job: RenderedJob, *, collective: str, launched_by: str, world: int = WORLD,
                   hosts: dict[int, str] | None = RANK_HOSTS) -> str:
    """Checks a finished Horovod training job of examples/keras_train.py on ``world`` ranks.

    Every rank reports the same final-weights digest, after the replica sync check passed;
    each rank ran on its node of ``hosts`` (None: not checked); the chief alone reports the
    backend (horovod with ``collective``), how it was launched and the test accuracy; the model
    directory holds exactly one final.keras and one checkpoint.keras, both loadable here with
    the ranks' final weights; the chief alone wrote TensorBoard logs.

    Returns:
        The digest of the final weights.
    """
    assert job.ok, job.describe()
    output = untagged(job.all_output())
    weights = final_weights([output])
    assert sorted(weights) == list(range(world)), \
        f"final-weights lines of ranks {sorted(weights)}, not 0-{world - 1}\n{job.describe()}"
    digests = {digest for _, digest in weights.values()}
    assert {size for size, _ in weights.values()} == {world} and len(digests) == 1, \
        f"ranks ended with different weights: {weights}\n{job.describe()}"
    synced = f"replica sync check passed at step 1: 8 variables identical on {world} replicas"
    assert synced in output, job.describe()
    if hosts is not None:
        assert rank_hosts(job, output, world) == hosts, f"ranks by node\n{job.describe()}"

    started = re.findall(rf"tfdist: Horovod \S+, {world} processes, {collective} controller, "
                         rf".*; launched by {re.escape(launched_by)}", output)
    assert len(started) == 1, \
        f"the chief's log: {collective} controller, launched by {launched_by}\n{job.describe()}"
    backend = (f"tfdist: {world} worker(s), {world} replica(s), backend horovod, "
               f"collective {collective}")
    assert output.count(backend) == 1, f"the chief's line {backend!r}\n{job.describe()}"
    accuracy = _ACCURACY.findall(output)
    assert len(accuracy) == 1 and float(accuracy[0][1]) > MIN_ACCURACY, \
        f"one test accuracy line, from the chief, over {MIN_ACCURACY}: {accuracy}\n" \
        f"{job.describe()}"
    outputs = job.task_outputs()
    if outputs:  # srun: each rank's lines are in its own task's file, the chief's in task 0's
        for rank, text in outputs.items():
            assert final_weights([text]).keys() == {rank}, \
                f"rank {rank}'s file must hold its own final-weights line\n{job.describe()}"
        assert backend in outputs[0] and _ACCURACY.search(outputs[0]), job.describe()

    (digest,) = digests
    # .keras files written by Keras 3.15 in .venv-horovod load in this process's TF 2.21.
    check_saved_models(job, digest, python=HVD_PYTHON)
    return digest


def srun_line(text: str) -> str:
    """The rendered launch line (with its continuation lines)."""
    match = re.search(r"^srun (?:[^\n]*\\\n)*[^\n]*", text, re.M)
    assert match, text
    return match.group(0)


# --- srun, Gloo: tfdist starts Horovod's rendezvous -------------------------------------------

GLOO = {"TFDIST_HOROVOD_CONTROLLER": "gloo"}


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(("env", "launcher_args"), [
    pytest.param(GLOO, (), id="forced", marks=full_matrix_only(
        "srun's Gloo rendezvous runs auto-without-pmi, and test_jobs.py renders the forced "
        "job")), pytest.param({}, ("--mpi=none",), id="auto-without-pmi")])
def test_srun_gloo_job_trains_in_sync_and_chief_saves_once(
        slurm_cluster: SlurmCluster, data_dir: Path, env: dict[str, str],
        launcher_args: tuple[str, ...]) -> None:
    # forced: TFDIST_HOROVOD_CONTROLLER=gloo, and the renderer asks srun for no PMIx.
    # auto-without-pmi: the MPI line (--mpi=pmix) with a later --mpi=none (srun takes the
    # last) starts no PMI, so no PMIX_RANK, and tfdist's auto picks Gloo for this MPI build.
    # Either way rank 0 (on n9) serves Horovod's rendezvous on the step's derived port and
    # rank 1 (on n10) dials it.
    job, text = horovod_job(slurm_cluster, data_dir, job_name="hvd-srun-gloo", env=env,
                            launcher_args=list(launcher_args), **ONE_PER_NODE)
    line = srun_line(text)
    assert ("--mpi=pmix" in line) == (not env), text
    assert all(arg in line for arg in launcher_args), text
    check_training(job, collective="gloo", launched_by=f"srun step {job.job_id}.0",
                   world=SMALL_WORLD, hosts=SMALL_HOSTS)


NO_AVERAGING_LINE = "control: tfdist's gradient averaging is off"
NO_AVERAGING = f"""\
# The control: runs the script given as the first argument with tfdist's Horovod gradient
# averaging made a no-op.
import runpy
import sys

import tfdist.horovod.fit

tfdist.horovod.fit.DistributedOptimizer = lambda optimizer: optimizer
print({NO_AVERAGING_LINE!r}, flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_srun_gloo_control_without_averaging_ends_with_different_weights(
        slurm_cluster: SlurmCluster, data_dir: Path) -> None:
    # The control for the digests above: the same rendered job and launch, with the one change
    # that tfdist's gradient averaging is taken out (its DistributedOptimizer made a no-op, so
    # compile leaves the optimizer as it is). Horovod still starts, broadcasts rank 0's initial
    # state and shards the data: each rank then trains on its own shard alone, and the ranks
    # must end different. TFDIST_SYNC_CHECK=0 because tfdist's replica sync check would stop
    # the job at step 1 (it compares the ranks' weights: that is its purpose).
    workdir = slurm_cluster.new_workdir()
    control = workdir / "no_averaging.py"
    control.write_text(NO_AVERAGING)
    job, _ = horovod_job(slurm_cluster, data_dir, workdir=workdir, job_name="hvd-control",
                         script=control, script_args=(str(EXAMPLE),),
                         env={**GLOO, "TFDIST_SYNC_CHECK": "0"}, **ONE_PER_NODE)
    assert job.ok, job.describe()
    output = job.all_output()
    world = SMALL_WORLD
    assert output.count(NO_AVERAGING_LINE) == world, job.describe()
    assert output.count(f"tfdist: {world} worker(s), {world} replica(s), backend horovod, "
                        "collective gloo") == 1, job.describe()
    weights = final_weights(job.task_outputs())
    assert sorted(weights) == list(range(world)), job.describe()
    assert len({digest for _, digest in weights.values()}) == world, \
        f"without averaging every rank must end with its own weights: {weights}\n" \
        f"{job.describe()}"


# --- srun --mpi=pmix, MPI: Open MPI initialises from Slurm's PMIx -----------------------------

# A clean-clone run (2026-11-27) had task 0 die of a segfault inside MPI_Init (hvd.init), once in
# many runs, not again in 3 alone. The test cluster's nodes share one kernel, and so its shared
# memory: PMIx's shared-memory datastore (gds ds21) is the likely part (occasional segfaults in
# its locks: openpmix#1114; the hash datastore is the usual way around, ompi#12495). The jobs
# here use the hash datastore; a real node has its own.
PMIX_ENV = {"PMIX_MCA_gds": "hash"}

@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_srun_pmix_mpi_job_trains_in_sync_and_chief_saves_once(slurm_cluster: SlurmCluster,
                                                               data_dir: Path) -> None:
    # As rendered: PMIx sets PMIX_RANK in each task, so tfdist's auto picks Horovod's MPI.
    job, text = horovod_job(slurm_cluster, data_dir, job_name="hvd-srun-mpi", env=PMIX_ENV,
                            **ONE_PER_NODE)
    assert "--mpi=pmix" in srun_line(text) and "TFDIST_HOROVOD_CONTROLLER" not in text, text
    check_training(job, collective="mpi", launched_by=f"srun step {job.job_id}.0",
                   world=SMALL_WORLD, hosts=SMALL_HOSTS)


# --- mpirun in the batch shell ----------------------------------------------------------------

@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_mpirun_job_trains_in_sync_and_chief_saves_once(slurm_cluster: SlurmCluster,
                                                        data_dir: Path) -> None:
    # As rendered, with no Open MPI settings: mpirun starts its daemon on n10 through Slurm
    # (Open MPI's plm/slurm runs `srun --ntasks-per-node=1 ... --nodelist=n10 orted`; the
    # nodes run no ssh server), and the ranks connect over TCP on the cluster's bridge.
    job, text = horovod_job(slurm_cluster, data_dir, job_name="hvd-mpirun", launcher="mpirun",
                            task_output=None)
    assert 'mpirun -np "$SLURM_NTASKS" --map-by "ppr:${SLURM_NTASKS_PER_NODE}:node"' in text, \
        text
    assert "OMPI_MCA" not in text, text
    check_training(job, collective="mpi", launched_by="mpirun (OMPI_COMM_WORLD_RANK=0")


# --- horovodrun in the batch shell, one node --------------------------------------------------

@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(("launcher_args", "collective", "launched_by"), [
    pytest.param((), "mpi", "mpirun (OMPI_COMM_WORLD_RANK=0", id="default-mpi"),
    pytest.param(("--gloo",), "gloo", "horovodrun (", id="gloo", marks=full_matrix_only(
        "the job's horovodrun line runs default-mpi, and horovodrun --gloo runs in "
        "test_horovod.py"))])
def test_horovodrun_job_on_one_node_trains_in_sync(
        slurm_cluster: SlurmCluster, data_dir: Path, launcher_args: tuple[str, ...],
        collective: str, launched_by: str) -> None:
    # One node only: horovodrun reaches every other host over ssh (in both modes it first checks
    # ssh to each remote host), and the cluster's nodes run no ssh server. horovodrun must be on
    # PATH, so the job activates .venv-horovod (venv) instead of naming its python. Without
    # --gloo, horovodrun of an MPI build runs mpirun itself.
    job, text = horovod_job(slurm_cluster, data_dir, job_name="hvd-horovodrun",
                            launcher="horovodrun", launcher_args=list(launcher_args),
                            venv=str(HVD_PYTHON.parent.parent), python=None, nodes=1,
                            sbatch_args=[f"--nodelist={TWO_NODES[0]}"], task_output=None)
    assert 'horovodrun -np "$SLURM_NTASKS" -H "$hosts"' in text, text
    check_training(job, collective=collective, launched_by=launched_by, world=GPUS_PER_NODE,
                   hosts=None)




# --- PyTorch with Horovod (backend torch-horovod) ----------------------------------------------

TORCH_EXAMPLE = ROOT / "examples" / "torch_train.py"


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@full_matrix_only("torch's Horovod backend trains under tfdist launch (test_torch_backends.py), "
                  "and Horovod meets over srun --mpi=pmix in the TensorFlow job here")
def test_torch_horovod_job_over_srun_mpi_trains_in_sync(slurm_cluster: SlurmCluster,
                                                        data_dir: Path) -> None:
    # examples/torch_train.py as `tfdist job --backend torch-horovod` renders it: horovod.torch
    # (compiled with PyTorch in .venv-horovod) under srun --mpi=pmix, MPI from Slurm's PMIx. The
    # ranks' data shards differ, so equal digests need the averaging (the loopback control in
    # tests/test_torch_backends.py shows the ranks differ without it).
    require(*EXAMPLE_NEEDS["torch_train.py"], python=HVD_PYTHON)
    workdir = slurm_cluster.new_workdir()
    config = cluster_config(slurm_cluster, backend="torch-horovod", job_name="torch-hvd",
                            script=TORCH_EXAMPLE, args=train_args(data_dir), doctor=False,
                            python=host_python(workdir), env=PMIX_ENV)
    text = render(config)
    assert "\nexport TFDIST_BACKEND=horovod\n" in text and "--mpi=pmix" in srun_line(text), text
    job = run_rendered(slurm_cluster, config, workdir=workdir, timeout=JOB_TIMEOUT)
    assert job.ok, job.describe()
    output = job.all_output()
    weights = final_weights([output])
    assert sorted(weights) == list(range(WORLD)), job.describe()
    assert len({digest for _, digest in weights.values()}) == 1, \
        f"ranks ended with different weights: {weights}\n{job.describe()}"
    assert rank_hosts(job, output, WORLD) == RANK_HOSTS, job.describe()
    line = f"tfdist: {WORLD} worker(s), {WORLD} replica(s), backend horovod, collective mpi"
    assert output.count(line) == 1, f"the chief's line {line!r}\n{job.describe()}"
    accuracy = _ACCURACY.findall(output)
    assert len(accuracy) == 1 and float(accuracy[0][1]) > MIN_ACCURACY, job.describe()
