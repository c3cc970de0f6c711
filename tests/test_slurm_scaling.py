"""``tfdist job --kind scaling`` on the Slurm test cluster: one allocation of 2 nodes, the
training on 1 and 2 of them (one srun step each, one task per node), then the report.

One job serves every check (about a minute on 2 cores): tests/workers/scaling_worker.py trains
2 short epochs per step, with tfdist's throughput meter writing the chief's records where the
rendered script's TFDIST_THROUGHPUT_FILE says, and ``tfdist scaling --report`` runs as the last
step. The job runs on n9 and n10 (a third node would add three TensorFlow processes and no
other path); it skips, with the fixture's reason, where the cluster cannot run.
"""

from __future__ import annotations

import csv
import importlib.util
import re
from pathlib import Path

import pytest
from helpers import WORKERS, installed
from slurm_jobs import NODELIST, RenderedJob, cluster_config, run_rendered
from slurmtest import SlurmCluster

from tfdist import scaling
from tfdist.jobs import render

SIZES = (1, 2)
TIMEOUT = 300
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_WORKER_LINE = re.compile(r"^scaling_worker: rank (\d+) of (\d+) on (\S+)$", re.M)


@pytest.fixture(scope="module")
def scaling_job(slurm_cluster: SlurmCluster) -> RenderedJob:
    """The scaling job, run once: 2 nodes, sizes 1 and 2 (the default for 2 nodes)."""
    if importlib.util.find_spec("tfdist.throughput") is None:
        pytest.skip("tfdist.throughput (the meter that writes the records) is not there yet")
    config = cluster_config(
        slurm_cluster, job_name="scaling", kind="scaling", nodes=len(SIZES),
        gpus_per_node=0, gpu_type=None, tasks_per_node=1, sbatch_args=[NODELIST], doctor=False,
        task_output=None, script=str(WORKERS / "scaling_worker.py"),
        args=["--epochs=2", "--steps=32"])
    assert config.effective_scaling_nodes == SIZES, render(config)
    assert "for nodes in 1 2; do" in render(config), render(config)
    return run_rendered(slurm_cluster, config, timeout=TIMEOUT)


def folder(job: RenderedJob) -> Path:
    """Where the rendered script puts the runs and the report: next to the job's output."""
    return job.workdir / f"scaling-{job.job_id}"


@pytest.mark.timeout(TIMEOUT + 60)
def test_each_size_runs_as_its_own_step_on_that_many_nodes(scaling_job: RenderedJob,
                                                          slurm_cluster: SlurmCluster) -> None:
    job = scaling_job
    assert job.ok, job.describe()
    for nodes in SIZES:
        assert f"tfdist scaling: {nodes} node(s), {nodes} worker(s)" in job.result.output, \
            job.describe()
    # Every task's output goes to the job's: each step's workers say where they run.
    hosts: dict[int, dict[int, str]] = {}
    for rank, size, host in _WORKER_LINE.findall(job.result.output):
        assert int(rank) not in hosts.get(int(size), {}), f"rank {rank} of {size} twice"
        hosts.setdefault(int(size), {})[int(rank)] = host
    assert sorted(hosts) == list(SIZES), f"{hosts}\n{job.describe()}"
    for nodes in SIZES:
        # One task per node, on the allocation's first `nodes` nodes, in Slurm's order.
        assert [hosts[nodes][rank] for rank in sorted(hosts[nodes])] == \
            list(slurm_cluster.nodes[:nodes]), f"{nodes} node(s): {hosts}\n{job.describe()}"


@pytest.mark.timeout(TIMEOUT + 60)
def test_each_steps_chief_wrote_its_records(scaling_job: RenderedJob) -> None:
    job = scaling_job
    assert job.ok, job.describe()
    runs = sorted(p.name for p in (folder(job) / "runs").iterdir())
    assert runs == [f"n{n}-r1.jsonl" for n in SIZES], runs
    for workers in SIZES:
        epochs = scaling.parse_epochs((folder(job) / "runs" / f"n{workers}-r1.jsonl").read_text())
        assert [(e.epoch, e.workers, e.global_batch) for e in epochs] == [
            (0, workers, 64), (1, workers, 64)], f"{epochs}\n{job.describe()}"
        assert all(e.examples_per_s and e.examples_per_s > 0 for e in epochs), epochs


@pytest.mark.timeout(TIMEOUT + 60)
def test_the_report_step_wrote_md_csv_and_png(scaling_job: RenderedJob,
                                             slurm_cluster: SlurmCluster) -> None:
    job = scaling_job
    assert job.ok, job.describe()
    out = folder(job)
    rows = list(csv.DictReader((out / "scaling.csv").open()))
    assert [int(row["workers"]) for row in rows] == list(SIZES), rows
    assert all(float(row["total"]) > 0 and row["unit"] == "examples/s" for row in rows), rows
    assert (float(rows[0]["speedup"]), float(rows[0]["efficiency_pct"])) == (1.0, 100.0), rows
    base = float(rows[0]["total"])
    for row in rows:  # the plotted ideal: N x the one worker's throughput
        assert float(row["ideal_total"]) == pytest.approx(int(row["workers"]) * base, rel=1e-5)
    table = (out / "scaling.md").read_text()
    assert all(f"\n| {n} | " in table for n in SIZES), table
    assert scaling.table(scaling.summarize(scaling.load_runs(out))) in job.result.output, \
        job.describe()  # the report step printed the table into the job's output
    if not installed("matplotlib", slurm_cluster.python):  # the report says so, and goes on
        assert "install tfdist[plot] for the plot" in job.result.output, job.describe()
        return
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 10_000, f"{len(png)} bytes\n{job.describe()}"
