"""An MWMS fit in which one rank fails on purpose (tests/test_slurm_failures.py).

``fault_fit_worker.py KIND RANK [MODEL_DIR]``: at step 20 of the first epoch, rank RANK prints
``fault-fit: rank R KIND at T`` (T: the wall clock, seconds since the epoch) and then sends
itself SIGKILL (``kill``: a crash, an out-of-memory kill) or SIGSTOP (``stop``: a hang: the
process lives, holds its sockets and answers nothing). The other ranks train on until
TensorFlow's heartbeats, and tfdist's line, tell them. With MODEL_DIR the fit also has
tfdist's preemption callbacks, which must not mistake the fault for a preemption.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import fit_setup

import tfdist

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def main() -> None:
    kind, faulty = sys.argv[1], int(sys.argv[2])
    model_dir = sys.argv[3] if len(sys.argv) > 3 else None
    dist = tfdist.init()

    def fault(callback: object, batch: int) -> None:
        time.sleep(0.01)
        if batch == 20 and dist.rank == faulty:
            print(f"fault-fit: rank {dist.rank} {kind} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), SIGNALS[kind])

    fit_setup.fit(dist, fault, sync_check=False, model_dir=model_dir)


if __name__ == "__main__":
    main()
