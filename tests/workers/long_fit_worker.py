"""A 2-worker fit long enough to stop or kill one rank in the middle (tests/test_failures.py):
MWMS, or Horovod with ``TFDIST_BACKEND=horovod``.

Prints ``long-fit: pid PID training`` once its fit has run 20 steps.
"""

from __future__ import annotations

import os
import time

import fit_setup

import tfdist


def main() -> None:
    dist = tfdist.init()

    def announce(callback: object, batch: int) -> None:
        time.sleep(0.01)
        if batch == 20:
            print(f"long-fit: pid {os.getpid()} training", flush=True)

    fit_setup.fit(dist, announce)


if __name__ == "__main__":
    main()
