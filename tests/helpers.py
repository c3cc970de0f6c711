"""Helpers the test modules share: paths, `tfdist launch` runs, worker outputs, and the skips
of tests whose optional packages are not installed.

Imported by name (`from helpers import launch`); conftest.py only loads pytest plugins.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def _horovod_python() -> Path:
    """The Python whose environment has Horovod: this one where Horovod is installed (the
    TensorFlow 2.15 lane's .venv-tf215), else .venv-horovod's (built by `make venv-horovod`).
    Not resolved: a venv's python is a link, and its environment is found through the link."""
    if importlib.util.find_spec("horovod") is not None:
        return Path(sys.executable)
    return ROOT / ".venv-horovod" / "bin" / "python"


# The Horovod tests' workers run under this Python; horovodrun is in its bin/.
HOROVOD_PYTHON = _horovod_python()

# What the Horovod tests ask of HOROVOD_PYTHON's Horovod, in one subprocess (its imports of
# TensorFlow and torch take seconds): each import's error or None, and what Horovod was built with.
_HOROVOD_PROBE = """
import json, os, traceback
found = {"tensorflow": None, "torch": None, "keras_major": None, "gloo": False, "mpi": False,
         "torch_mpi": False}
try:
    import horovod.tensorflow as h, keras
    found.update(keras_major=int(keras.__version__.split(".")[0]), gloo=bool(h.gloo_built()),
                 mpi=bool(h.mpi_built()))
except Exception:
    found["tensorflow"] = traceback.format_exc()[-500:]
try:
    import horovod.torch as t
    found["torch_mpi"] = bool(t.mpi_built())
except Exception:
    found["torch"] = traceback.format_exc()[-300:]
print(json.dumps(found))
"""


@functools.cache
def horovod_facts() -> dict[str, object]:
    """What :data:`HOROVOD_PYTHON`'s Horovod can do, asked once per test session: ``"missing"``
    (why that Python does not exist, else None), ``"tensorflow"`` and ``"torch"`` (the error of
    importing horovod.tensorflow, horovod.torch, or None), ``"keras_major"``, ``"gloo"``,
    ``"mpi"`` (built with them: TensorFlow's side) and ``"torch_mpi"``. The processes of one
    pytest-xdist run share one answer (a file named by the run's id, under a lock): each of
    them collects the modules that ask."""
    if not HOROVOD_PYTHON.exists():
        return {"missing": f"{HOROVOD_PYTHON} does not exist: build it with `make venv-horovod`"}
    shared = _shared_with_the_run("horovod")
    if shared is None:
        return _probe_horovod()
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            return json.loads(shared.read_text())
        facts = _probe_horovod()
        shared.write_text(json.dumps(facts))
        return facts


def _shared_with_the_run(name: str) -> Path | None:
    """The file in which the processes of this pytest-xdist run share ``name``'s facts; None
    outside xdist."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return None
    return Path(tempfile.gettempdir()) / f"tfdist-tests-{name}-{run_id}.json"


def forget_shared_facts() -> None:
    """Removes this run's shared facts (:func:`horovod_facts`): at a test process's end, long
    after every process collected."""
    shared = _shared_with_the_run("horovod")
    if shared is not None:
        for path in (shared, Path(f"{shared}.lock")):
            path.unlink(missing_ok=True)


def _probe_horovod() -> dict[str, object]:
    probe = subprocess.run([str(HOROVOD_PYTHON), "-c", _HOROVOD_PROBE], capture_output=True,
                           text=True, timeout=120, check=False,
                           env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                                "TF_USE_LEGACY_KERAS": "0"})
    if probe.returncode:
        error = f"{HOROVOD_PYTHON} does not start: {probe.stderr[-500:]}"
        return {"missing": None, "tensorflow": error, "torch": error}
    return {"missing": None, **json.loads(probe.stdout.strip().splitlines()[-1])}


# `make test` (CI) runs every mechanism on a covering set of backends, Keras versions and
# launchers; `make test-full` sets TFDIST_TEST_MATRIX=full and adds every combination a test
# leaves to the full matrix (with the long soak and the whole TensorFlow 2.15 list). Such a
# case skips in `make test`, naming what runs its mechanism there.
FULL_MATRIX = os.environ.get("TFDIST_TEST_MATRIX", "") == "full"


def full_matrix_only(covered: str) -> pytest.MarkDecorator:
    """The mark of a case run only in the full matrix; ``covered``: what runs its mechanism in
    ``make test``."""
    return pytest.mark.skipif(not FULL_MATRIX, reason="in the full matrix only (make "
                              f"test-full); in make test, {covered}")


# The optional packages tests need, by import name: what pip installs, and how to get it.
OPTIONAL = {
    "tensorflow_datasets": ("tensorflow-datasets", "tfdist[datasets]"),
    "sklearn": ("scikit-learn", "pip install scikit-learn: tfdist ships the digits and needs "
                                "it only to compare them with load_digits"),
    "tensorboard": ("tensorboard", "pip install tensorboard: TensorFlow 2.21 no longer "
                                   "installs it"),
    "matplotlib": ("matplotlib", "tfdist[plot]"),
    "horovod": ("horovod", "make venv-horovod"),
    "deepspeed": ("deepspeed", "requirements/deepspeed.txt"),
    "torch": ("torch", "requirements/torch.txt"),
    "jax": ("jax", "tfdist[jax]"),
}
# What the examples in examples/ import of them (examples/synthetic_benchmark.py: none).
EXAMPLE_NEEDS = {
    "keras_train.py": ("tensorflow_datasets",),
    "custom_loop.py": ("tensorflow_datasets",),
    "torch_train.py": ("torch",),
}


def _shown(python: Path) -> str:
    return str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else str(python)


@functools.cache
def _installed(python: str) -> frozenset[str] | str:
    """The modules of :data:`OPTIONAL` that ``python`` finds (without importing them), or why
    it cannot say. JAX as a process with ``KERAS_BACKEND=jax`` finds it: ``make`` keeps it off
    the others' path (tools/jax_apart.py)."""
    if python == sys.executable:
        found = frozenset(m for m in OPTIONAL if importlib.util.find_spec(m) is not None)
        if "jax" in found:
            return found
        asked = _asked(python)
        return found | ({"jax"} & asked) if isinstance(asked, frozenset) else found
    path = Path(python)
    if not path.exists():
        venv = path.parent.parent.name
        build = f": build it with `make {venv[1:]}`" if venv.startswith(".venv") else ""
        return f"{_shown(path)} does not exist{build}"
    return _asked(python)


def _asked(python: str) -> frozenset[str] | str:
    """The modules of :data:`OPTIONAL` that ``python`` finds, asked in a subprocess that has
    ``KERAS_BACKEND=jax``, or why it cannot say."""
    code = (f"import importlib.util, json; print(json.dumps([m for m in {sorted(OPTIONAL)!r} "
            "if importlib.util.find_spec(m) is not None]))")
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "KERAS_BACKEND": "jax"})
    if run.returncode:
        return f"{_shown(Path(python))} does not start: {run.stderr.strip()[-300:]}"
    return frozenset(json.loads(run.stdout.strip().splitlines()[-1]))


def missing(*modules: str, python: str | os.PathLike[str] | None = None) -> str | None:
    """Why a test that needs ``modules`` (keys of :data:`OPTIONAL`) in ``python`` cannot run,
    in the words of its skip: ``"tensorflow-datasets is not installed (tfdist[datasets])"``;
    None when all are installed.

    Args:
        modules: import names, e.g. ``"sklearn"``.
        python: the Python that runs the code that imports them (a worker's, an example's);
            default: this one. Another Python is asked once per session, in a subprocess.
    """
    python = sys.executable if python is None else os.fspath(python)
    found = _installed(python)
    if isinstance(found, str):
        return found
    where = "" if python == sys.executable else f" in {_shown(Path(python))}"
    reasons = [f"{OPTIONAL[m][0]} is not installed{where} ({OPTIONAL[m][1]})"
               for m in modules if m not in found]
    return "; ".join(reasons) or None


def installed(module: str, python: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``python`` (default: this one) has ``module``, a key of :data:`OPTIONAL`; for a
    check whose expectation follows the package (TensorBoard's logs are written or not)."""
    return missing(module, python=python) is None


def tensorboard_logs(python: str | os.PathLike[str] | None = None) -> list[str]:
    """``["logs"]`` where ``python`` (default: this one) has tensorboard, else ``[]``: the
    folder of TensorBoard's logs in a ``model_dir``, which ``dist.callbacks`` leaves out, with a
    warning, without the package."""
    return ["logs"] if installed("tensorboard", python) else []


def needs(*modules: str, python: str | os.PathLike[str] | None = None) -> pytest.MarkDecorator:
    """A mark that skips the test, with the reason of :func:`missing`, where ``python`` lacks
    one of ``modules``: ``@needs("tensorflow_datasets", "sklearn")``."""
    reason = missing(*modules, python=python)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def require(*modules: str, python: str | os.PathLike[str] | None = None) -> None:
    """Skips the running test or fixture, with the reason of :func:`missing`, where ``python``
    lacks one of ``modules``: for a Python or a module only known at run time."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    reason = missing(*modules, python=python)
    if reason is not None:
        pytest.skip(reason)


# Variables by which a process would think a launcher started it (tfdist.env reads them).
# Every launcher's variables (what tfdist/env/ reads), and tfdist's own settings.
LAUNCH_PREFIXES = ("TF_CONFIG", "SLURM_", "OMPI_", "PMI", "HOROVOD_", "TFDIST_", "MASTER_",
                   "TORCHELASTIC_")
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def clean_env(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without the launchers' variables (and those starting with
    ``drop``), plus ``extra``: a child started with it is one plain process. The one filter of
    launcher variables the tests use."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith((*LAUNCH_PREFIXES, *drop)) and k not in LAUNCH_NAMES}
    return {**env, **extra}


def _unassigned_range() -> tuple[int, int]:
    """Ports the kernel never hands out on its own (outside its ephemeral range, whose ports an
    outgoing connection may take at any moment) and outside the block tfdist derives from Slurm
    job ids (tfdist.env.slurm.PORT_RANGE), which other tests use."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return (high + 1, 65535) if high < 64000 else (10000, min(low, 20000) - 1)


def port_block(count: int = 4) -> int:
    """The first of ``count`` consecutive free ports that no other test of this machine got.

    Why not ``tfdist.launch.free_ports``: a port the kernel picked (bind to port 0) is in the
    ephemeral range, so between the pick and the worker's bind another process's outgoing
    connection, or another test worker's pick, may take it ("Address already in use"). These come
    from outside that range, handed out in turn under a lock shared by every pytest worker.
    """
    first, last = _unassigned_range()
    with open(Path("/tmp") / f"tfdist-test-ports-{os.getuid()}", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        text = handle.read().strip()
        start = int(text) if text.isdigit() else first
        for _ in range((last - first) // count):
            if start + count - 1 > last:
                start = first
            if all(_bindable(port) for port in range(start, start + count)):
                handle.seek(0)
                handle.truncate()
                handle.write(str(start + count))
                return start
            start += count
    raise RuntimeError(f"no {count} consecutive free ports in {first}..{last}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(args: list[str], *, n: int = 2, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs `python -m tfdist launch -n N ARGS...` on ports from `port_block` and returns its
    merged output."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    full_env.pop("TF_CONFIG", None)
    ports = [] if "--port-base" in args else ["--port-base", str(port_block(2 * n + 2))]
    return subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", str(n), *ports, *args],
                          cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def load_weights(out_dir: Path, rank: int) -> list[np.ndarray]:
    with np.load(out_dir / f"weights-{rank}.npz") as f:
        return [f[name] for name in sorted(f.files, key=lambda n: int(n[1:]))]


def load_result(out_dir: Path, rank: int) -> dict:
    return json.loads((out_dir / f"result-{rank}.json").read_text())


_FINAL_WEIGHTS = re.compile(r"^(?:\[\d+\] )?tfdist: rank (\d+) of (\d+): final weights (\S+)\s*$",
                            re.M)


def final_weights(outputs: Mapping[int, str] | Iterable[str]) -> dict[int, tuple[int, str]]:
    """The ``tfdist: rank R of N: final weights HEX`` lines the examples print on every rank
    (also behind ``tfdist launch``'s ``[rank] `` prefix).

    Args:
        outputs: texts to search (per-task outputs by rank, or any texts).

    Returns:
        ``{R: (N, HEX)}``: equal HEX means bit-identical weights.

    Raises:
        ValueError: a rank reported twice.
    """
    texts = outputs.values() if isinstance(outputs, Mapping) else outputs
    found: dict[int, tuple[int, str]] = {}
    for text in texts:
        for match in _FINAL_WEIGHTS.finditer(text):
            rank = int(match.group(1))
            if rank in found:
                raise ValueError(f"rank {rank} reported its final weights twice")
            found[rank] = (int(match.group(2)), match.group(3))
    return found
