"""A 2-worker MWMS fit whose rank 1 stays alive but stops entering the collectives
(tests/test_collective_timeout.py).

Every rank prints ``stall: rank R pid P`` at start. At step 20 rank 1 prints ``stall: rank 1
stops training`` and sleeps ``--sleep`` seconds in a callback: its heartbeat goes on, so only a
collective timeout (``TFDIST_COLLECTIVE_TIMEOUT``) ends rank 0's wait.
"""

from __future__ import annotations

import argparse
import os
import time

import fit_setup

import tfdist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=300.0)
    args = parser.parse_args()
    dist = tfdist.init()
    print(f"stall: rank {dist.rank} pid {os.getpid()}", flush=True)

    def stall(callback: object, batch: int) -> None:
        if batch == 20 and dist.rank == 1:
            print("stall: rank 1 stops training", flush=True)
            time.sleep(args.sleep)

    fit_setup.fit(dist, stall)


if __name__ == "__main__":
    main()
