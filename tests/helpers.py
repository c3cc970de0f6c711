"""Helpers the test modules share: paths, `tfdist launch` runs, worker outputs.

Imported by name (`from helpers import launch`); conftest.py only loads pytest plugins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

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


# Variables by which a process would think a launcher started it (tfdist.env reads them).
LAUNCH_PREFIXES = ("TF_CONFIG", "SLURM_", "OMPI_", "PMI", "HOROVOD_", "TFDIST_")


def clean_env(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without the launchers' variables (and those starting with
    ``drop``), plus ``extra``: a child started with it is one plain process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith((*LAUNCH_PREFIXES, *drop))}
    return {**env, **extra}


def launch(args: list[str], *, n: int = 2, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Runs `python -m tfdist launch -n N ARGS...` and returns its merged output."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    full_env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", str(n), *args],
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
