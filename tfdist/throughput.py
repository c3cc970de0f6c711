"""Throughput meter: examples per second per worker and in total, and step time with spread.

``dist.callbacks()`` includes :class:`tfdist.keras.callbacks.ThroughputMeter`; custom loops use
:class:`StepMeter`. This module imports no framework.
Each epoch the chief logs one line and, when a file is set, appends one JSON object to it:

    {"event": "epoch", "epoch": 3, "workers": 2, "replicas": 2, "backend": "mwms",
     "global_batch": 64, "steps": 64, "timed_steps": 63,
     "step_time_s": {"median": 0.0131, "q1": 0.0127, "q3": 0.014, "min": 0.012, "max": 0.03},
     "examples_per_s": {"total": 4885.5, "per_worker": 2442.7}, "epoch_s": 1.62,
     "start_s": 0.041, "busy": 0.83, "time": ...}

The file is ``TFDIST_THROUGHPUT_FILE`` (what ``tfdist scaling`` sets), else
``model_dir/throughput.jsonl``. Steps are timed from one step's end to the next (the first
step of an epoch, which waits for the input pipeline to start, is not counted, and
``epoch_s``, the epoch's wall time from its start to its end, tells what the steps leave out:
starting the epoch's input and its end's callbacks). ``start_s`` is the epoch's start: from its
beginning to its first step's end, less one median step (making the epoch's input iterator,
its first batch, freeing the last epoch's iterator). When that start is a clear share of the
epoch two epochs in a row, the chief says once how to read one iterator for every epoch
(:func:`start_advice`). With
``steps_per_execution=N`` Keras reports every N steps, and each execution counts as N steps of
its mean time. ``busy`` is the CPU time of this process over the epoch's wall time and its
cores: on CPU workers, what is not busy was spent waiting (for the other workers in collectives,
or for input). Where the global batch size is unknown (no ``dist.shard`` of a batched dataset,
no ``global_batch=``), ``global_batch`` and ``examples_per_s`` are null and the steps per
second still tell.

On several workers each record also holds every rank's own figures (``"ranks"``: per step,
the CPU its threads ran, the time they waited for a CPU, and the time spent waiting for input
where measured), gathered in one small sum at the epoch's end, and the chief names a rank that
slows the others (``"slow"``, and a line with the cause and what to do: :mod:`tfdist.health`),
or says once that the input starves the step.

Cost: one clock read and one list append per step; at each epoch's end, reading the process's
counters (about 10 us per thread) and, on several workers, one sum of 4 numbers per rank.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import statistics
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tfdist import health
from tfdist import model_dir as layout
from tfdist.settings import resolve

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["START_ADVICE_S", "StepMeter", "batch_size_of", "describe", "start_advice",
           "summarise", "throughput_file"]

logger = logging.getLogger("tfdist")

START_ADVICE_S = 0.1  # an epoch's start above this and a tenth of the epoch: advised once


def batch_size_of(dataset: Any) -> int | None:
    """The batch size of ``dataset``'s last ``batch`` (the global batch), if it is a constant.

    Follows the chain of transformations back from ``dataset`` (prefetch, map, cache, options
    ...) to the first ``batch``/``padded_batch``. None when there is none, or its size is not
    a constant.
    """
    seen = 0
    while dataset is not None and seen < 100:
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            try:
                value = int(size.numpy() if hasattr(size, "numpy") else size)
            except (TypeError, ValueError):
                return None
            return value if value > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
        seen += 1
    return None


def summarise(stamps: Sequence[tuple[int, float]], *, global_batch: int | None,
              workers: int) -> dict[str, Any] | None:
    """Step-time statistics and throughput from ``(step index, end time)`` stamps (pure).

    Args:
        stamps: per report, the index of the last step it covers (0-based, increasing) and when
            it ended (seconds). The time before the first stamp is not counted.
        global_batch: examples per step over all workers, or None.
        workers: processes training together.

    Returns:
        ``{"timed_steps", "step_time_s", "examples_per_s"}``, or None with fewer than 2 stamps.
    """
    per_step: list[float] = []
    for (before, start), (last, end) in itertools.pairwise(stamps):
        steps = last - before
        if steps > 0:
            per_step += [(end - start) / steps] * steps
    if not per_step:
        return None
    quartiles = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else per_step * 3
    median = statistics.median(per_step)
    examples = None
    if global_batch and median > 0:
        total = global_batch / median
        examples = {"total": round(total, 2), "per_worker": round(total / workers, 2)}
    return {"timed_steps": len(per_step),
            "step_time_s": {"median": median, "q1": quartiles[0], "q3": quartiles[2],
                            "min": min(per_step), "max": max(per_step)},
            "examples_per_s": examples}


def throughput_file(model_dir: str | None) -> str | None:
    """Where the chief appends its records: ``TFDIST_THROUGHPUT_FILE``, else
    ``model_dir/throughput.jsonl``, else nowhere."""
    path = resolve("throughput_file")
    if path:
        return str(path)
    return layout.path(model_dir, layout.THROUGHPUT) if model_dir else None


class StepMeter:
    """Times steps and reports each epoch; for custom loops (``fit`` uses ThroughputMeter).

    Call :meth:`step` after each training step (after its result is on the host, e.g. after
    reading the loss) and :meth:`epoch_end` after each epoch::

        meter = tfdist.throughput.StepMeter(dist, global_batch=GLOBAL_BATCH)
        for epoch in range(epochs):
            for batch in dataset:
                loss = train_step(batch)
                meter.step(steps=1)
            meter.epoch_end(epoch)

    Args:
        dist: the handle from :func:`tfdist.init`.
        global_batch: examples per step over all workers; default: what ``dist.shard`` saw.
        path: the JSON lines file; default: :func:`throughput_file` (without a model_dir).
        log: log one line per epoch on the chief.
    """

    def __init__(self, dist: Handle, global_batch: int | None = None, path: str | None = None,
                 log: bool = True) -> None:
        self.dist, self.global_batch, self.log = dist, global_batch, log
        self.path = path if path is not None else throughput_file(None)
        self.records: list[dict[str, Any]] = []
        self._notes: list[str] = []  # said with the next epoch's line (:func:`note`)
        if log and dist.is_chief:
            _saying[:] = [weakref.ref(self)]
        self._watch = health.Watch()
        self._advised = self._start_advised = False
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """Starts an epoch: no stamps yet, the clocks and counters read now."""
        self._stamps: list[tuple[int, float]] = []
        self._steps = 0
        self._input_s: float | None = None
        self._wall = time.perf_counter()
        self._cpu, self._queued = health.cpu_counters()

    def batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, timing how long each one takes to arrive: the epoch's input wait, in
        the per-rank profile and the input advice::

            for batch in meter.batches(dataset):
                ...
        """
        for waited, batch in arrivals(batches):
            self._input_s = (self._input_s or 0.0) + waited
            yield batch

    def waited(self, seconds: float) -> None:
        """Adds ``seconds`` of input wait timed elsewhere (``fit``'s steps time their reads in
        their graph: :mod:`tfdist.keras.input_wait`)."""
        self._input_s = (self._input_s or 0.0) + seconds

    def step(self, steps: int = 1) -> None:
        """Marks the end of ``steps`` more steps (several for one multi-step execution)."""
        self._steps += steps
        self._stamps.append((self._steps - 1, time.perf_counter()))

    def steps_done(self, last: int) -> None:
        """Marks the end of the epoch's step ``last`` (0-based), as Keras reports it."""
        self._steps = last + 1
        self._stamps.append((last, time.perf_counter()))

    def epoch_end(self, epoch: int) -> dict[str, Any] | None:
        """Summarises the epoch, logs and writes it on the chief, and starts the next one.

        Returns:
            The record (on every rank), or None when the epoch had fewer than 2 reports.
        """
        ended = time.perf_counter()
        wall = ended - self._wall
        cpu_now, queued_now = health.cpu_counters()
        cpu = cpu_now - self._cpu
        batch = self.global_batch or getattr(self.dist, "sharded_batch_size", None)
        summary = summarise(self._stamps, global_batch=batch, workers=self.dist.world_size)
        start = None if summary is None else _epoch_start(self._stamps, self._wall, summary)
        steps = self._steps
        queued = None if queued_now is None or self._queued is None else max(
            0.0, queued_now - self._queued)  # a thread that ended takes its count with it
        profiles = self._profiles(steps, cpu, queued, self._input_s)  # on every rank
        profiled = time.perf_counter() - ended  # the counters and the sum: the profile's cost
        self.begin_epoch()
        if summary is None or start is None:
            return None
        record = {"event": "epoch", "epoch": epoch, "workers": self.dist.world_size,
                  "replicas": self.dist.num_replicas, "backend": self.dist.backend,
                  "global_batch": batch, "steps": steps, **summary,
                  "epoch_s": round(wall, 4), "start_s": round(start, 4),
                  "busy": round(cpu / wall / _cores(), 3) if wall > 0 else None,
                  "time": time.time()}
        if self.dist.is_chief and self.log:
            logger.info("tfdist: %s", "; ".join([describe(record), *self._notes]))
            self._notes.clear()
        if profiles:  # after the epoch's line: what it says of the ranks
            record["ranks"] = [_rounded(p) for p in profiles]
            record["profile_s"] = round(profiled, 6)
            self._judge(record, profiles, summary["step_time_s"]["median"])
        self.records.append(record)
        advice = start_advice(self.records) if self.dist.is_chief and self.log else None
        if advice and not self._start_advised:
            self._start_advised = True
            logger.warning("tfdist: %s", advice)
        if self.dist.is_chief and self.path:
            _append(self.path, record)
        return record

    def _profiles(self, steps: int, cpu: float, queued: float | None,
                  input_s: float | None) -> list[health.RankProfile]:
        """Every rank's figures per step (one sum over the ranks); [] in one process."""
        if self.dist.world_size < 2 or not hasattr(self.dist, "sum_over_ranks"):
            return []
        per = max(steps, 1)
        environment = getattr(self.dist, "environment", None)
        hosts = tuple(getattr(environment, "hosts", ()) or ()) or (socket.gethostname(),)
        node = getattr(environment, "node_rank", 0) if len(hosts) > 1 else 0
        summed = self.dist.sum_over_ranks(health.pack(
            self.dist.rank, self.dist.world_size, node, cpu / per,
            None if queued is None else queued / per,
            None if input_s is None else input_s / per))
        return health.unpack(summed, hosts)

    def _judge(self, record: dict[str, Any], profiles: list[health.RankProfile],
               step_s: float) -> None:
        """The chief names a rank slow two epochs in a row, and advises once on the input."""
        # The first epoch's reads include the pipeline's start (its buffers filling): the
        # input is judged from the second on.
        finding, advice = health.verdict(profiles, step_s, judge_input=bool(self.records))
        record["slow"] = None if finding is None else {
            "rank": finding.rank, "host": finding.host, "cause": finding.cause,
            "excess_s": round(finding.excess_s, 6)}
        if not self.dist.is_chief or not self.log:
            return
        line = self._watch.see(finding)
        if line:
            logger.warning("tfdist: %s", line)
        if advice and not self._advised:
            self._advised = True
            logger.warning("tfdist: %s", advice)


# The chief's meter that says each epoch's line, the newest (a weak reference).
_saying: list[weakref.ref[StepMeter]] = []


def note(text: str) -> bool:
    """Says ``text`` with the next epoch's line of the chief's meter, so that a run prints one
    tfdist line an epoch (the replica sync check's first pass does); False where no meter says
    epoch lines here: say it yourself."""
    meter = _saying[0]() if _saying else None
    if meter is None:
        return False
    meter._notes.append(text)
    return True


def say_notes() -> None:
    """Says what :func:`note` left for an epoch line that did not come (training ended)."""
    meter = _saying[0]() if _saying else None
    if meter is not None and meter._notes:
        logger.info("tfdist: %s", "; ".join(meter._notes))
        meter._notes.clear()


def arrivals(batches: Iterable[Any]) -> Iterator[tuple[float, Any]]:
    """Each of ``batches`` with the seconds it took to arrive (its ``next``)."""
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield time.perf_counter() - started, batch


def _epoch_start(stamps: Sequence[tuple[int, float]], began: float,
                 summary: dict[str, Any]) -> float:
    """From the epoch's beginning to its first report, less the steps that report covers at
    the median step time (pure)."""
    last, ended = stamps[0]
    return max(0.0, ended - began - (last + 1) * summary["step_time_s"]["median"])


def start_advice(records: Sequence[dict[str, Any]]) -> str | None:
    """The line to log when each epoch's start is a clear share of the epoch (pure): in the
    last two epochs, not counting a meter's first (it traces and starts the pipeline), each
    start above :data:`START_ADVICE_S` and a tenth of its epoch; None otherwise."""
    later = list(records[1:])[-2:]
    if len(later) < 2 or any(r.get("start_s") is None or not r.get("epoch_s") for r in later):
        return None
    if not all(r["start_s"] > max(START_ADVICE_S, 0.1 * r["epoch_s"]) for r in later):
        return None
    start = statistics.median(r["start_s"] for r in later)
    share = statistics.median(r["start_s"] / r["epoch_s"] for r in later)
    return (f"each epoch's start takes {start:.2f} s ({share * 100:.0f} % of the epoch) before its "
            "first step: a new input iterator is made for every epoch on the training thread, "
            "and a GPU worker frees the last one there too (TensorFlow's multi-device iterator "
            "waits for its prefetch, and can wait for tf.data's autotuning: a race in "
            "TensorFlow, up to 60 s); every rank then waits for the slowest. Read one iterator "
            "for every epoch: dataset.repeat() and fit(steps_per_epoch=N) (tfdist resumes it "
            "exactly, step and batch)")


def describe(record: dict[str, Any]) -> str:
    """One line for the log: throughput, step time and its spread (pure)."""
    step = record["step_time_s"]
    timing = (f"step {step['median'] * 1e3:.1f} ms ({step['q1'] * 1e3:.1f}-"
              f"{step['q3'] * 1e3:.1f})")
    examples = record["examples_per_s"]
    if examples is None:
        rate = f"{1 / step['median']:,.1f} steps/s"
    else:
        rate = (f"{examples['total']:,.0f} examples/s ({examples['per_worker']:,.0f} per "
                "worker)")
    # Numbered as Keras's progress bar numbers it (the record keeps fit's 0-based index, as
    # History and CSVLogger do).
    return f"epoch {record['epoch'] + 1}: {rate}, {timing}, {record['workers']} worker(s)"


def _rounded(profile: health.RankProfile) -> dict[str, Any]:
    return {"rank": profile.rank, "host": profile.host,
            **{k: None if v is None else round(v, 6) for k, v in (
                ("cpu_s", profile.cpu_s), ("queued_s", profile.queued_s),
                ("input_s", profile.input_s))}}


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _append(path: str, record: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
