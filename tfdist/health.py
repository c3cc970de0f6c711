"""Per-rank health: each rank's step profile, the rank that slows everyone named with its likely
cause, and advice when the input starves the step (pure, but for :func:`cpu_counters`).

In synchronous training the step time is the same on every rank: the collectives wait for the
slowest. What differs is how each rank spends it. Per epoch every rank reads, besides the
step clock the throughput meter already keeps, two of its own counters:

- ``cpu_s``: CPU seconds its threads ran, per step (its own computation on CPU workers, and the
  host side of a GPU step);
- ``queued_s``: seconds per step its threads were ready to run but waited for a CPU, that is
  another process on its cores (Linux's ``/proc/self/task/*/schedstat``; None elsewhere);
- ``input_s``: seconds per step spent waiting for the next batch, where tfdist sees the input
  being read (``StepMeter.batches``; TensorFlow ``fit``'s steps time their own reads,
  :mod:`tfdist.keras.input_wait`; Keras 3 on JAX's ``fit`` times each batch it draws,
  :meth:`tfdist.keras.input_position.JaxInput.waited`; None where tfdist does not see the input).

The figures travel in one small sum at the epoch's end (:func:`pack`, :func:`unpack`); the chief
judges them (:func:`slowest`). A rank is named when what it alone spends exceeds the median of
the other ranks' by a clear share of the step (:data:`THRESHOLD`) in two epochs in a row
(:class:`Watch`). The cause follows from the counter that is out: ``queued_s`` another process
on its cores, ``input_s`` its input, ``cpu_s`` its own computation (a slower or throttled
processor). A slow network link is not one rank's: every rank then waits in the collectives,
which ``tfdist doctor``'s link test measures pair by pair.
"""

from __future__ import annotations

import glob
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["FIELDS", "THRESHOLD", "Finding", "RankProfile", "Watch", "cpu_counters",
           "input_advice", "pack", "slowest", "unpack", "verdict"]

FIELDS = ("node", "cpu_s", "queued_s", "input_s")
# A rank is out when it spends this share of the step more than the others' median: in a
# balanced run on a loaded 2-core machine the ranks' queue waits differed by up to 0.35 of it.
THRESHOLD = 0.5
# Waiting for input above this share of the step (median rank) earns the input advice: a clear
# share. fit's reads of an in-memory dataset, fed in time, take 0.02-0.03 of an 8 ms step on 2
# MWMS workers on 2 cores (0.14-0.31 when fit's clock counted the step's first ops too).
INPUT_SHARE = 0.3
_NONE = -1.0  # a counter this rank could not read, in the packed sum


@dataclass(frozen=True)
class RankProfile:
    """One rank's epoch, per step (seconds); None: not measured on this rank."""

    rank: int
    host: str
    cpu_s: float | None
    queued_s: float | None
    input_s: float | None


@dataclass(frozen=True)
class Finding:
    """A rank slower than the others: ``cause`` is ``"cpu"`` (another process on its cores),
    ``"input"`` or ``"compute"``; ``excess_s`` what it spends per step beyond the median of the
    other ranks."""

    rank: int
    host: str
    cause: str
    excess_s: float
    step_s: float

    def line(self, epochs: int) -> str:
        """The chief's line naming the rank, with what to do."""
        share = 100 * self.excess_s / self.step_s if self.step_s > 0 else math.nan
        what = {
            "cpu": (f"its threads waited {self.excess_s * 1e3:.0f} ms a step longer than the "
                    f"others' for a CPU: another process runs on its cores",
                    f"give each task cores of its own (srun --exclusive or --cpus-per-task; "
                    f"tfdist launch pins its workers) or find that process (top -H on "
                    f"{self.host})"),
            "input": (f"it waited {self.excess_s * 1e3:.0f} ms a step longer than the others "
                      f"for its input",
                      "look at its data's file system and its CPUs; prefetch and parallelise "
                      "the pipeline (dataset.map(f, num_parallel_calls=tf.data.AUTOTUNE), "
                      ".prefetch(tf.data.AUTOTUNE))"),
            "compute": (f"its own computation takes {self.excess_s * 1e3:.0f} ms a step longer "
                        f"than the others': a slower or throttled processor",
                        f"check {self.host}'s clocks and limits (nvidia-smi -q -d "
                        f"PERFORMANCE, lscpu) or leave it out of the job"),
        }[self.cause]
        return (f"rank {self.rank} (host {self.host}) is slow in {epochs} epochs in a row: "
                f"{what[0]} ({share:.0f} % of the {self.step_s * 1e3:.0f} ms step), and every "
                f"rank waits for it. Likely cause: {self.cause}. {what[1][0].upper()}"
                f"{what[1][1:]}")


def pack(rank: int, world_size: int, node: int, cpu_s: float | None, queued_s: float | None,
         input_s: float | None) -> list[float]:
    """This rank's slots of the vector every rank sums (:data:`FIELDS` per rank, zeros in the
    others' slots): the sum is every rank's figures, in rank order."""
    values = [float(node), *(_NONE if v is None else float(v)
                             for v in (cpu_s, queued_s, input_s))]
    width = len(FIELDS)
    vector = [0.0] * (world_size * width)
    vector[rank * width:(rank + 1) * width] = values
    return vector


def unpack(summed: Sequence[float], hosts: Sequence[str]) -> list[RankProfile]:
    """Every rank's profile from the summed vector; ``hosts`` names the nodes by index (a
    rank on a node past its end is shown by the node's index)."""
    width = len(FIELDS)
    profiles = []
    for rank in range(len(summed) // width):
        node, *figures = summed[rank * width:(rank + 1) * width]
        index = round(node)
        host = hosts[index] if 0 <= index < len(hosts) else f"node {index}"
        cpu, queued, waited = (None if v < 0 else float(v) for v in figures)
        profiles.append(RankProfile(rank, host, cpu, queued, waited))
    return profiles


def slowest(profiles: Sequence[RankProfile], step_s: float,
            threshold: float = THRESHOLD) -> Finding | None:
    """The rank that spends the most beyond the median of the other ranks, if that is more
    than ``threshold`` of the step, with the counter that says why; None in a balanced job or with
    fewer than 2 ranks. Waiting for a CPU is looked at first (a neighbour also makes the rank's
    own computation look slower), then the input, then the computation."""
    if len(profiles) < 2 or step_s <= 0:
        return None
    for cause, field in (("cpu", "queued_s"), ("input", "input_s"), ("compute", "cpu_s")):
        values = [getattr(p, field) for p in profiles]
        if any(v is None for v in values):
            continue
        worst = max(range(len(values)), key=lambda r: values[r])
        median = statistics.median(values[:worst] + values[worst + 1:])  # the others'
        excess = values[worst] - median
        if excess > threshold * step_s and (cause != "compute" or values[worst] > 1.5 * median):
            return Finding(profiles[worst].rank, profiles[worst].host, cause, excess, step_s)
    return None


def input_advice(profiles: Sequence[RankProfile], step_s: float,
                 share: float = INPUT_SHARE) -> str | None:
    """One line with the tf.data fix when the median rank waits for its input more than
    ``share`` of the step; None otherwise, or where the input is not measured."""
    waits = [p.input_s for p in profiles if p.input_s is not None]
    if not waits or step_s <= 0:
        return None
    waited = statistics.median(waits)
    if waited <= share * step_s:
        return None
    return (f"waiting for input takes {100 * waited / step_s:.0f} % of each step "
            f"({waited * 1e3:.0f} ms of {step_s * 1e3:.0f} ms): the input pipeline is slower "
            f"than the training step. With tf.data: dataset.map(f, num_parallel_calls="
            f"tf.data.AUTOTUNE), .cache() after the costly part that does not change between "
            f"epochs, .prefetch(tf.data.AUTOTUNE) last; a torch DataLoader: num_workers and "
            f"pin_memory; and more CPUs per task (--cpus-per-task)")


def verdict(profiles: Sequence[RankProfile], step_s: float, *,
            judge_input: bool = True) -> tuple[Finding | None, str | None]:
    """This epoch's finding and input advice (:func:`slowest`, :func:`input_advice`), with one
    rule between them: a rank found for its input while the median rank waits for its input
    too is not named. When every rank's pipeline is too slow, the rank whose batch comes last
    waits for it and the others wait for that rank in the collective, their own next batch
    ready by then: one rank shows the wait, and which one is chance. The advice, for every
    rank, is the finding then.

    ``judge_input=False`` (a first epoch, whose reads include the pipeline's start: its
    buffers filling) leaves the input out of both."""
    if not judge_input:
        profiles = [replace(p, input_s=None) for p in profiles]
    finding, advice = slowest(profiles, step_s), input_advice(profiles, step_s)
    if finding is not None and finding.cause == "input" and advice is not None:
        finding = None
    return finding, advice


class Watch:
    """Names a rank once it is found slow in ``epochs`` epochs in a row (the chief keeps it)."""

    def __init__(self, epochs: int = 2) -> None:
        self.epochs = epochs
        self._rank: int | None = None
        self._count = 0

    def see(self, finding: Finding | None) -> str | None:
        """The line to log for this epoch's finding, or None."""
        if finding is None:
            self._rank, self._count = None, 0
            return None
        self._count = self._count + 1 if finding.rank == self._rank else 1
        self._rank = finding.rank
        return finding.line(self._count) if self._count >= self.epochs else None


def cpu_counters() -> tuple[float, float | None]:
    """This process's CPU seconds (all threads) and, on Linux, the seconds its threads have
    waited on a run queue for a CPU, since it started. Reading ``schedstat`` costs about 10 us
    per thread: call it once an epoch."""
    import time

    queued = 0.0
    files = glob.glob("/proc/self/task/*/schedstat")
    for path in files:
        try:
            with open(path, encoding="ascii") as f:
                queued += int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return time.process_time(), (queued if files else None)
