"""pytest plugin: ``slurm_cluster``, a real Slurm cluster of three nodes on this machine.

The session-scoped fixture starts ``tests/slurm/cluster.sh`` when no cluster is running and
stops it at the end of the session only if this session started it and no other pytest session
still uses it (a cluster started by hand stays up). Where the cluster cannot run (not root, no
Slurm packages, no network namespaces) every test that uses the fixture skips with the reason.

Example::

    def test_two_nodes(slurm_cluster):
        job = slurm_cluster.run_job(f'''
            #SBATCH --nodes=2 --ntasks-per-node=2
            srun --output=task-%t.out {slurm_cluster.python} -m tfdist env --json
        ''')
        assert job.ok, job.describe()
        print(job.read("task-0.out"))

Jobs run as root inside the nodes' namespaces with the fixture's clean environment
(``SlurmCluster.env``): sbatch exports the submitter's environment, so that is what a job sees.
Tests that use the fixture are marked ``slurm`` (deselect them with ``-m "not slurm"``).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["JobResult", "SlurmCluster", "SlurmJobTimeoutError", "slurm_cluster"]

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SH = ROOT / "tests" / "slurm" / "cluster.sh"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
_SKIP = 3  # cluster.sh's exit code for "this machine cannot run the cluster"
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


class SlurmJobTimeoutError(TimeoutError):
    """A job did not end within its deadline; it has been cancelled."""


@dataclass(frozen=True)
class JobResult:
    """How a batch job ended, and where its files are.

    Attributes:
        job_id: Slurm's job id.
        state: the final ``JobState``: ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``...
        exit_code: the batch script's exit status (``ExitCode=N:S``, N).
        signal: the signal that ended it, or 0 (``ExitCode=N:S``, S).
        workdir: the job's working directory (per-task files written with relative names).
        stdout_path: the batch script's output file (``StdOut``).
        seconds: how long :meth:`SlurmCluster.wait` waited (for ``run_job``: about the time
            from submission to the job's end).
        info: every field of ``scontrol show job -o``.
    """

    job_id: str
    state: str
    exit_code: int
    signal: int
    workdir: Path
    stdout_path: Path
    seconds: float
    info: dict[str, str] = field(repr=False)

    @property
    def ok(self) -> bool:
        """True if the job completed with exit status 0."""
        return self.state == "COMPLETED" and self.exit_code == 0

    @property
    def output(self) -> str:
        """The batch script's output ('' if it wrote none)."""
        return self.stdout_path.read_text() if self.stdout_path.exists() else ""

    def path(self, name: str) -> Path:
        """A file in the job's working directory, e.g. one written by ``srun --output=%t.out``."""
        return self.workdir / name

    def read(self, name: str) -> str:
        """The text of a file in the job's working directory."""
        return self.path(name).read_text()

    def describe(self) -> str:
        """State, exit code and output, for assertion messages."""
        return (f"job {self.job_id}: {self.state}, exit code {self.exit_code}:{self.signal}, "
                f"{self.seconds:.1f} s, reason {self.info.get('Reason')}; output "
                f"({self.stdout_path}):\n{self.output[-4000:]}")


@dataclass
class SlurmCluster:
    """The running test cluster and helpers to use it.

    Attributes:
        base_dir: the cluster's state directory (``TFDIST_SLURM_DIR``, default
            ``/tmp/tfdist-slurm``): config in ``etc/``, daemon logs in ``log/``.
        nodes: node names in Slurm's order: ``("n9", "n10", "n11")``.
        addresses: each node's IP address on the cluster's private /24.
        partition: the default partition's name.
        gres_type: the fake GPUs' type, as in ``--gpus-per-node=fake:2``.
        gpus_per_node: fake GPUs per node.
        cpus_per_node: CPUs each node advertises (more than the machine has).
        standins_dir: the directory of the apptainer stand-in; first on ``env["PATH"]``.
        pyxis_standin: whether the pyxis stand-in plugin is loaded (``--container-*``).
        python: the checkout's virtualenv python, which jobs can run as it is.
        env: a clean environment for client commands and jobs: ``SLURM_CONF``, ``PATH`` (the
            stand-ins, the virtualenv, the system), ``HOME``, ``LANG`` and the Open MPI root
            switches; no ``SLURM_*`` job variables and no ``TF_CONFIG`` from the caller.
    """

    base_dir: Path
    nodes: tuple[str, ...]
    addresses: dict[str, str]
    partition: str
    gres_type: str
    gpus_per_node: int
    cpus_per_node: int
    standins_dir: Path
    pyxis_standin: bool
    python: str
    env: dict[str, str]

    @classmethod
    def from_script(cls) -> SlurmCluster:
        """Reads the cluster's settings from ``cluster.sh env``."""
        out = _cluster_sh("env", timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"cluster.sh env failed: {out.stderr}")
        pairs = [shlex.split(line)[1].split("=", 1) for line in out.stdout.splitlines()]
        values = {key: value for key, value in pairs if key.startswith(("SLURM_", "TFDIST_"))}
        standins = Path(values["TFDIST_SLURM_STANDINS"])
        python_bin = Path(sys.executable).parent
        path = os.pathsep.join([str(standins), str(python_bin), "/usr/local/sbin",
                                "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
        env = {"PATH": path, "SLURM_CONF": values["SLURM_CONF"],
               "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        return cls(base_dir=Path(values["TFDIST_SLURM_DIR"]),
                   nodes=tuple(values["TFDIST_SLURM_NODES"].split(",")),
                   addresses=dict(pair.split("=") for pair in
                                  values["TFDIST_SLURM_ADDRESSES"].split(",")),
                   partition=values["TFDIST_SLURM_PARTITION"],
                   gres_type=values["TFDIST_SLURM_GRES_TYPE"],
                   gpus_per_node=int(values["TFDIST_SLURM_GPUS_PER_NODE"]),
                   cpus_per_node=int(values["TFDIST_SLURM_CPUS_PER_NODE"]),
                   standins_dir=standins, pyxis_standin=values["TFDIST_SLURM_PYXIS_STANDIN"] == "1",
                   python=sys.executable, env=env)

    def job_env(self, **extra: str) -> dict[str, str]:
        """The clean environment plus ``extra`` variables."""
        return {**self.env, **extra}

    def run(self, *argv: str, env: dict[str, str] | None = None, cwd: Path | str | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs a client command (``srun``, ``scontrol``, ``sinfo``...) from this machine.

        Args:
            argv: the command and its arguments.
            env: its environment (default: :attr:`env`).
            cwd: its working directory (default: ``base_dir``).
            timeout: seconds before it is killed (``subprocess.TimeoutExpired``).

        Returns:
            The finished process, stdout and stderr captured as text; the exit code is not
            checked.
        """
        return subprocess.run(list(argv), env=env or self.env, cwd=cwd or self.base_dir,
                              capture_output=True, text=True, timeout=timeout, check=False)

    def srun(self, *args: str, timeout: float = 60.0,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Runs ``srun ARGS...`` from this machine (like a login node), in a fresh directory."""
        return self.run("srun", *args, env=env, cwd=self.new_workdir(), timeout=timeout)

    def new_workdir(self) -> Path:
        """A fresh directory for one job, visible on every node."""
        jobs = self.base_dir / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="job-", dir=jobs))

    def sbatch(self, script: str | Path, *args: str, env: dict[str, str] | None = None,
               cwd: Path | str | None = None) -> str:
        """Submits a batch job and returns its id.

        Args:
            script: a script file, or the script's text (dedented; ``#!/bin/bash`` is added
                when it has no ``#!`` line). Text is written to ``job.sh`` in ``cwd``.
            args: sbatch options (before the script).
            env: the environment sbatch runs with, and so the job's (default: :attr:`env`).
            cwd: the job's working directory (default: a fresh one under ``base_dir/jobs``);
                the default output file ``slurm-JOBID.out`` and relative paths land there.

        Raises:
            RuntimeError: sbatch refused the job (its message included).
        """
        workdir = Path(cwd) if cwd else self.new_workdir()
        path = _script_file(script, workdir)
        out = self.run("sbatch", "--parsable", *args, str(path), env=env, cwd=workdir,
                       timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} {path} failed ({out.returncode}): "
                               f"{out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """Every field of ``scontrol show job -o JOB_ID``."""
        out = self.run("scontrol", "show", "job", "-o", job_id, timeout=15)
        if out.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id} failed: {out.stderr.strip()}")
        return _parse_fields(out.stdout.strip())

    def wait(self, job_id: str, timeout: float = 60.0) -> JobResult:
        """Polls the job until it ends (faster than ``sbatch --wait``).

        Raises:
            SlurmJobTimeoutError: still not ended after ``timeout`` seconds; the job is cancelled
                and the message holds its state, reason and output so far.
        """
        start = time.monotonic()
        delay = 0.05
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return _result(job_id, info, time.monotonic() - start)
            if time.monotonic() - start > timeout:
                self.cancel(job_id)
                partial = _result(job_id, info, time.monotonic() - start)
                raise SlurmJobTimeoutError(f"still {info.get('JobState')} after {timeout:.0f} s, "
                                      f"cancelled: {partial.describe()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def run_job(self, script: str | Path, *args: str, env: dict[str, str] | None = None,
                cwd: Path | str | None = None, timeout: float = 60.0) -> JobResult:
        """:meth:`sbatch` then :meth:`wait`; see there for the arguments."""
        return self.wait(self.sbatch(script, *args, env=env, cwd=cwd), timeout=timeout)

    def cancel(self, job_id: str) -> None:
        """Cancels a job (no error if it has ended)."""
        self.run("scancel", job_id, timeout=15)


def _script_file(script: str | Path, workdir: Path) -> Path:
    if isinstance(script, Path) or ("\n" not in script and Path(script).is_file()):
        return Path(script).resolve()
    text = textwrap.dedent(script).lstrip("\n")
    if not text.startswith("#!"):
        text = "#!/bin/bash\n" + text
    path = workdir / "job.sh"
    path.write_text(text)
    return path


def _parse_fields(line: str) -> dict[str, str]:
    matches = list(_FIELD.finditer(line))
    ends = [m.start() for m in matches[1:]] + [len(line)]
    return {m.group(1): line[m.end():end].strip() for m, end in zip(matches, ends, strict=True)}


def _result(job_id: str, info: dict[str, str], seconds: float) -> JobResult:
    code, _, sig = info.get("ExitCode", "0:0").partition(":")
    workdir = Path(info.get("WorkDir", "."))
    return JobResult(job_id=job_id, state=info.get("JobState", "UNKNOWN"), exit_code=int(code),
                     signal=int(sig or 0), workdir=workdir,
                     stdout_path=Path(info.get("StdOut", workdir / f"slurm-{job_id}.out")),
                     seconds=seconds, info=info)


# --- starting and stopping --------------------------------------------------------------------

def _cluster_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(CLUSTER_SH), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _base_dir() -> Path:
    return Path(os.environ.get("TFDIST_SLURM_DIR", "/tmp/tfdist-slurm"))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        deadline = time.monotonic() + 180
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} has been locked for 180 s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire(base: Path) -> None:
    """Starts the cluster unless it runs, and registers this session as a user."""
    with _locked(base / "leases.lock"):
        # A no-op when it runs (and was started from the current tests/slurm files).
        out = _cluster_sh("start", timeout=120)
        if out.returncode == _SKIP:
            pytest.skip(f"Slurm test cluster: {out.stderr.strip()}")
        if out.returncode != 0:
            pytest.fail(f"tests/slurm/cluster.sh start failed ({out.returncode}):\n"
                        f"{out.stdout}{out.stderr}", pytrace=False)
        if "already running" not in out.stderr:
            # Marks the cluster as the tests' own: the last session using it stops it.
            (base / "run" / "autostarted").write_text(out.stderr)
        (base / "leases").mkdir(exist_ok=True)
        (base / "leases" / str(os.getpid())).touch()


def _release(base: Path) -> None:
    """Unregisters this session; stops the cluster if the tests started it and none use it."""
    with _locked(base / "leases.lock"):
        (base / "leases" / str(os.getpid())).unlink(missing_ok=True)
        users = [p for p in (base / "leases").iterdir() if p.name.isdigit()]
        alive = [p for p in users if _pid_alive(int(p.name))]
        for stale in set(users) - set(alive):
            stale.unlink(missing_ok=True)
        if not alive and (base / "run" / "autostarted").exists():
            _cluster_sh("stop", timeout=60)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The running Slurm test cluster; see :class:`SlurmCluster`."""
    check = _cluster_sh("check", timeout=30)
    if check.returncode == _SKIP:
        pytest.skip(f"Slurm test cluster: {check.stdout.strip()}")
    if check.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh check failed: {check.stdout}{check.stderr}",
                    pytrace=False)
    base = _base_dir()
    _acquire(base)
    try:
        yield SlurmCluster.from_script()
    finally:
        _release(base)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: uses the Slurm test cluster (needs root, slurm-wlm and network "
        "namespaces; skips with the reason otherwise)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
