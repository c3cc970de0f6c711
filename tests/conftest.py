"""Shared helpers: run real worker processes through `tfdist launch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

pytest_plugins = ["slurmtest"]

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


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

