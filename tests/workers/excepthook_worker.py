"""A rank that fails with a long traceback and ends at once, under tfdist's failure hook.

    srun -N2 --kill-on-bad-exit=1 python excepthook_worker.py

No framework: the process ends as soon as Python has printed the traceback (TensorFlow's and
PyTorch's teardown take a moment more, which hides the loss this worker shows). Rank 1 raises
20 frames deep half a second in; rank 0 waits, as a rank in a collective would, until srun ends
the step. Rank 1's error must reach srun's output: the lines a task writes just before the step
ends are dropped (tfdist.failures.linger).
"""

from __future__ import annotations

import time

from tfdist import failures
from tfdist.env import detect

environment = detect()
failures.install(environment)


def _deep(frames: int) -> None:
    if frames == 0:
        raise ValueError(f"the cause, on rank {environment.rank}")
    _deep(frames - 1)


if environment.rank == 1:
    time.sleep(0.5)
    _deep(20)
time.sleep(10)
