"""Throughput meter: examples per second per worker and in total, and step time with spread.

``dist.callbacks()`` includes :class:`tfdist.callbacks.ThroughputMeter`; custom loops use
:class:`StepMeter`. This module imports no framework.
Each epoch the chief logs one line and, when a file is set, appends one JSON object to it:

    {"event": "epoch", "epoch": 3, "workers": 2, "replicas": 2, "backend": "mwms",
     "global_batch": 64, "steps": 64, "timed_steps": 63,
     "step_time_s": {"median": 0.0131, "q1": 0.0127, "q3": 0.014, "min": 0.012, "max": 0.03},
     "examples_per_s": {"total": 4885.5, "per_worker": 2442.7}, "epoch_s": 1.62,
     "busy": 0.83, "time": ...}

The file is ``TFDIST_THROUGHPUT_FILE`` (what ``tfdist scaling`` sets), else
``model_dir/throughput.jsonl``. Steps are timed from one step's end to the next (the first
step of an epoch, which waits for the input pipeline to start, is not counted, and
``epoch_s``, the epoch's wall time from its start to its end, tells what the steps leave out:
starting the epoch's input and its end's callbacks); with
``steps_per_execution=N`` Keras reports every N steps, and each execution counts as N steps of
its mean time. ``busy`` is the CPU time of this process over the epoch's wall time and its
cores: on CPU workers, what is not busy was spent waiting (for the other workers in collectives,
or for input). Where the global batch size is unknown (no ``dist.shard`` of a batched dataset,
no ``global_batch=``), ``global_batch`` and ``examples_per_s`` are null and the steps per
second still tell.

Cost between epochs: one clock read and one list append per step.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from tfdist import model_dir as layout
from tfdist.settings import resolve

__all__ = ["StepMeter", "batch_size_of", "describe", "summarise", "throughput_file"]

logger = logging.getLogger("tfdist")


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

    def __init__(self, dist: Any, global_batch: int | None = None, path: str | None = None,
                 log: bool = True) -> None:
        self.dist, self.global_batch, self.log = dist, global_batch, log
        self.path = path if path is not None else throughput_file(None)
        self.records: list[dict[str, Any]] = []
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """Starts an epoch: no stamps yet, the clocks read now."""
        self._stamps: list[tuple[int, float]] = []
        self._steps = 0
        self._wall, self._cpu = time.perf_counter(), time.process_time()

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
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        batch = self.global_batch or getattr(self.dist, "sharded_batch_size", None)
        summary = summarise(self._stamps, global_batch=batch, workers=self.dist.world_size)
        steps = self._steps
        self.begin_epoch()
        if summary is None:
            return None
        record = {"event": "epoch", "epoch": epoch, "workers": self.dist.world_size,
                  "replicas": self.dist.num_replicas, "backend": self.dist.backend,
                  "global_batch": batch, "steps": steps, **summary,
                  "epoch_s": round(wall, 4),
                  "busy": round(cpu / wall / _cores(), 3) if wall > 0 else None,
                  "time": time.time()}
        self.records.append(record)
        if self.dist.is_chief:
            if self.log:
                logger.info("tfdist: %s", describe(record))
            if self.path:
                _append(self.path, record)
        return record


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
