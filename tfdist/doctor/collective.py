"""The doctor's second phase: start the real engine, all-reduce across every rank, in a bound.

The engine starts exactly as training will start it (:func:`tfdist.init`, or
:func:`tfdist.torch.init`), so the all-reduce goes over the same transport: TensorFlow's gRPC
ring, NCCL, Horovod's Gloo or MPI, torch's process group. A watchdog turns a hang into a message
and a non-zero exit. The optional bandwidth probe times all-reduces of N MB and reports bus
bandwidth, as nccl-tests does: ``2 (n - 1) / n * bytes / seconds``.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tfdist import failures
from tfdist.errors import ConfigError

__all__ = ["Engine", "bus_bandwidth", "start", "watchdog"]

ROUNDS = 5


@dataclass
class Engine:
    """A started engine: its all-reduce of a float32 vector, and its object gather."""

    name: str
    rank: int
    world_size: int
    all_reduce: Callable[[int], Callable[..., float]]  # n -> reduce(value=1.0): one all-reduce
    # Every rank's object, on every rank; None, or a function returning None, where the
    # engine gathers no Python objects.
    gather: Callable[[Any], list[Any] | None] | None

    def sum_check(self) -> tuple[bool, float]:
        """Sums ``rank + 1`` over the ranks twice; whether the total is right, and the second
        call's seconds (the first includes setting the collective up)."""
        reduce = self.all_reduce(1)
        reduce()
        began = time.perf_counter()
        total = float(reduce(self.rank + 1.0))
        took = time.perf_counter() - began
        return total == self.world_size * (self.world_size + 1) / 2, took

    def bandwidth(self, megabytes: float) -> tuple[float, float]:
        """Median and spread (max - min) of the bus bandwidth in GB/s over a few rounds."""
        reduce = self.all_reduce(max(1, int(megabytes * 1e6 / 4)))
        reduce()  # warm-up: buffers, the collective's set-up
        rates = []
        for _ in range(ROUNDS):
            began = time.perf_counter()
            reduce()
            rates.append(bus_bandwidth(megabytes * 1e6, self.world_size,
                                       time.perf_counter() - began))
        return statistics.median(rates), max(rates) - min(rates)


def bus_bandwidth(size_bytes: float, world_size: int, seconds: float) -> float:
    """All-reduce bus bandwidth in GB/s (nccl-tests' definition)."""
    if world_size < 2 or seconds <= 0:
        return 0.0
    return 2 * (world_size - 1) / world_size * size_bytes / seconds / 1e9


@contextmanager
def watchdog(seconds: float, message: Callable[[], str]) -> Iterator[None]:
    """Ends the process (exit 1) with ``message()`` if the block takes more than ``seconds``:
    a collective that hangs cannot be interrupted from Python."""
    done = threading.Event()

    def bark() -> None:
        if not done.wait(seconds):
            print(message(), file=sys.stderr, flush=True)
            time.sleep(failures.LINGER_S)  # for the launcher to forward it (failures.linger)
            os._exit(1)

    thread = threading.Thread(target=bark, name="tfdist-doctor-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def start(framework: str, backend: str | None) -> Engine:
    """Starts the engine as training would (``tfdist.init`` or ``tfdist.torch.init``), and
    wraps the handle's all-reduce and object gather."""
    dist = _torch(backend) if framework == "torch" else _tensorflow(backend)
    if not dist.facts.crosses_processes:  # one process: nothing to check across processes
        return Engine("single", 0, 1, dist.probe_all_reduce, None)
    return Engine(dist.label, dist.rank, dist.world_size, dist.probe_all_reduce,
                  dist.gather_objects)


def _tensorflow(backend: str | None) -> Any:
    import tfdist

    return tfdist.init(backend)


def _torch(backend: str | None) -> Any:
    try:
        import tfdist.torch
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        raise ConfigError(f"--framework torch: {err}; or check TensorFlow with --framework tf"
                          ) from None
    return tfdist.torch.init(backend=backend)
