"""``tfdist doctor``: the checks as tables, then real ranks on loopback.

The real cases each start 2 processes: a good plan passes (TensorFlow's MWMS, torch and
Horovod); a port held by another process, a coordinator address that does not route, an
interface that does not exist and a rank running other versions each fail in seconds, with the
rank and host named. The version mismatch is real: rank 1 runs the Horovod environment's
Python (TensorFlow 2.18) against rank 0's (2.21).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from helpers import HOROVOD_PYTHON, ROOT, clean_env, needs

from tfdist import backend_facts as facts
from tfdist import doctor, quiet
from tfdist.devices import node_gpus
from tfdist.doctor.collective import bus_bandwidth
from tfdist.doctor.probe import replicas
from tfdist.doctor.report import (
    TESTED_TENSORFLOW,
    Problem,
    RankReport,
    check,
    interface_problem,
    ranges,
    table,
    version_problems,
)

VERSIONS = {"python": "3.11.7", "tensorflow": "2.21.0", "keras": "3.15.1", "tfdist": "0.1.0"}
HVD_PY = HOROVOD_PYTHON
# Another environment, with TensorFlow 2.18.1 (this one's is 2.21, or 2.15 in the TF 2.15 lane).
OTHER_PY = ROOT / ".venv-horovod" / "bin" / "python"


def _report(rank: int, **fields: object) -> RankReport:
    base: dict[str, object] = {"host": "n1", "local_rank": rank, "local_world_size": 2,
                               "backend": "mwms", "collective": "ring", "versions": VERSIONS,
                               "interfaces": ("lo", "eth0", "ib0")}
    return RankReport(rank=rank, **{**base, **fields})  # type: ignore[arg-type]


INTERFACES = ("lo", "eth0", "ib0", "ib1", "enp1s0")
SELECTIONS = {
    # (variable, value): selects an interface
    ("NCCL_SOCKET_IFNAME", "ib"): True,  # a prefix
    ("NCCL_SOCKET_IFNAME", "ib9"): False,
    ("NCCL_SOCKET_IFNAME", "=ib"): False,  # exact names only
    ("NCCL_SOCKET_IFNAME", "=ib1"): True,
    ("NCCL_SOCKET_IFNAME", "^lo,docker"): True,  # everything but
    ("NCCL_SOCKET_IFNAME", "^lo,eth,ib,enp"): False,
    ("NCCL_SOCKET_IFNAME", "hsn,en"): True,  # a list of prefixes
    ("GLOO_SOCKET_IFNAME", "ib0,ib1"): True,
    ("GLOO_SOCKET_IFNAME", "ib"): False,  # gloo: names, not prefixes
    ("HOROVOD_GLOO_IFACE", "eth0"): True,
    ("HOROVOD_GLOO_IFACE", "eth"): False,
}


@pytest.mark.parametrize(("variable", "value"), sorted(SELECTIONS))
def test_interface_variables_read_as_their_library_reads_them(variable, value):
    problem = interface_problem(variable, value, INTERFACES)
    assert (problem is None) == SELECTIONS[(variable, value)]
    if problem:
        assert f"{variable}={value}" in problem and "enp1s0, eth0, ib0, ib1, lo" in problem


def test_versions_that_differ_name_the_odd_rank_out():
    reports = [_report(0), _report(1, host="n2", versions={**VERSIONS, "tensorflow": "2.18.1"}),
               _report(2, host="n3")]
    (problem,) = version_problems(reports)
    assert (problem.rank, problem.host) == (1, "n2")
    assert "tensorflow 2.18.1 where 2 of 3 ranks run 2.21.0" in problem.what
    missing = [_report(0), _report(1, versions={k: v for k, v in VERSIONS.items()
                                                if k != "keras"}), _report(2)]
    assert "keras (not installed) where 2 of 3 ranks run 3.15.1" in \
        version_problems(missing)[0].what


CASES = {
    # name: (reports, expected (severity, rank, words) of every problem)
    "a good plan": ([_report(0), _report(1)], []),
    "an invalid setting": ([_report(0, errors=("backend 'mwm' is not one of ...",))],
                           [("error", 0, "backend 'mwm'")]),
    "an interface one node lacks": (
        [_report(0, network={"NCCL_SOCKET_IFNAME": "ib0"}),
         _report(1, host="n2", interfaces=("lo", "eth0"), network={"NCCL_SOCKET_IFNAME": "ib0"})],
        [("error", 1, "NCCL_SOCKET_IFNAME=ib0 selects no network interface")]),
    "a host name that does not resolve": (
        [_report(0, resolved={"n1-ib0": "10.0.0.1", "n2-ib0": "error: Name or service not known"},
                 network={"TFDIST_HOST_TEMPLATE": "{host}-ib0"})],
        [("error", 0, "cannot resolve n2-ib0 (Name or service not known), the name "
                      "TFDIST_HOST_TEMPLATE={host}-ib0 gives")]),
    "more tasks than GPUs": ([_report(r, local_world_size=8, node_gpus=4, gpus=str(r))
                              for r in range(2)],
                             [("error", rank, "8 tasks share the node's 4 GPUs")
                              for rank in range(2)]),
    "two tasks on a one-GPU node": ([_report(r, local_world_size=2, node_gpus=1, gpus="0")
                                     for r in range(2)],
                                    [*[("error", rank, "2 tasks share the node's only GPU")
                                       for rank in range(2)],
                                     ("error", 1, "GPU 0 is driven by ranks 0, 1")]),
    "two tasks counting a one-GPU node's GPUs": (
        [_report(r, local_world_size=2, node_gpus=1, gpus="?") for r in range(2)],
        [("error", rank, "2 tasks share the node's only GPU") for rank in range(2)]),
    "a CPU run on a GPU node (CUDA_VISIBLE_DEVICES='')": (
        [_report(r, local_world_size=2, node_gpus=1, gpus="") for r in range(2)], []),
    "GPUs from Slurm, all hidden (CUDA_VISIBLE_DEVICES='')": (
        [_report(r, node_gpus=4, gpus="", slurm_gpus="0,1,2,3") for r in range(2)],
        [("warning", rank, "CUDA_VISIBLE_DEVICES is empty, though Slurm gave this step GPU(s) "
                           "0,1,2,3: this rank trains on the CPU") for rank in range(2)]),
    "two ranks on one GPU": ([_report(0, gpus="0"), _report(1, gpus="0")],
                             [("error", 1, "GPU 0 is driven by ranks 0, 1")]),
    "the same GPU id on two hosts is two GPUs": (
        [_report(0, gpus="0"), _report(1, host="n2", gpus="0")], []),
    "--gpus-per-task with NCCL": (
        [_report(r, gpus="0", gpus_per_task=1, collective="nccl", node_gpus=2) for r in range(2)],
        [("warning", rank, "--gpus-per-task gives each task only its own GPU")
         for rank in range(2)]),
    "a step on fewer nodes than the job": (
        [_report(0, local_world_size=1, step_nodes=1, job_nodes=2)],
        [("warning", 0, "this step runs on 1 of the job's 2 nodes")]),
    "a 1-task step in a 4-task-per-node job": (
        [_report(0, local_world_size=1, job_tasks_per_node=4)],
        [("warning", 0, "1 task(s) on this node, where the job asked for 4 per node")]),
    "Horovod given 4 GPUs per process": (
        [_report(0, local_world_size=1, backend="horovod", gpus="0,1,2,3", gpu_share=4)],
        [("warning", 0, "Horovod drives one GPU per process, and this process was given 4")]),
    "torch given 2 GPUs per process": (
        [_report(r, backend="ddp", gpus=f"{2 * r},{2 * r + 1}", gpu_share=2) for r in range(2)],
        [("warning", rank, "DistributedDataParallel drives one GPU per process")
         for rank in range(2)]),
    "MWMS drives 4 GPUs per process": (
        [_report(0, local_world_size=1, gpus="0,1,2,3", gpu_share=4, replicas=4)], []),
    "TensorFlow 2.13 from a site's module": (
        [_report(r, versions={**VERSIONS, "tensorflow": "2.13.1"}) for r in range(2)],
        [("warning", None, "TensorFlow 2.13.1 is older than the oldest release tfdist is "
                           "tested on (2.15 to 2.22)")]),
    "a TensorFlow newer than tested": (
        [_report(0, versions={**VERSIONS, "tensorflow": "2.23.0rc1"})],
        [("warning", None, "TensorFlow 2.23.0rc1 is newer than the newest release")]),
    "the oldest tested TensorFlow": (
        [_report(0, versions={**VERSIONS, "tensorflow": "2.15.1"})], []),
    "an old TensorFlow beside a torch job": (
        [_report(0, backend="ddp", versions={**VERSIONS, "tensorflow": "2.11.0"})], []),
    "no TensorFlow": ([_report(0, backend="horovod", versions={"python": "3.11.7"})], []),
    "ranks on different backends": (
        [_report(0), _report(1), _report(2, backend="horovod")],
        [("error", 2, "will use backend 'horovod' where the others use 'mwms'")]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checks(case):
    reports, expected = CASES[case]
    found = check(reports)
    assert [(p.severity, p.rank) for p in found] == [(s, r) for s, r, _ in expected]
    for problem, (_, _, words) in zip(found, expected, strict=True):
        assert words in problem.what
        assert problem.severity == "warning" or problem.fix or problem.what.startswith("backend")


def test_the_tested_tensorflow_range_is_the_lanes_pins():
    def pinned(lane: str) -> tuple[int, ...]:
        text = (ROOT / "requirements" / lane).read_text()
        version = re.search(r"^tensorflow(?:[-_]cpu)?==(\d+)\.(\d+)", text, re.M)
        assert version, lane
        return tuple(map(int, version.groups()))

    assert (pinned("tf215.txt"), pinned("tf222.txt")) == TESTED_TENSORFLOW
    assert TESTED_TENSORFLOW[0] <= pinned("test.txt") <= TESTED_TENSORFLOW[1]


FRAMEWORKS = {
    # name: (--framework, installed modules, Keras's backend, TFDIST_BACKEND, engine checked)
    "asked for": ("torch", {"tensorflow", "torch"}, "tensorflow", None, "torch"),
    "TensorFlow installed": ("auto", {"tensorflow", "torch"}, "tensorflow", None, "tf"),
    "Keras on JAX, TensorFlow installed": ("auto", {"tensorflow", "jax"}, "jax", None, "tf"),
    # A JAX machine without TensorFlow (seen on a GPU machine: PyTorch and JAX, no TensorFlow)
    # once had its torch engine checked, not the Keras on JAX it trains with.
    "Keras on JAX, no TensorFlow": ("auto", {"jax", "keras", "torch"}, "jax", None, "tf"),
    "Keras on JAX without jax": ("auto", {"keras", "torch"}, "jax", None, "torch"),
    "neither": ("auto", {"torch"}, "tensorflow", None, "torch"),
    "one of PyTorch's backends": ("auto", {"tensorflow", "torch"}, "tensorflow", "deepspeed",
                                  "torch"),
}


@pytest.mark.parametrize("case", sorted(FRAMEWORKS))
def test_the_engine_checked_is_the_one_training_starts(case, monkeypatch):
    requested, installed, keras, backend, expected = FRAMEWORKS[case]
    monkeypatch.delenv("TFDIST_BACKEND", raising=False)
    if backend:
        monkeypatch.setenv("TFDIST_BACKEND", backend)
    assert doctor._framework(requested, installed.__contains__, keras) == expected


@pytest.mark.parametrize(("backend", "gpus", "cpu_replicas", "expected"), [
    ("mwms", 4, 1, 4),       # one replica per GPU of the process
    ("mirrored", 2, 1, 2),
    ("mwms", 0, 1, 1),       # the CPU
    ("mwms", 0, 3, 3),       # TFDIST_CPU_REPLICAS
    ("mirrored", 0, 2, 2),
    ("mwms", 2, 3, 2),       # GPUs win over the CPU stand-in
    ("horovod", 4, 1, 1),    # one device per process, whatever it was given
    ("ddp", 2, 1, 1),
    ("single", 4, 2, 1),     # TensorFlow's default strategy
])
def test_replicas_per_process(backend, gpus, cpu_replicas, expected):
    framework = "torch" if backend == "ddp" else "tf"
    assert replicas(facts.backend(backend, framework), gpus, cpu_replicas) == expected


def test_a_problem_reads_as_one_line_with_the_fix():
    line = Problem(3, "gpu07", "cannot listen on port 20480: Address already in use.",
                   "set TFDIST_PORT_BASE to a free range").line()
    assert line == ("error: rank 3 (host gpu07): cannot listen on port 20480: Address already in "
                    "use. Fix: set TFDIST_PORT_BASE to a free range.")


def test_table_and_helpers():
    assert ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranges([]) == ""
    text = table([_report(1, address="n1:20001", cpus="4-7", gpus="1", slurm_gpus="0,1"),
                  _report(0, address="n1:20000", cpus="0-3", gpus="0")])
    rows = text.splitlines()
    assert rows[0].split() == ["rank", "host", "local", "cpus", "gpus", "replicas", "address",
                               "backend"]
    assert rows[1].split()[:7] == ["0", "n1", "0/2", "0-3", "0", "1", "n1:20000"]
    assert rows[2].split()[:8] == ["1", "n1", "1/2", "4-7", "1", "(slurm", "0,1)", "1"]
    assert "versions: python 3.11.7, tensorflow 2.21.0, keras 3.15.1, tfdist 0.1.0" in text
    assert "replicas: 2 in all" in text
    two_nodes = table([_report(r, host=f"n{r}", local_rank=0, local_world_size=1,
                               gpus="0,1,2,3", replicas=4) for r in range(2)])
    assert two_nodes.splitlines()[1].split()[4:6] == ["0,1,2,3", "4"]
    assert "replicas: 8 in all" in two_nodes
    round_trip = RankReport.from_dict(json.loads(json.dumps(_report(0).to_dict())))
    assert round_trip == _report(0)
    # nccl-tests' bus bandwidth: 2 (n - 1) / n of the bytes per second.
    assert bus_bandwidth(1e9, 4, 1.0) == pytest.approx(1.5)
    assert bus_bandwidth(1e9, 1, 1.0) == 0.0


def _tfdist_env(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tfdist", "env", *args], cwd=ROOT,
                          env=clean_env("CUDA_VISIBLE_DEVICES", **extra), capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize(("extra", "backend", "gpus", "replicas"), [
    # CUDA_VISIBLE_DEVICES unset: a replica on each GPU the framework counts, else the CPU's.
    ({"TFDIST_CPU_REPLICAS": "3"}, "mirrored", "counted by the framework", node_gpus() or 3),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "mirrored", "0,1,2,3", 4),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "TFDIST_BACKEND": "horovod"}, "horovod", "0,1,2,3", 1),
    ({"CUDA_VISIBLE_DEVICES": "", "TFDIST_CPU_REPLICAS": "2", "TFDIST_BACKEND": "single"},
     "single", "none (CPU)", 1),
])
def test_tfdist_env_shows_the_gpus_and_replicas_of_this_process(extra, backend, gpus, replicas):
    run = _tfdist_env("--json", **extra)
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)  # nothing else on stdout, warnings included
    assert (shown["backend"], shown["gpus"], shown["replicas"]) == (backend, gpus, replicas)
    idle = [line for line in shown["problems"] if "stay idle" in line]
    assert bool(idle) == (backend == "horovod"), shown["problems"]


def test_tfdist_env_warns_of_idle_gpus_on_stderr():
    run = _tfdist_env(CUDA_VISIBLE_DEVICES="0,1", TFDIST_BACKEND="horovod")
    assert run.returncode == 0, run.stderr
    assert "gpus: 0,1\nreplicas: 1\n" in run.stdout
    assert run.stderr.startswith("tfdist env: warning: rank 0 (host ")
    assert "Horovod drives one GPU per process, and this process was given 2" in run.stderr


@pytest.mark.gpu
def test_tfdist_env_shows_the_machines_gpus():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the machine's: the gpu mark
    run = _tfdist_env("--json", **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    if visible is None:  # the framework counts them: a replica on each of the node's GPUs
        expected = ("counted by the framework", node_gpus())
    else:
        ids = [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
        expected = (",".join(ids), len(ids))
    assert (shown["backend"], shown["gpus"], shown["replicas"]) == ("mirrored", *expected)
    assert not shown["problems"], shown["problems"]


# --- real processes ----------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_the_doctor_is_quiet_unless_asked():
    # TensorFlow 2.21 prints its start-up lines whatever TF_CPP_MIN_LOG_LEVEL says; the doctor
    # imports TensorFlow as training does, through tfdist's filter. Which lines come depends on
    # the CPU (oneDNN's notice only where oneDNN is on by default), so any of them counts.
    # TF_CPP_* dropped: a test's in-process tfdist.init leaves TF_CPP_MIN_LOG_LEVEL=1 in the
    # test process's environment, which hides the control's lines too (seen under xdist).
    runs = {verbose: subprocess.run([sys.executable, "-m", "tfdist", "doctor"], cwd=ROOT,
                                    env=clean_env("TF_CPP", TFDIST_VERBOSE=verbose),
                                    capture_output=True, text=True, timeout=120, check=False)
            for verbose in ("0", "1")}
    for run in runs.values():
        assert run.returncode == 0 and "tfdist doctor: ready" in run.stdout, run.stderr
    noise = {verbose: [line for line in run.stderr.splitlines() if quiet.is_noise(line)]
             for verbose, run in runs.items()}
    assert not noise["0"], runs["0"].stderr
    assert noise["1"], runs["1"].stderr  # the control: TensorFlow does print them here

def _env(**extra: str) -> dict[str, str]:
    return clean_env("NCCL_", "GLOO_", PYTHONUNBUFFERED="1", **extra)


def _doctor(*args: str, n: int = 2, python: str = sys.executable, timeout: float = 180,
            **extra: str) -> tuple[int, str, float]:
    began = time.monotonic()
    done = subprocess.run([python, "-m", "tfdist", "launch", "-n", str(n), *args],
                          cwd=ROOT, env=_env(**extra), capture_output=True, text=True,
                          timeout=timeout, check=False)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


@pytest.mark.multiprocess
@pytest.mark.parametrize("framework", ["tf", "torch"])
def test_a_good_plan_passes(framework, tmp_path):
    # The TensorFlow plan also checks a model_dir every rank shares (tests/test_model_dir.py
    # checks one that is node-local scratch).
    folder = tmp_path / "model"
    more = ("--model-dir", str(folder)) if framework == "tf" else ()
    code, out, _ = _doctor("-m", "tfdist", "doctor", "--framework", framework,
                           "--bandwidth", "1", *more)
    assert code == 0, out[-3000:]
    if more:
        assert f"tfdist doctor: model_dir {folder}: every rank writes it and sees the same " \
            "folder" in out, out[-3000:]
        assert os.listdir(folder) == []  # the marks are removed
    host = socket.gethostname()
    for rank in (0, 1):
        assert f"[0] {rank}     {host}" in out, out
    engine = "mwms ring" if framework == "tf" else "torch gloo"
    assert f"all-reduce across 2 rank(s) over {engine}: correct" in out
    assert "1 MB all-reduce:" in out and "GB/s bus bandwidth" in out
    assert "tfdist doctor: ready: 2 rank(s) on 1 host(s)" in out


def test_one_process_is_checked_too():
    # A one-process doctor has no meeting and no engine gather: its own report is checked
    # alone (it once said "ready" here).
    done = subprocess.run([sys.executable, "-m", "tfdist", "doctor"], cwd=ROOT,
                          env=_env(NCCL_SOCKET_IFNAME="nosuch0"), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "error: rank 0" in done.stderr and "NCCL_SOCKET_IFNAME=nosuch0 selects no " \
        "network interface" in done.stderr
    assert "ready" not in done.stdout


@pytest.mark.parametrize("entry", ["import tfdist.torch", "tfdist doctor --framework torch"])
def test_a_python_without_torch_is_told_how_to_install_it(entry):
    # The TensorFlow 2.15 lane has no torch; here it is hidden (sys.modules["torch"] = None).
    hide = "import sys; sys.modules['torch'] = None; "
    code = {"import tfdist.torch": hide + "import tfdist.torch",
            "tfdist doctor --framework torch": hide + "from tfdist.cli import main; "
            "raise SystemExit(main(['doctor', '--framework', 'torch']))"}[entry]
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert "tfdist.torch needs PyTorch, which is not installed in this Python" in done.stderr
    assert "pip install 'tfdist[torch]'" in done.stderr
    if entry.startswith("tfdist doctor"):  # tfdist's one line, no traceback
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("tfdist: --framework torch: ")
        assert "or check TensorFlow with --framework tf" in done.stderr
    else:
        assert "ModuleNotFoundError" in done.stderr


@pytest.mark.multiprocess
@needs("horovod", python=HVD_PY)
def test_a_good_plan_passes_under_horovod():
    # tfdist launch --backend horovod gives no address per rank: the reports travel through
    # Horovod's own allgather, after its all-reduce.
    code, out, _ = _doctor("--backend", "horovod", "-m", "tfdist", "doctor", python=str(HVD_PY))
    assert code == 0, out[-3000:]
    assert "all-reduce across 2 rank(s) over horovod gloo: correct" in out
    assert "horovod 0.28.1" in out and f"[0] 1     {socket.gethostname()}" in out


@pytest.mark.multiprocess
def test_an_interface_no_node_has_fails_at_once_on_every_rank():
    code, out, took = _doctor("-m", "tfdist", "doctor", NCCL_SOCKET_IFNAME="ib9")
    assert code == 1, out
    host = socket.gethostname()
    for rank in (0, 1):
        assert (f"error: rank {rank} (host {host}): NCCL_SOCKET_IFNAME=ib9 selects no network "
                "interface here") in out
    assert "rank 1 stops: rank 0's output lists 2 problem(s)" in out
    # Rank 1's own output repeats its own problem (srun --output=task-%t.out), and only its own.
    assert f"[1] tfdist doctor: error: rank 1 (host {host}): NCCL_SOCKET_IFNAME=ib9" in out, out
    assert "[1] tfdist doctor: error: rank 0" not in out, out
    assert "all-reduce" not in out  # stopped before the engine started
    assert took < 30, took


@pytest.mark.multiprocess
def test_a_port_held_by_another_process_is_named(tmp_path):
    # A launch by hand (TF_CONFIG) or by Slurm (ports derived from the job) meets the doctor's
    # check; `tfdist launch --port-base` refuses a held port before any worker starts
    # (test_uncaught.py).
    with socket.create_server(("", 0)) as holder:
        port = holder.getsockname()[1]
        codes, (out, _), took = _by_hand(
            tmp_path, [sys.executable] * 2, [f"127.0.0.1:{port}", f"127.0.0.1:{_free_port()}"],
            "--timeout", "3")
    assert codes[0] == 1, out
    assert (f"error: rank 0 (host {socket.gethostname()}): cannot listen on port {port}: "
            "Address already in use. Fix: another process holds the port") in out
    assert took < 30, took


def _by_hand(tmp_path, pythons: list[str], addresses: list[str], *args: str
             ) -> tuple[list[int], list[str], float]:
    """Starts one doctor per rank with its own TF_CONFIG, as a hand-written launch would."""
    procs = []
    began = time.monotonic()
    for rank, python in enumerate(pythons):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([python, "-m", "tfdist", "doctor", *args], cwd=ROOT,
                                       env=_env(TF_CONFIG=json.dumps(config)), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=120))
        finally:
            proc.kill()
            log.close()
    took = time.monotonic() - began
    return codes, [(tmp_path / f"rank{r}.log").read_text() for r in range(len(procs))], took


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@pytest.mark.multiprocess
def test_a_coordinator_that_does_not_route_is_named_by_both_sides(tmp_path):
    # Rank 0's address is in TEST-NET-1 (RFC 5737), which no host has: rank 1's connections
    # fail as through a firewall that drops them; rank 0 listens and sees nobody come.
    port = _free_port()
    codes, (out0, out1), took = _by_hand(
        tmp_path, [sys.executable] * 2, [f"192.0.2.1:{port}", f"127.0.0.1:{_free_port()}"],
        "--timeout", "4")
    assert codes == [1, 1], (out0, out1)
    host = socket.gethostname()
    assert (f"error: rank 1 (host {host}): cannot reach rank 0 at 192.0.2.1:{port} within 4 s"
            in out1), out1
    assert f"error: rank 1 (host 127.0.0.1): did not reach rank 0's port {port} within 4 s" \
        in out0, out0
    assert took < 40, took


@pytest.mark.multiprocess
@pytest.mark.skipif(not OTHER_PY.exists(), reason="needs .venv-horovod (make venv-horovod)")
def test_a_rank_with_other_versions_is_named(tmp_path):
    addresses = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    codes, (out0, out1), took = _by_hand(tmp_path, [sys.executable, str(OTHER_PY)], addresses,
                                         "--timeout", "20")
    # Rank 0 alone fails, after rank 1 has exited: a launcher that ends the step at the first
    # failure (srun --kill-on-bad-exit) so cuts no rank's output.
    assert codes == [1, 0], (out0, out1)
    # Two ranks, one each: the odd one out is whichever is not rank 0's.
    assert "error: rank 1 (host" in out0 and "runs tensorflow 2.18.1 where 1 of 2 ranks run" \
        in out0, out0
    assert "Fix: start every rank with the same environment" in out0
    assert "rank 1 stops: rank 0's output lists" in out1
    assert took < 30, took


def test_dry_run_checks_this_process_and_plans_the_others(tmp_path):
    config = {"cluster": {"worker": ["127.0.0.1:20000", "localhost:20001", "nx-9:20000"]},
              "task": {"type": "worker", "index": 0}}
    done = subprocess.run([sys.executable, "-m", "tfdist", "doctor", "--dry-run", "--hosts",
                           "localhost"], cwd=ROOT, capture_output=True, text=True, check=False,
                          env=_env(TF_CONFIG=json.dumps(config),
                                   TFDIST_HOST_TEMPLATE="{host}"))
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:5]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert rows[2][1:4] == ["nx-9", "0/1", "-"] and rows[2][-3] == "nx-9:20000"
    assert "nothing was dialled" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "tfdist", "doctor", "--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, check=False,
                         env=_env(TFDIST_BACKEND="mwm", GLOO_SOCKET_IFNAME="nope0"))
    assert bad.returncode == 1
    assert "error: rank 0" in bad.stderr and "backend 'mwm' is not one of" in bad.stderr
    assert "GLOO_SOCKET_IFNAME=nope0 selects no network interface" in bad.stderr
