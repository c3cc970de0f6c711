"""PyTorch DDP end to end on the Slurm test cluster: rendered torch jobs, submitted with sbatch.

Each test renders a :class:`~tfdist.jobs.JobConfig` with ``backend="torch"`` (the renderer users
get from ``tfdist job``), submits it to the test cluster (``slurm_cluster``, tests/slurmtest.py)
on n9 and n10 with 2 fake GPUs each, and checks what the job produced. The fake GPUs are not
CUDA devices, so every rank trains on the CPU with gloo: what is tested is the launch, the
rendezvous across two nodes and the synchronisation, not NCCL.

- torchrun: one srun task per node runs torchrun with ``--nproc-per-node`` = the node's GPUs (2)
  and each task's shell passes ``--node-rank=$SLURM_NODEID``, so the agents meet on the first
  node at the port derived from the job id and rank the nodes in Slurm's order.
  examples/torch_train.py trains on 4 ranks: every rank prints the same final-weights digest,
  the chief reaches the accuracy and writes one final.pt holding those weights, and ranks 0-1
  run on n9 (torchrun's c10d rendezvous would have put them on n10: it sorts nodes by name).
- The control: the same rendered torchrun job runs tests/workers/torch_worker.py, which saves
  each rank's weights. In its ``dist`` mode (DDP, each rank starting from different weights)
  the 4 ranks end identical; in its ``control`` mode (the same steps from the same weights,
  without DDP) they end different: comparing the ranks' weights does catch a missing DDP.
- srun directly: one srun task per fake GPU and no torchrun; tfdist.torch reads the step's
  ``SLURM_*`` variables and meets on the first node at the port derived from the job and step.
- DeepSpeed under srun (``backend: torch-deepspeed``, ``launcher: srun``): the same example
  with ``TFDIST_BACKEND=deepspeed`` from the rendered script, DeepSpeed's engine (ZeRO stage 2,
  on the CPU over gloo) over tfdist's process group; its 4 ranks end identical, within 1e-5 of
  the DDP srun job's weights (ZeRO's reduce-scatter adds the 4 ranks' gradients in another
  order than DDP's all-reduce: the two differ by rounding, about 6e-7 at most), and far from
  the weights both started from.

Each job's ``python`` is a small wrapper written in the job's directory: it prints the node its
srun task runs on, then runs the checkout's python. A rank's lines land in the output file of
the srun task that started it (torchrun starts its ranks as local child processes), so each
file says on which node its ranks ran.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import EXAMPLE_NEEDS, full_matrix_only, require
from slurm_jobs import ROOT, TWO_NODES, RenderedJob, cluster_config, final_weights, run_rendered
from slurmtest import SlurmCluster

from tfdist.env.slurm import port_base
from tfdist.jobs import render

# The jobs run this process's python, which must have torch; final.pt is loaded here.
torch = pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")

WORLD = 4  # 2 nodes x 2 fake GPUs
GPUS_PER_NODE = 2
# A 2-epoch run of 4 ranks on the machine's 2 shared cores takes about 20-30 s, start-up included.
JOB_TIMEOUT = 150
MIN_ACCURACY = 0.8  # 10 classes: chance is 0.1
TORCH_EXAMPLE = ROOT / "examples" / "torch_train.py"
WORKER = ROOT / "tests" / "workers" / "torch_worker.py"
_ACCURACY = re.compile(r"^test loss (\S+)\s+test accuracy (\S+)\s", re.M)
_HOST = re.compile(r"^host-python: task (\d+) on (\S+)$", re.M)
# torchrun's agent (LOGLEVEL=INFO) logs the result of its rendezvous: its own rank among the
# agents (group_rank) and the ranks of its processes (global_ranks), a line each.
_GROUP_RANK = re.compile(r"\]\s+group_rank=(\d+)$", re.M)
_GLOBAL_RANKS = re.compile(r"\]\s+global_ranks=\[([\d, ]*)\]$", re.M)


def example_args() -> list[str]:
    """A short run of examples/torch_train.py; the model goes to ``runs/${SLURM_JOB_ID}``.
    ``--verbosity=0`` (absl's) lets the chief log where its process group met."""
    return ["--epochs=2", "--batch_size=64", "--scale_lr", "--model_dir=runs/${SLURM_JOB_ID}",
            "--verbosity=0"]


def host_python(cluster: SlurmCluster, workdir: Path) -> Path:
    """A job ``python`` that prints its srun task's node, then execs the checkout's python."""
    path = workdir / "host-python"
    path.write_text("#!/bin/bash\n"
                    'echo "host-python: task ${SLURM_PROCID:?} on $(hostname)"\n'
                    f'exec {shlex.quote(cluster.python)} "$@"\n')
    path.chmod(0o755)
    return path


def torch_job(cluster: SlurmCluster, **keys: Any) -> tuple[RenderedJob, str]:
    """Renders a torch job for n9 and n10 (2 fake GPUs each), runs it; returns it and its
    rendering. ``keys`` go to :func:`cluster_config` (``launcher``, ``script``, ``args``...)."""
    if Path(keys.get("script", "")) == TORCH_EXAMPLE:
        require(*EXAMPLE_NEEDS["torch_train.py"], python=cluster.python)
    workdir = cluster.new_workdir()
    # A rank killed by a signal prints every thread's Python stack. No OMP_NUM_THREADS: the
    # 4 ranks share 2 unbound cores, and tfdist gives each its share (torch's default, a
    # thread per core in each rank, spins them against each other).
    env = {"PYTHONFAULTHANDLER": "1"}
    if keys.get("launcher") == "torchrun":
        env["LOGLEVEL"] = "INFO"  # torchrun's agents log their rendezvous
    config = cluster_config(cluster, backend=keys.pop("backend", "torch"),
                            python=host_python(cluster, workdir), env=env, **keys)
    text = render(config)
    assert f"#SBATCH --gpus-per-node={cluster.gres_type}:{GPUS_PER_NODE}" in text, text
    return run_rendered(cluster, config, workdir=workdir, timeout=JOB_TIMEOUT), text


def hosts_by_task(job: RenderedJob) -> dict[int, str]:
    """Each srun task's node, as its wrapper printed it in the task's own output file."""
    hosts = {}
    for task, text in job.task_outputs().items():
        found = _HOST.findall(text)
        assert len(found) == 1 and int(found[0][0]) == task, \
            f"task {task}'s file must name its node once: {found}\n{job.describe()}"
        hosts[task] = found[0][1]
    return hosts


def ranks_by_task(job: RenderedJob) -> dict[int, list[int]]:
    """The ranks whose final-weights line is in each srun task's output file."""
    return {task: sorted(final_weights([text])) for task, text in job.task_outputs().items()}


def check_in_sync(job: RenderedJob) -> str:
    """Every rank of WORLD reported its final weights once, all the same; returns the digest."""
    weights = final_weights(job.task_outputs())
    assert sorted(weights) == list(range(WORLD)), \
        f"final-weights lines of ranks {sorted(weights)}, not 0-{WORLD - 1}\n{job.describe()}"
    digests = {digest for _, digest in weights.values()}
    assert {size for size, _ in weights.values()} == {WORLD} and len(digests) == 1, \
        f"ranks ended with different weights: {weights}\n{job.describe()}"
    return digests.pop()


def check_chief(job: RenderedJob, digest: str, backend: str = "ddp") -> str:
    """The chief (rank 0) alone reports; it reaches MIN_ACCURACY; it alone wrote final.pt, which
    loads into the example's model with the ranks' final weights. Returns the chief's output."""
    outputs = job.task_outputs()
    chiefs = [task for task, text in outputs.items() if 0 in final_weights([text])]
    assert len(chiefs) == 1, job.describe()
    chief = outputs[chiefs[0]]
    assert (f"tfdist: {WORLD} worker(s), {WORLD} replica(s), backend {backend}, collective "
            "gloo, device cpu") in chief, \
        job.describe()
    accuracy = _ACCURACY.findall(job.all_output())
    assert len(accuracy) == 1 and accuracy[0] in _ACCURACY.findall(chief), \
        f"the chief alone reports the test accuracy: {accuracy}\n{job.describe()}"
    assert float(accuracy[0][1]) > MIN_ACCURACY, f"test accuracy {accuracy}\n{job.describe()}"

    saved = sorted(str(p.relative_to(job.workdir)) for p in job.workdir.rglob("*.pt*"))
    assert saved == [f"runs/{job.job_id}/final.pt"], \
        f"exactly one final.pt, and no temporary file, expected: {saved}\n{job.describe()}"
    example = _example_module()
    model = example.build_model()
    try:
        model.load_state_dict(torch.load(job.model_dir / "final.pt", weights_only=True))
    except Exception as err:  # any failure to load is the finding
        pytest.fail(f"final.pt does not load: {type(err).__name__}: {err}\n{job.describe()}")
    held = example.digest(model.state_dict())
    assert held == digest, f"final.pt holds weights {held}, not the ranks' {digest}\n" \
        f"{job.describe()}"
    return chief


def _example_module() -> Any:
    """examples/torch_train.py as a module: its model and its digest."""
    sys.path.insert(0, str(TORCH_EXAMPLE.parent))
    try:
        import torch_train
    finally:
        sys.path.remove(str(TORCH_EXAMPLE.parent))
    return torch_train


# --- torchrun: one per node -----------------------------------------------------------------

@pytest.fixture(scope="module")
def torchrun_job(slurm_cluster: SlurmCluster) -> tuple[RenderedJob, str]:
    """examples/torch_train.py under the rendered torchrun job on n9 and n10 (run once)."""
    return torch_job(slurm_cluster, job_name="torchrun", launcher="torchrun",
                     script=TORCH_EXAMPLE, args=example_args())


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@full_matrix_only("torch meets over srun in the DDP job here, torchrun starts bit-identical "
                  "ranks in test_torch.py, and test_jobs.py renders the torchrun script")
def test_torchrun_script_is_one_torchrun_per_node_meeting_on_the_first(
        torchrun_job: tuple[RenderedJob, str]) -> None:
    job, text = torchrun_job
    assert "#SBATCH --ntasks-per-node=1" in text, text
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1" in text, text
    assert " -m torch.distributed.run " in text, text
    assert '--nproc-per-node="${SLURM_GPUS_PER_NODE##*:}"' in text, text
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in text, text
    assert "\nrdzv_port=$((" in text, text  # its value is checked in the agents' logs below
    assert '--master-addr="$head_node" --master-port="$rdzv_port"' in text, text
    assert '--node-rank="$SLURM_NODEID"' in text, text
    assert job.ok, job.describe()
    # One srun task per node, in Slurm's order: task 0 on n9, task 1 on n10.
    assert hosts_by_task(job) == dict(enumerate(TWO_NODES)), job.describe()
    # Both agents were given the first node and the port tfdist derives for the job's step 0,
    # and met there: a world of 2 agents (torchrun's INFO log, LOGLEVEL=INFO).
    port = port_base({"SLURM_JOB_ID": job.job_id}, GPUS_PER_NODE)
    for task, output in job.task_outputs().items():
        assert re.search(rf"rdzv_endpoint\s*: {TWO_NODES[0]}:{port}\n", output), \
            f"task {task}: no rendezvous at {TWO_NODES[0]}:{port}\n{job.describe()}"
        assert len(_GROUP_RANK.findall(output)) == 1, f"task {task}\n{job.describe()}"


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_torchrun_job_trains_in_sync_and_chief_saves_once(
        torchrun_job: tuple[RenderedJob, str]) -> None:
    job, _ = torchrun_job
    assert job.ok, job.describe()
    digest = check_in_sync(job)
    check_chief(job, digest)
    # Two ranks per torchrun, each node's pair in the file of the task on that node.
    assert sorted(map(len, ranks_by_task(job).values())) == [2, 2], job.describe()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_torchrun_ranks_follow_slurm_node_order(torchrun_job: tuple[RenderedJob, str]) -> None:
    job, _ = torchrun_job
    assert job.ok, job.describe()
    hosts = hosts_by_task(job)
    # torchrun's own account: each node's agent, its rank among the agents and its processes'.
    agents = {hosts[task]: (_GROUP_RANK.findall(text), _GLOBAL_RANKS.findall(text))
              for task, text in job.task_outputs().items()}
    assert agents == {"n9": (["0"], ["0, 1"]), "n10": (["1"], ["2, 3"])}, \
        f"torchrun's agents by node: {agents}\n{job.describe()}"
    nodes = {hosts[task]: ranks for task, ranks in ranks_by_task(job).items()}
    assert nodes == {"n9": [0, 1], "n10": [2, 3]}, f"ranks by node: {nodes}\n{job.describe()}"


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(("mode", "distinct"), [("dist", 1), ("control", WORLD)])
def test_torchrun_worker_ends_identical_with_ddp_and_different_without(
        slurm_cluster: SlurmCluster, mode: str, distinct: int) -> None:
    # tests/workers/torch_worker.py writes each rank's parameters to weights-RANK.npz in the
    # job's directory. dist: DDP from different initial weights; control: no DDP, the same steps
    # on the same shards from the same initial weights.
    job, _ = torch_job(slurm_cluster, job_name=f"torchrun-{mode}", launcher="torchrun",
                       script=WORKER, args=[".", mode], doctor=False)  # torchrun_job has it
    assert job.ok, job.describe()  # every rank exits 0: the teardown aborts no rank
    assert hosts_by_task(job) == dict(enumerate(TWO_NODES)), job.describe()
    files = sorted(p.name for p in job.workdir.glob("weights-*.npz"))
    assert files == [f"weights-{rank}.npz" for rank in range(WORLD)], \
        f"{files}\n{job.describe()}"
    digests = {rank: _npz_digest(job.workdir / f"weights-{rank}.npz") for rank in range(WORLD)}
    assert len(set(digests.values())) == distinct, \
        f"{mode}: {distinct} different final weights expected over {WORLD} ranks: {digests}\n" \
        f"{job.describe()}"


def _npz_digest(path: Path) -> str:
    """A digest of the arrays a worker saved: equal digests, identical weights."""
    blake = hashlib.blake2b(digest_size=8)
    with np.load(path) as arrays:
        for name in sorted(arrays.files):
            blake.update(name.encode() + arrays[name].tobytes())
    return blake.hexdigest()


# --- srun: one task per GPU, no torchrun ----------------------------------------------------

@pytest.fixture(scope="module")
def srun_job(slurm_cluster: SlurmCluster) -> tuple[RenderedJob, str]:
    """examples/torch_train.py under the rendered srun job (DDP) on n9 and n10 (run once)."""
    return torch_job(slurm_cluster, job_name="torch-srun", launcher="srun",
                     script=TORCH_EXAMPLE, args=example_args())


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_srun_job_meets_at_the_first_node_derived_port_and_trains_in_sync(
        srun_job: tuple[RenderedJob, str]) -> None:
    job, text = srun_job
    assert f"#SBATCH --ntasks-per-node={GPUS_PER_NODE}" in text, text
    # srun starts the example itself in each task: no torchrun.
    launch = f"\n    {job.config.python} {TORCH_EXAMPLE} --epochs="
    assert re.search(r"^srun [^\n]*\\" + re.escape(launch), text, re.M), text
    assert "torch.distributed.run" not in text and "torchrun" not in text, text
    assert job.ok, job.describe()
    # One task per rank, in Slurm's order: ranks 0 and 1 on n9, 2 and 3 on n10.
    assert hosts_by_task(job) == {0: "n9", 1: "n9", 2: "n10", 3: "n10"}, job.describe()
    assert ranks_by_task(job) == {rank: [rank] for rank in range(WORLD)}, job.describe()
    digest = check_in_sync(job)
    chief = check_chief(job, digest)
    # tfdist.torch derived the rendezvous itself: the first node, the port of the training's
    # step (1: the doctor's step, 0, ran before it).
    port = port_base({"SLURM_JOB_ID": job.job_id, "SLURM_STEP_ID": "1"}, GPUS_PER_NODE)
    assert "rendezvous: first node of the step's nodelist at the job's derived port: " \
           f"{TWO_NODES[0]}:{port}" in chief, job.describe()


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
@full_matrix_only("DeepSpeed trains what DDP trains under tfdist launch and torchrun "
                  "(test_torch_backends.py), and the DDP srun job meets over srun here")
def test_deepspeed_srun_job_trains_what_the_ddp_srun_job_trains(
        slurm_cluster: SlurmCluster, srun_job: tuple[RenderedJob, str]) -> None:
    pytest.importorskip("deepspeed",
                        reason="deepspeed is not installed (requirements/deepspeed.txt)")
    job, text = torch_job(slurm_cluster, job_name="deepspeed-srun", launcher="srun",
                          backend="torch-deepspeed", script=TORCH_EXAMPLE, args=example_args(),
                          doctor=False)  # its subject is DeepSpeed's training: srun_job's has it
    assert "export TFDIST_BACKEND=deepspeed" in text, text
    assert "torchrun" not in text and "torch.distributed.run" not in text, text
    assert job.ok, job.describe()
    assert hosts_by_task(job) == {0: "n9", 1: "n9", 2: "n10", 3: "n10"}, job.describe()
    digest = check_in_sync(job)
    check_chief(job, digest, backend="deepspeed")  # final.pt: the model, not the engine
    assert "Building extension" not in job.all_output(), job.describe()  # nothing compiled
    # ZeRO stage 2 over 4 ranks, fp32, the example's optimizer: DDP's steps. Its reduce-scatter
    # sums the 4 ranks' gradients in another order than DDP's all-reduce, so the weights agree
    # to rounding, not bit for bit; the training itself moved them 100 times further. (A run
    # of 2026-11-26 differed by 1.6e-5, over the 1e-5 this bound was.)
    ours, ddp = _final_state(job), _final_state(srun_job[0])
    example = _example_module()
    torch.manual_seed(example.FLAGS["seed"].default)  # as the example does before it builds
    start = example.build_model().state_dict()
    assert ours.keys() == ddp.keys() == start.keys(), job.describe()
    rounding = max(float((ours[k] - ddp[k]).abs().max()) for k in ours)
    trained = max(float((ddp[k] - start[k]).abs().max()) for k in ddp)
    assert rounding < 1e-4 and trained > 1e-2, \
        f"DeepSpeed's weights differ from DDP's by {rounding} (at most 1e-4 expected); " \
        f"training moved DDP's by {trained}\n{job.describe()}"


def _final_state(job: RenderedJob) -> dict[str, Any]:
    """The chief's final.pt (checked by :func:`check_chief`): the model's state dict."""
    state: dict[str, Any] = torch.load(job.model_dir / "final.pt", weights_only=True)
    return state
