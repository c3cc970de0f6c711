"""Puts a folder on the path of the processes that ask for Keras on JAX, and only theirs.

Usage (with the environment's own Python): ``python tools/jax_apart.py FOLDER``.

The Makefile installs JAX in ``.venv/jax/`` rather than in the environment's site-packages:
TensorFlow imports JAX at start-up wherever it can import it (``tensorflow.lite``'s
``from jax import jit``), 1.4 s of a TensorFlow process's 10 s import on the test machine, and
most of the tests' processes are TensorFlow processes that never use JAX. A ``.pth`` file in
site-packages, run by ``site`` at every start of this environment's Python, puts the folder first
on ``sys.path`` where ``KERAS_BACKEND`` is ``jax`` (the variable every Keras-on-JAX process of
the tests, the examples and the rendered jobs carries; Keras reads it the same way).
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

NAME = "tfdist-jax-apart.pth"


def line(folder: Path) -> str:
    """The ``.pth`` line: ``site`` runs a line that starts with ``import``."""
    return ("import os, sys; os.environ.get('KERAS_BACKEND', '').strip().lower() == 'jax' "
            f"and sys.path.insert(0, {str(folder)!r})\n")


def main(folder: str) -> None:
    target = Path(folder).resolve()
    if not (target / "jax").is_dir():
        sys.exit(f"jax_apart: {target} holds no jax package (pip install --target it first)")
    pth = Path(site.getsitepackages()[0]) / NAME
    pth.write_text(line(target), encoding="utf-8")
    print(f"jax_apart: {pth} puts {target} on the path where KERAS_BACKEND=jax")


if __name__ == "__main__":
    main(*sys.argv[1:2])
