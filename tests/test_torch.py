"""tfdist.torch: the PyTorch shim, from pure rendezvous tables to real 2-process gloo training.

The multiprocess tests start real processes on loopback with gloo: under torchrun, under
`tfdist launch`, and as a simulated srun step (two processes given the variables an srun step
sets, on one machine; the real Slurm cluster tests come with the cluster). Each distributed run
compares both ranks' final weights bit for bit, and a control run without DDP must differ.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from helpers import (
    EXAMPLE_NEEDS,
    ROOT,
    WORKERS,
    clean_env,
    final_weights,
    full_matrix_only,
    load_weights,
    needs,
)

import tfdist.datasets
from tfdist.env import detect, slurm
from tfdist.errors import ConfigError, LaunchError

torch = pytest.importorskip("torch", reason="torch is not installed (requirements/torch.txt)")
import tfdist.torch  # noqa: E402  (after the skip: it imports torch)
from tfdist.torch.rendezvous import Rendezvous, plan  # noqa: E402

WORKER = str(WORKERS / "torch_worker.py")
EXAMPLE = str(ROOT / "examples" / "torch_train.py")
needs_example = needs(*EXAMPLE_NEEDS["torch_train.py"])


def _tf_config(index: int, ports: tuple[int, ...] = (2222, 2223)) -> str:
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _srun_step(rank: int, job: int, size: int = 2, nodelist: str = "localhost",
               tasks_per_node: str = "2") -> dict[str, str]:
    """The variables an srun step sets in task ``rank`` (all tasks on the first node)."""
    return {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(size), "SLURM_STEP_NUM_TASKS": str(size),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}


_TORCHRUN = {"TORCHELASTIC_RUN_ID": "r1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
_JOB = 4242
_PORT = slurm.port_base({"SLURM_JOB_ID": str(_JOB)}, 2)


# --- Rendezvous: pure tables -----------------------------------------------------------------

@pytest.mark.parametrize(("environ", "expected"), [
    ({}, Rendezvous(None, 0, 1, "")),
    (_TORCHRUN, Rendezvous("env://", 3, 4, "")),
    ({"TF_CONFIG": _tf_config(1)}, Rendezvous("tcp://127.0.0.1:2222", 1, 2, "")),
    ({"TF_CONFIG": _tf_config(0), "TFDIST_LAUNCHER": "local"},
     Rendezvous("tcp://127.0.0.1:2222", 0, 2, "")),
    (_srun_step(1, _JOB), Rendezvous(f"tcp://localhost:{_PORT}", 1, 2, "")),
    # Slurm's node order, not string order: rank 0 runs on n9, which sorts after n10.
    ({**_srun_step(3, _JOB, 4, "n[9-10]", "2(x2)"), "SLURM_LOCALID": "1", "SLURM_NODEID": "1"},
     Rendezvous(f"tcp://n9:{_PORT}", 3, 4, "")),
    ({**_srun_step(0, _JOB, 2, "n[9-10]", "1(x2)"), "TFDIST_HOST_TEMPLATE": "{host}-ib0"},
     Rendezvous(f"tcp://n9-ib0:{_PORT}", 0, 2, "")),
    ({**_srun_step(0, _JOB, 2, "n[9-10]", "1(x2)"), "TFDIST_PORT_BASE": "25000"},
     Rendezvous("tcp://n9:25000", 0, 2, "")),
    ({**_srun_step(0, _JOB), "MASTER_ADDR": "head", "MASTER_PORT": "29400"},
     Rendezvous("tcp://head:29400", 0, 2, "")),
    ({**_srun_step(0, _JOB), "MASTER_PORT": "29400"},
     Rendezvous("tcp://localhost:29400", 0, 2, "")),
    ({**_MPI, "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}, Rendezvous("tcp://n1:29500", 1, 2, "")),
], ids=["single", "torchrun", "tf_config", "tfdist-launch", "srun", "srun-node-order",
        "srun-host-template", "srun-port-base", "srun-master-override", "srun-master-port",
        "mpirun-with-master"])
def test_rendezvous_follows_the_launcher(environ, expected):
    found = plan(detect(environ))
    assert (found.init_method, found.rank, found.world_size) == (
        expected.init_method, expected.rank, expected.world_size)
    assert found.reason


def test_srun_rendezvous_uses_the_port_derived_for_every_backend():
    environ = _srun_step(0, 1234)
    environment = detect(environ)
    assert plan(environment).init_method == f"tcp://{environment.worker_addresses[0]}"
    assert environment.worker_addresses[0] == f"localhost:{slurm.port_base(environ, 2)}"
    assert "first node of the step's nodelist" in plan(environment).reason


_HOROVOD = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "n1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}


@pytest.mark.parametrize("environ", [
    _MPI, _HOROVOD, {**_HOROVOD, "TFDIST_LAUNCHER": "local"}],
    ids=["mpirun", "horovodrun", "tfdist-launch-horovod"])
def test_mpi_without_master_address_names_the_fix(environ):
    with pytest.raises(LaunchError) as raised:
        plan(detect(environ))
    message = str(raised.value)
    assert "torchrun" in message and "srun" in message and "MASTER_ADDR" in message


def test_torchrun_variables_without_its_store_are_refused():
    environ = {k: v for k, v in _TORCHRUN.items() if not k.startswith("MASTER_")}
    with pytest.raises(LaunchError, match="start the script with torchrun"):
        plan(detect(environ))


# --- The epoch sampler -----------------------------------------------------------------------

def test_sampler_reshuffles_every_epoch_without_set_epoch():
    data = list(range(103))
    ours = tfdist.torch.EpochSampler(data, num_replicas=2, rank=1, seed=5)
    stock = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, seed=5)
    orders = []
    for epoch in range(3):
        stock.set_epoch(epoch)  # what a careful script does by hand
        orders.append(list(ours))
        assert orders[-1] == list(stock)
    assert orders[0] != orders[1] != orders[2]


def test_sampler_set_epoch_resumes_and_a_set_epoch_loop_behaves_alike():
    data = list(range(50))
    resumed = tfdist.torch.EpochSampler(data, num_replicas=2, rank=0)
    resumed.set_epoch(2)
    fresh = tfdist.torch.EpochSampler(data, num_replicas=2, rank=0)
    assert list(resumed) == [list(fresh) for _ in range(3)][2]
    habit = tfdist.torch.EpochSampler(data, num_replicas=2, rank=0)
    auto = tfdist.torch.EpochSampler(data, num_replicas=2, rank=0)
    for epoch in range(3):
        habit.set_epoch(epoch)
        assert list(habit) == list(auto)


def test_sampler_shares_partition_the_data():
    data = list(range(100))
    shares = [list(tfdist.torch.EpochSampler(data, num_replicas=2, rank=r, seed=3))
              for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == data


# --- The handle in this process (a one-rank group over an in-memory store) ------------------

@pytest.fixture
def plain_process():
    """No launcher variables, no GPU, and no process group left behind."""
    environ = {"PATH": os.environ.get("PATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    with mock.patch.dict(os.environ, environ, clear=True):
        yield
        tfdist.torch.shutdown(barrier=False)
    assert not torch.distributed.is_initialized()


def test_one_process_runs_the_same_code(plain_process, tmp_path):
    with tfdist.torch.distributed() as dist:
        assert (dist.rank, dist.size, dist.local_rank, dist.is_chief) == (0, 1, 0, True)
        assert (dist.backend, dist.collective, str(dist.device),
                dist.rendezvous.init_method) == ("ddp", "gloo", "cpu", None)
        assert tfdist.torch.init() is dist is tfdist.torch.current()
        model = dist.wrap(torch.nn.Linear(3, 2))
        assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)  # one process
        assert dist.average(torch.tensor(2.5)) == 2.5
        assert dist.average(3.0, weight=4) == 3.0
        assert dist.scale_lr(0.1) == 0.1
        assert dist.save(model, tmp_path / "out" / "model.pt")
        loaded = torch.load(tmp_path / "out" / "model.pt")
        assert sorted(loaded) == ["bias", "weight"]  # unwrapped: loads into a plain model
        assert os.listdir(tmp_path / "out") == ["model.pt"]  # no temporary file left
        dist.barrier()
    assert not torch.distributed.is_initialized() and tfdist.torch.current() is None


def _small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 2))


def _train(model, optimizer, backward, x, y) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):
        optimizer.zero_grad()
        backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()


def test_one_process_trains_without_ddp_as_a_plain_loop_does(plain_process, tmp_path, caplog):
    # One process pays no DDP cost: wrap returns the model itself, and the handle's promises
    # (backward, state_dict, save, unwrap, the optimizer returned) hold as on many processes.
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,),
                                                                   generator=generator)
    control = _small_net()
    _train(control, torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9),
           lambda loss: loss.backward(), x, y)
    from tfdist.torch import handle

    with caplog.at_level(logging.INFO, logger="tfdist"), tfdist.torch.distributed() as dist:
        plain = _small_net()
        steps = handle._steps[0]
        model, optimizer = dist.wrap(plain, torch.optim.SGD(plain.parameters(), lr=0.1,
                                                            momentum=0.9))
        assert model is plain and tfdist.torch.unwrap(model) is plain
        assert not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        with model.no_sync():  # DDP's, for gradient accumulation: nothing to hold back here
            _train(model, optimizer, dist.backward, x, y)
        assert handle._steps[0] - steps == 3  # the step count that names a failed peer
        state = dist.state_dict(model)
        assert list(state) == list(control.state_dict())  # no "module." prefix
        for key, tensor in control.state_dict().items():
            assert torch.equal(state[key], tensor), key  # bit for bit
        assert dist.save(model, tmp_path / "model.pt")
        _small_net().load_state_dict(torch.load(tmp_path / "model.pt"))  # a plain model's
        with pytest.raises(TypeError, match="find_unused_parameter"):  # DDP's would refuse it
            dist.wrap(_small_net(), find_unused_parameter=True)
    assert "model not wrapped (one process: no DistributedDataParallel" in caplog.text


def test_an_error_inside_tears_the_group_down(plain_process):
    with pytest.raises(ValueError, match="boom"), tfdist.torch.distributed():
        raise ValueError("boom")
    assert not torch.distributed.is_initialized()


def test_nccl_without_cuda_falls_back_to_gloo_and_says_so(plain_process, caplog):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: NCCL is used")
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        dist = tfdist.torch.init("nccl")
    assert dist.collective == "gloo"
    assert "NCCL was requested but CUDA is not available" in caplog.text


def test_init_refuses_other_settings_and_a_foreign_group(plain_process):
    tfdist.torch.init(timeout=30)
    with pytest.raises(ConfigError, match="already initialised"):
        tfdist.torch.init(timeout=31)
    tfdist.torch.shutdown()
    assert tfdist.torch.current() is None and not torch.distributed.is_initialized()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        with pytest.raises(ConfigError, match="remove your init_process_group"):
            tfdist.torch.init()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("kwargs", "environ", "message"), [
    ({"collective": "mpi"}, {}, r"'mpi' is not one of \('auto', 'nccl', 'gloo'\).*"
                                "TFDIST_TORCH_COLLECTIVE"),
    ({}, {"TFDIST_TORCH_COLLECTIVE": "nccl2"}, "'nccl2' is not one of"),
    ({}, {"TFDIST_TORCH_BACKEND": "nccl2"}, "'nccl2' is not one of"),  # the old name
    ({}, {"TFDIST_TORCH_TIMEOUT": "soon"}, "TFDIST_TORCH_TIMEOUT='soon' is no positive duration"),
    ({"timeout": 0}, {}, "timeout=0 is no positive duration"),
])
def test_bad_settings_name_the_choices(plain_process, kwargs, environ, message):
    with mock.patch.dict(os.environ, environ), pytest.raises(ConfigError, match=message):
        tfdist.torch.init(**kwargs)


def test_runnable_threads_counts_running_threads_of_that_name_only():
    # The teardown waits on this count for gloo's workers; here two named threads of our own,
    # one hashing without the GIL (running) and one waiting on an event (asleep).
    from tfdist.torch.handle import _runnable_threads

    libc = ctypes.CDLL(None, use_errno=True)
    stop, named = threading.Event(), threading.Barrier(3)

    def run(name: bytes, busy: bool) -> None:
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: this thread's comm
        named.wait()
        data = b"x" * (8 << 20)
        while not stop.wait(0 if busy else 5):
            hashlib.sha256(data).digest()  # releases the GIL: the thread stays runnable

    threads = [threading.Thread(target=run, args=(b"tfdist_busy", True)),
               threading.Thread(target=run, args=(b"tfdist_idle", False))]
    for thread in threads:
        thread.start()
    try:
        named.wait()
        seen = [(_runnable_threads("tfdist_busy"), _runnable_threads("tfdist_idle"))
                for _ in range(50) if not time.sleep(0.001)]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert any(busy == 1 for busy, _ in seen), seen
    # The idle thread may still run on its way into wait() at first; after 50 ms it sleeps.
    assert all(idle == 0 for _, idle in seen[-20:]), seen
    # Ended: join() returns once Python's part of the thread is done; the kernel task may run
    # a moment longer on its way out, so wait for it (bounded).
    deadline = time.monotonic() + 2
    while _runnable_threads("tfdist_busy") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _runnable_threads("tfdist_busy") == 0
    assert _runnable_threads("no such thread") == 0


def test_the_chiefs_print_is_one_write_so_a_ranks_line_cannot_land_inside_it():
    # Python's print writes the text and the line end apart; unbuffered, another rank's line
    # sharing the stream (torchrun without --tee) once landed between them, joined to the
    # chief's: the other rank's "final weights" line was then not at a line's start.
    class Stream:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.writes.append("<flush>")

    chief = tfdist.torch.TorchDistributed(detect({}), Rendezvous("env://", 0, 2, "test"), "gloo",
                                          torch.device("cpu"))
    stream = Stream()
    chief.print("test loss", 0.5, file=stream)
    chief.print("a", "b", sep="-", end="", file=stream, flush=False)
    assert stream.writes == ["test loss 0.5\n", "<flush>", "a-b"]
    other = tfdist.torch.TorchDistributed(detect({}), Rendezvous("env://", 1, 2, "test"), "gloo",
                                          torch.device("cpu"))
    other.print("never", file=stream)
    assert stream.writes == ["test loss 0.5\n", "<flush>", "a-b"]


def test_batch_arithmetic_and_lr_warmup_on_two_replicas():
    dist = tfdist.torch.TorchDistributed(detect({}), Rendezvous("env://", 1, 2, "test"), "gloo",
                                         torch.device("cpu"))
    assert (dist.per_replica_batch_size(64), dist.global_batch_size(32)) == (32, 64)
    with pytest.raises(ConfigError, match=r"use a multiple of 2, e\.g\. 62"):
        dist.per_replica_batch_size(63)
    assert dist.scale_lr(1e-3) == 2e-3
    assert not dist.is_chief and not dist.save({"a": 1}, "/nonexistent/never-written.pt")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    warmup = dist.warmup(optimizer, steps=4)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        warmup.step()
    assert rates == pytest.approx([0.2, 0.25, 0.3, 0.35, 0.4, 0.4])


# --- Offline digits as numpy arrays ----------------------------------------------------------

def test_arrays_load_neither_tensorflow_nor_torch():
    code = ("import sys, tfdist.datasets as d; x, y = d.arrays('digits', 'test'); "
            "print(x.shape, x.dtype, y.dtype, sorted(m for m in ('tensorflow', 'torch') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "(360, 8, 8, 1) uint8 int64 []"


@needs("tensorflow_datasets")
def test_arrays_hold_the_same_examples_as_the_tensorflow_loader(tmp_path):
    from tfdist.datasets import digits

    for split, size in (("train", 1437), ("test", 360)):
        images, labels = tfdist.datasets.arrays("digits", split)
        assert images.shape == (size, 8, 8, 1) and labels.shape == (size,)
        loaded = list(tfdist.datasets.load("digits", split, tmp_path).as_numpy_iterator())
        ours = sorted((x.tobytes(), int(y)) for x, y in zip(images, labels, strict=True))
        assert ours == sorted((x.tobytes(), int(y)) for x, y in loaded)
    target = digits.source()[1]
    images, labels = tfdist.datasets.arrays("digits", "train")
    rows = digits.split_indices()["train"]
    assert np.array_equal(labels, target[rows]) and labels.dtype == np.int64


@pytest.mark.parametrize(("name", "split", "message"), [
    ("mnist", "train", "no in-memory arrays for dataset 'mnist'"),
    ("digits", "train[:10%]", "slices are tfds-only"),
])
def test_arrays_refuse_what_they_cannot_serve(name, split, message):
    with pytest.raises(ConfigError, match=message):
        tfdist.datasets.arrays(name, split)


def test_importing_tfdist_loads_no_torch():
    code = ("import sys, tfdist, tfdist.env, tfdist.datasets, tfdist.launch, tfdist.cli; "
            "a = 'torch' in sys.modules; import tfdist.torch; "
            "print(a, 'torch' in sys.modules, 'tensorflow' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "False"]


# --- Real processes --------------------------------------------------------------------------

def _clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher's variables; CPU only, so gloo on any machine."""
    env = clean_env()  # no launcher variable of the machine running the tests leaks in
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints every thread's
    # Python stack, so an intermittent crash leaves more than its C++ message.
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "CUDA_VISIBLE_DEVICES": "",
            **extra}


def _results(out: Path) -> tuple[list[list[np.ndarray]], list[dict]]:
    return ([load_weights(out, r) for r in (0, 1)],
            [json.loads((out / f"result-{r}.json").read_text()) for r in (0, 1)])


def _assert_ddp_run(out: Path, launcher: str) -> list[dict]:
    weights, results = _results(out)
    assert [(r["rank"], r["size"], r["launcher"], r["backend"], r["collective"])
            for r in results] == [(0, 2, launcher, "ddp", "gloo"), (1, 2, launcher, "ddp", "gloo")]
    assert {r["wrapped"] for r in results} == {"DistributedDataParallel"}  # two processes: DDP
    for a, b in zip(weights[0], weights[1], strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit, from different initial weights
    assert results[0]["losses"] == results[1]["losses"]  # averaged over the ranks
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    for result in results:  # each epoch reshuffles, without set_epoch in the worker
        assert len({json.dumps(b) for b in result["first_batches"]}) == 3
    assert results[0]["first_batches"] != results[1]["first_batches"]
    return results


def _free_job_id() -> int:
    """A job id whose derived port block is free on this machine right now. The search starts
    at random: two tests that start steps at once (two test processes) must not both take the
    first free block."""
    for job in range(random.randrange(50000), 10**6):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", slurm.port_base({"SLURM_JOB_ID": str(job)}, 2)))
            except OSError:
                continue
        return job
    raise AssertionError("no free derived port")


def _start_step(args: list[str], job: int, **extra: str) -> list[subprocess.Popen[str]]:
    """Starts 2 processes with the variables of a 2-task srun step on one node.

    Unpinned, as srun without CPU binding leaves them: tfdist gives each its share of the
    cores (torch's default, a thread per core in each, spins them against each other).
    """
    return [subprocess.Popen([sys.executable, *args], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=_clean_env(**_srun_step(rank, job), **extra))
            for rank in (0, 1)]


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit code and output; what still runs after ``timeout`` s is killed."""
    deadline, outcomes = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        outcomes.append((proc.returncode, out))
    return outcomes


def _tfdist_launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", *args], cwd=ROOT,
                          env=_clean_env(), capture_output=True, text=True, timeout=300,
                          check=False)


def _torchrun(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", *args], cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.multiprocess
def test_torchrun_two_ranks_end_bit_identical(tmp_path):
    run = _torchrun([WORKER, str(tmp_path), "dist"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = _assert_ddp_run(tmp_path, "torchrun")
    assert {r["init_method"] for r in results} == {"env://"}


@pytest.mark.multiprocess
def test_tfdist_launch_two_ranks_end_bit_identical(tmp_path):
    run = _tfdist_launch([WORKER, str(tmp_path), "dist"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = _assert_ddp_run(tmp_path, "local")
    assert results[0]["init_method"].startswith("tcp://127.0.0.1:")


@pytest.mark.multiprocess
def test_control_without_ddp_diverges(tmp_path):
    run = _tfdist_launch([WORKER, str(tmp_path), "control"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    weights, _ = _results(tmp_path)
    differing = [not np.array_equal(a, b) for a, b in zip(weights[0], weights[1], strict=True)]
    assert all(differing), "without DDP the ranks must end with different weights"


@pytest.mark.multiprocess
def test_simulated_srun_step_meets_at_the_first_node_and_derived_port(tmp_path):
    job = _free_job_id()
    outcomes = _finish(_start_step([WORKER, str(tmp_path), "dist"], job), timeout=240)
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    results = _assert_ddp_run(tmp_path, "slurm")
    port = slurm.port_base({"SLURM_JOB_ID": str(job)}, 2)
    assert {r["init_method"] for r in results} == {f"tcp://localhost:{port}"}
    assert [r["local_rank"] for r in results] == [0, 1]
    # Unpinned, 2 ranks on the machine: each takes half its cores (torch would take them all).
    for result in results:
        if result["affinity"] == result["cores"]:
            assert result["threads"] == max(1, result["cores"] // 2), result


@pytest.mark.multiprocess
def test_a_crash_on_one_rank_ends_the_other_at_once(tmp_path):
    start = time.monotonic()
    # No launcher that would kill the survivor: only the shim's teardown can end rank 0.
    outcomes = _finish(_start_step([WORKER, str(tmp_path), "crash"], _free_job_id(),
                                   TFDIST_TORCH_TIMEOUT="300"), timeout=120)
    elapsed = time.monotonic() - start
    (code0, out0), (code1, out1) = outcomes
    assert code1 != 0 and "deliberate failure on rank 1" in out1
    assert code0 != 0 and "RuntimeError" in out0, out0[-3000:]
    assert re.search(r"Connection (closed|reset) by peer|Broken pipe", out0), out0[-3000:]
    assert elapsed < 60, f"rank 0 took {elapsed:.0f} s, not ended by the teardown"


@pytest.mark.multiprocess
def test_a_stalled_rank_ends_the_other_by_the_timeout(tmp_path):
    procs = _start_step([WORKER, str(tmp_path), "stall"], _free_job_id(),
                        TFDIST_TORCH_TIMEOUT="5", STALL_S="300")
    start = time.monotonic()
    try:
        [(code0, out0)] = _finish(procs[:1], timeout=90)
        elapsed = time.monotonic() - start
    finally:
        _finish(procs[1:], timeout=0)  # rank 1 still sleeps: the test ends it
    assert code0 != 0 and "Timed out" in out0, out0[-3000:]
    assert elapsed < 60, f"rank 0 took {elapsed:.0f} s with a 5 s timeout"


@pytest.mark.multiprocess
def test_a_missing_rank_is_a_launch_error_not_a_hang():
    code = ("import tfdist.torch\ntry:\n    tfdist.torch.init(timeout=3)\n"
            "except tfdist.LaunchError as e:\n    print('LaunchError:', e)")
    env = _clean_env(TF_CONFIG=_tf_config(0, (_free_port(), _free_port())))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LaunchError: rank 0 of 2 could not form the process group" in run.stdout
    assert "every rank was started" in run.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- The example -----------------------------------------------------------------------------

def _accuracy(output: str) -> float:
    found = [line for line in output.splitlines() if "test accuracy" in line]
    assert found, output[-3000:]
    return float(found[-1].split("test accuracy")[1].split()[0])


@pytest.mark.multiprocess
@needs_example
def test_example_on_two_workers_with_the_keras_flags(tmp_path):
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text(f"--epochs=6\n--batch_size=64\n--scale_lr\n--warmup_epochs=1\n"
                        f"--model_dir={tmp_path}/m\n--data_dir={tmp_path}/data\n")
    run = _tfdist_launch([EXAMPLE, f"--flagfile={flagfile}"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("[0] tfdist: 2 worker(s), 2 replica(s), backend ddp, collective gloo, device cpu"
            in run.stdout)
    assert "learning rate 0.002" in run.stdout  # --scale_lr doubled 1e-3
    assert _accuracy(run.stdout) > 0.9
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights
    assert "[1] test loss" not in run.stdout and "[1] Epoch" not in run.stdout
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["final.pt"]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from torch_train import build_model
    finally:
        sys.path.remove(str(ROOT / "examples"))
    build_model().load_state_dict(torch.load(tmp_path / "m" / "final.pt"))


@pytest.mark.multiprocess
@needs_example
@full_matrix_only("torchrun starts the bit-identical run, and the example trains under "
                  "tfdist launch and in one plain process")
def test_example_under_torchrun(tmp_path):
    run = _torchrun([EXAMPLE, "--epochs=5"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tfdist: 2 worker(s), 2 replica(s), backend ddp, collective gloo" in run.stdout
    assert _accuracy(run.stdout) > 0.9
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights


@pytest.mark.multiprocess
@needs_example
def test_example_in_one_plain_process():
    # One thread: the test machines' 2 cores are shared, where torch's default spins.
    run = subprocess.run([sys.executable, EXAMPLE, "--epochs=3", "--seed=1"], cwd=ROOT,
                         env=_clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("tfdist: 1 worker(s), 1 replica(s), backend ddp, collective gloo, device cpu"
            in run.stdout)
    assert _accuracy(run.stdout) > 0.8


@pytest.mark.gpu
@needs_example
def test_example_trains_on_the_gpu_under_tfdist_launch():
    # The machine's GPUs (the gpu mark): one worker trains on the first through NCCL, as
    # checked by hand (docs/versions.md, 'Checked by hand on one GPU').
    if torch.version.cuda is None:  # read from the build, without starting CUDA here
        pytest.skip(f"torch {torch.__version__} is a CPU build: a CUDA build trains on the GPU")
    env = clean_env()
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "1", EXAMPLE,
                          "--epochs=3"], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert ("tfdist: 1 worker(s), 1 replica(s), backend ddp, collective nccl, device cuda:0"
            in run.stdout), run.stdout[-3000:]
    assert _accuracy(run.stdout) > 0.8
