"""The one device policy: which GPUs a process drives and how many threads it uses.

Pure tables; ``select_gpus`` itself is also exercised against Slurm's variables in
tests/test_resolver.py. No GPU is needed: the policy is arithmetic on ids and counts.
"""

from __future__ import annotations

import os

import pytest

from tfdist import devices
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError


@pytest.mark.parametrize(("count", "local_rank", "local_world_size", "expected"), [
    (0, 0, 1, range(0)),           # CPU only
    (0, 1, 2, range(0)),           # CPU only, several tasks
    (4, 0, 1, range(4)),           # one process drives every GPU
    (4, 1, 4, range(1, 2)),        # one GPU per task
    (4, 1, 2, range(2, 4)),        # two GPUs per task
    (1, 0, 1, range(1)),
])
def test_share_of_counted_gpus(count, local_rank, local_world_size, expected):
    assert devices.share(count, local_rank, local_world_size) == expected


def test_share_refuses_gpus_that_do_not_divide():
    with pytest.raises(ConfigError, match="3 GPUs cannot be shared evenly by 2 processes"):
        devices.share(3, 0, 2)
    # Two processes on a one-GPU machine (seen with torchrun --nproc-per-node 2 on an H100).
    with pytest.raises(ConfigError, match=r"^1 GPU cannot be shared evenly by 2 processes on this "
                       r"node: start 1 process per node, one per GPU$"):
        devices.share(1, 1, 2)


@pytest.mark.parametrize(("visible", "local_rank", "local_world_size", "bound", "expected"), [
    (None, 0, 2, False, None),        # nothing set: the framework counts
    ("", 0, 2, False, ""),            # CPU-only step
    ("NoDevFiles", 1, 2, False, ""),
    ("2,3", 1, 2, False, "3"),        # physical ids kept
    ("0,1,2,3", 1, 2, False, "2,3"),  # two per task
    ("1", 1, 2, True, "1"),           # --gpus-per-task: already this task's
    ("0,1", 0, 1, False, "0,1"),      # one task drives both
])
def test_select_gpus(visible, local_rank, local_world_size, bound, expected):
    assert devices.select_gpus(visible, local_rank, local_world_size, bound) == expected


@pytest.mark.parametrize(("visible", "node_gpus", "workers", "per_worker", "expected"), [
    ("0,1,2,3", 0, 2, 2, "0,1,2,3"),          # the --help example
    ("0,1,2,3,4,5,6,7", 0, 2, 2, "0,1,2,3"),  # the first N*K: the others stay free
    ("4,5,6,7", 0, 1, 2, "4,5"),              # physical ids kept
    (None, 8, 2, 4, "0,1,2,3,4,5,6,7"),       # unset: the node's GPUs
    ("0,1", 8, 2, 1, "0,1"),                  # set: the node's count does not matter
])
def test_launch_gpus(visible, node_gpus, workers, per_worker, expected):
    assert devices.launch_gpus(visible, node_gpus, workers, per_worker) == expected
    # Each worker's init then keeps its own block of K.
    blocks = [devices.select_gpus(expected, rank, workers, False) for rank in range(workers)]
    assert [len(b.split(",")) for b in blocks] == [per_worker] * workers
    assert ",".join(blocks) == expected


@pytest.mark.parametrize(("visible", "node_gpus", "workers", "per_worker", "message"), [
    ("0,1,2,3", 0, 3, 2, "-n 3 --gpus-per-worker 2 needs 6 GPUs, but 4 are visible "
                         r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\): use -n 2 or --gpus-per-worker 1"),
    ("0,1", 0, 5, 5, "needs 25 GPUs, but 2 are visible .*: use -n 1 --gpus-per-worker 2"),
    (None, 0, 2, 2, "shows no GPU .*TFDIST_CPU_REPLICAS=2 gives each worker 2 CPU replicas"),
    ("", 4, 1, 1, r"shows no GPU \(CUDA_VISIBLE_DEVICES=\)\. Leave the option out"),
])
def test_launch_gpus_refuses_what_cannot_be(visible, node_gpus, workers, per_worker, message):
    with pytest.raises(ConfigError, match=message):
        devices.launch_gpus(visible, node_gpus, workers, per_worker)


def test_one_gpu_per_process_names_the_idle_gpus_and_the_fix():
    assert devices.one_gpu_per_process("Horovod", 1, "backend mwms") is None
    assert devices.one_gpu_per_process("Horovod", 0) is None
    assert devices.one_gpu_per_process("Horovod", 4, "backend mwms") == (
        "Horovod drives one GPU per process, and this process was given 4: it trains on the "
        "first, and 3 stay idle. Fix: start one process per GPU (`srun --ntasks-per-node=4` on "
        "each node, `tfdist launch -n 4`), or use backend mwms, which drives several GPUs per "
        "process")
    assert devices.one_gpu_per_process("DistributedDataParallel", 2).endswith(
        "`tfdist launch -n 2`)")


@pytest.mark.parametrize(("chosen", "expected"), [(None, None), ("", 0), ("3", 1), ("2,3", 2)])
def test_count(chosen, expected):
    assert devices.count(chosen) == expected


@pytest.mark.parametrize(("threads", "pinned", "cores", "local", "expected"), [
    (None, 1, 2, 2, 1),        # tfdist launch: one core per worker
    (None, 4, 64, 16, 4),      # srun --cpus-per-task=4 --cpu-bind=cores
    (None, 64, 64, 1, None),   # one process, not pinned: the framework's default
    (None, 0, 64, 1, None),    # unknown affinity
    (None, 64, 64, 4, 16),     # 4 unpinned ranks share the machine: a quarter each
    (None, 0, 64, 4, 16),      # the same, affinity unknown
    (None, 2, 2, 4, 1),        # more ranks than cores: one thread each, never none
    (8, 1, 2, 2, 8),           # the user's choice wins
    (8, 64, 64, 4, 8),
])
def test_thread_count(threads, pinned, cores, local, expected):
    assert devices.thread_count(threads, pinned, cores, local) == expected


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("OMP_NUM_THREADS", "3", None),  # the framework reads the user's own setting
    ("OMP_NUM_THREADS", "", "share"),  # set empty: as if unset
    (None, None, "share"),
])
def test_a_framework_variable_the_user_set_wins_over_the_derived_count(monkeypatch, variable,
                                                                        value, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    if variable:
        monkeypatch.setenv(variable, value)
    got = devices.affinity_thread_count(None, 4, variable)
    assert got == (2 if expected == "share" else expected)
    assert devices.affinity_thread_count(5, 4, variable) == 5  # asked of tfdist: that


@pytest.mark.parametrize(("environment", "before", "after", "returned"), [
    (ClusterEnvironment("slurm", local_rank=1, local_world_size=2, visible_devices="2,3"),
     {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "3"}, "3"),
    (ClusterEnvironment("slurm", local_rank=1, local_world_size=2, visible_devices="3",
                        gpus_per_task=1),
     {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "3"}, "3"),
    (ClusterEnvironment("single"), {}, {}, None),  # unset stays unset
    (ClusterEnvironment("local", visible_devices="-1"), {"CUDA_VISIBLE_DEVICES": "-1"},
     {"CUDA_VISIBLE_DEVICES": ""}, ""),
])
def test_narrow_visible_gpus_writes_the_choice(environment, before, after, returned):
    environ = dict(before)
    assert devices.narrow_visible_gpus(environment, environ) == returned
    assert environ == after
