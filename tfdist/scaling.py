"""``tfdist scaling``: throughput on N workers against N times the throughput of the fewest.

Each size runs the same script (``tfdist launch -n N`` here, or one ``srun`` step per size in a
Slurm job, ``tfdist job --kind scaling``), with ``TFDIST_THROUGHPUT_FILE`` naming a file in
``OUT/runs/``, ``n<workers>-r<repeat>.jsonl``. The chief's throughput meter (``dist.callbacks()``)
writes one JSON object per epoch there::

    {"event": "epoch", "epoch": 0, "workers": 2, "backend": "mwms", "global_batch": 64,
     "steps": 64, "step_time_s": {"median": 0.0131, "q1": 0.0127, "q3": 0.0140, ...},
     "examples_per_s": {"total": 4885.5, "per_worker": 2442.7}, ...}

The report, from those files alone (:func:`load_runs`, :func:`summarize`):

- a run's throughput is the median over its epochs after the first (the first traces and
  compiles the model), or its only epoch; in examples/s, or in steps/s (1 / median step time)
  where the global batch is unknown;
- a size's throughput is the median over its repeats, with their range (min..max);
- speed-up = throughput(N) / throughput(N0), efficiency = speed-up / (N / N0), N0 the fewest
  workers measured; the ideal is N x the per-worker throughput of N0;
- the step time is the median of the kept epochs' medians (and likewise their quartiles), then
  the median over repeats.

It is written as ``scaling.md``, ``scaling.csv`` (the same numbers, and the plotted points) and,
with matplotlib (``pip install tfdist[plot]``), ``scaling.png``. Everything but :func:`run` and
the file writers is pure; nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tfdist.errors import ConfigError, TfdistError

__all__ = ["THROUGHPUT_FILE", "Epoch", "Options", "Report", "Row", "Run", "check_sizes",
           "csv_text", "default_sizes", "launch_command", "load_runs", "markdown",
           "parse_epochs", "parse_run_name", "parse_sizes", "plan", "plot", "read_run", "run",
           "run_name", "run_rate", "summarize", "write_report"]

THROUGHPUT_FILE = "TFDIST_THROUGHPUT_FILE"
RUNS = "runs"
PLOT_HINT = "install tfdist[plot] for the plot (matplotlib); scaling.md and scaling.csv are written"
EXAMPLES = "examples/s"
STEPS = "steps/s"
_RUN_NAME = re.compile(r"n(\d+)-r(\d+)\.jsonl")
_TAIL_LINES = 30
# After --timeout: SIGTERM to `tfdist launch`, which stops its workers within its own grace
# period (10 s), then SIGKILL.
_STOP_GRACE_S = 20.0


# --------------------------------------------------------------------------------------------
# Sizes and the plan


_LOCAL_EXAMPLE = "-n 1,2,4 (each size once; --repeat K runs every size K times)"


def parse_sizes(text: str, flag: str = "-n", example: str = _LOCAL_EXAMPLE) -> tuple[int, ...]:
    """Parse a list of sizes such as ``"1,2,4"`` into increasing numbers.

    Args:
        text: Comma-separated whole numbers, each at least 1, in any order.
        flag: The flag or key that gave them, for error messages.
        example: How to give them, for error messages.

    Returns:
        The sizes, increasing.

    Raises:
        ConfigError: An empty list, a word that is not a whole number of at least 1, or a size
            given twice; the message shows the form to use.
    """
    words = [word.strip() for word in text.split(",")]
    if not any(words):
        raise ConfigError(f"{flag} needs sizes, e.g. {example}; got {text!r}")
    values = []
    for word in words:
        if not re.fullmatch(r"[0-9]+", word):
            raise ConfigError(f"{flag} {text!r}: {word!r} is not a whole number; give whole "
                              f"numbers separated by commas, e.g. {example}")
        values.append(int(word))
    return check_sizes(values, flag, example)


def check_sizes(values: Iterable[int], what: str = "-n",
                example: str = _LOCAL_EXAMPLE) -> tuple[int, ...]:
    """Check sizes given as numbers; return them increasing.

    Raises:
        ConfigError: No size, a size below 1, or a size given twice; with ``example``.
    """
    sizes = list(values)
    problem = None
    if not sizes:
        problem = "needs at least one size"
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problem = f"every size must be a whole number of at least 1, got {size!r}"
            break
    twice = sorted({size for size in sizes if sizes.count(size) > 1})
    if twice and problem is None:
        problem = f"size {twice[0]} is given twice"
    if problem is not None:
        raise ConfigError(f"{what}: {problem}; e.g. {example}")
    return tuple(sorted(sizes))


def default_sizes(total: int) -> tuple[int, ...]:
    """The sizes measured by default up to ``total``: the powers of two below it, and ``total``.

    >>> default_sizes(6)
    (1, 2, 4, 6)
    """
    if total < 1:
        raise ConfigError(f"the largest size must be at least 1, got {total}")
    powers = [2**i for i in range(total.bit_length()) if 2**i < total]
    return (*powers, total)


def plan(sizes: Sequence[int], repeat: int = 1) -> list[tuple[int, int]]:
    """The runs, in order: every size, increasing, then all of them again (round robin).

    Alternating sizes spreads slow moments of a shared machine over all sizes instead of one.

    Returns:
        ``(workers, repeat)`` pairs, repeats numbered from 1.
    """
    if repeat < 1:
        raise ConfigError(f"--repeat must be at least 1, got {repeat}")
    return [(size, k) for k in range(1, repeat + 1) for size in sorted(sizes)]


def run_name(workers: int, repeat: int) -> str:
    """The throughput file of one run: ``n<workers>-r<repeat>.jsonl``."""
    return f"n{workers}-r{repeat}.jsonl"


def parse_run_name(name: str) -> tuple[int, int] | None:
    """``(workers, repeat)`` of a file named by :func:`run_name`; None for other names."""
    match = _RUN_NAME.fullmatch(name)
    if not match or int(match.group(1)) < 1:
        return None
    return int(match.group(1)), int(match.group(2))


def launch_command(target: str, args: Sequence[str], workers: int, *,
                   launch_args: Sequence[str] = (), module: bool = False,
                   python: str = sys.executable) -> list[str]:
    """The argv of one local run: ``python -m tfdist launch -n WORKERS ... TARGET ARGS``.

    Raises:
        ConfigError: ``launch_args`` sets the number of workers, which the sizes set.
    """
    for arg in launch_args:
        if arg in ("-n", "--num-workers") or arg.startswith(("-n", "--num-workers=")):
            raise ConfigError(f"--launch-arg {arg!r}: the sizes set tfdist launch's -n; give "
                              "them with tfdist scaling -n 1,2,4")
    target_words = ["-m", target] if module else [target]
    return [python, "-m", "tfdist", "launch", "-n", str(workers), *launch_args, *target_words,
            *args]


# --------------------------------------------------------------------------------------------
# Reading the meter's records


@dataclass(frozen=True)
class Epoch:
    """One epoch as the throughput meter recorded it (times in seconds)."""

    epoch: int
    workers: int
    backend: str
    global_batch: int | None
    steps: int
    step_median: float
    step_q1: float
    step_q3: float
    examples_per_s: float | None
    # Per-rank health (several workers): how much longer the slowest rank waited per step, for
    # a CPU or for its input, than the others' median, and the rank the chief found slow.
    rank_excess_s: float | None = None
    slow_rank: int | None = None


@dataclass(frozen=True)
class Run:
    """One run of one size: its epochs, in order, and the file they came from."""

    workers: int
    repeat: int
    epochs: tuple[Epoch, ...]
    source: str

    @property
    def kept(self) -> tuple[Epoch, ...]:
        """The epochs that count: all after the first (which traces), or the only one."""
        return self.epochs[1:] if len(self.epochs) > 1 else self.epochs


def parse_epochs(text: str, source: str = "<text>") -> list[Epoch]:
    """Parse the meter's JSON lines; lines of other events are skipped.

    Args:
        text: The file's text: one JSON object per line.
        source: Where it came from, for error messages.

    Returns:
        The epoch records, ordered by epoch.

    Raises:
        TfdistError: A line is not a JSON object, or an epoch record lacks a field or has a
            value of the wrong type; the message names the file and line.
    """
    epochs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise TfdistError(f"{where} is not JSON ({err.msg}); {_FORMAT}") from None
        if not isinstance(record, dict):
            raise TfdistError(f"{where} is not a JSON object; {_FORMAT}")
        if record.get("event") == "epoch":
            epochs.append(_epoch(record, where))
    return sorted(epochs, key=lambda epoch: epoch.epoch)


_FORMAT = ("each line must be one JSON object as tfdist's throughput meter writes it "
           "(dist.callbacks() with TFDIST_THROUGHPUT_FILE set)")


def _epoch(record: Mapping[str, Any], where: str) -> Epoch:
    step = _field(record, "step_time_s", dict, where)
    examples = record.get("examples_per_s")
    examples = examples if isinstance(examples, dict) else {}  # null: the batch is unknown
    total = examples.get("total")
    batch = record.get("global_batch")
    return Epoch(
        epoch=_field(record, "epoch", int, where),
        workers=_positive(_field(record, "workers", int, where), "workers", where),
        backend=str(record.get("backend", "?")),
        global_batch=None if batch is None else _field(record, "global_batch", int, where),
        steps=_field(record, "steps", int, where),
        step_median=_positive(_number(step, "median", where), "step_time_s.median", where),
        step_q1=_number(step, "q1", where),
        step_q3=_number(step, "q3", where),
        examples_per_s=None if total is None else _number(examples, "total", where),
        rank_excess_s=_rank_excess(record.get("ranks")),
        slow_rank=(record.get("slow") or {}).get("rank"),
    )


def _rank_excess(ranks: Any) -> float | None:
    """The most a rank waited per step, for a CPU or for its input, beyond the others' median
    (pure); None without per-rank figures."""
    if not isinstance(ranks, list) or len(ranks) < 2:
        return None
    excess = []
    for field in ("queued_s", "input_s"):
        values = [float(v) for r in ranks if isinstance(r, dict)
                  and isinstance(v := r.get(field), int | float)]
        if len(values) < len(ranks) or len(values) < 2:  # a rank without it: not measured
            continue
        worst = max(range(len(values)), key=lambda i: values[i])
        excess.append(values[worst] - statistics.median(values[:worst] + values[worst + 1:]))
    return max(excess) if excess else None


def _field(record: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = record.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TfdistError(f"{where}: the epoch record's {key!r} must be "
                          f"{'an object' if kind is dict else 'a whole number'}, got {value!r}; "
                          f"{_FORMAT}")
    return value


def _number(record: Mapping[str, Any], key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TfdistError(f"{where}: {key!r} must be a number, got {value!r}; {_FORMAT}")
    return float(value)


def _positive(value: float, key: str, where: str) -> Any:
    if value <= 0:
        raise TfdistError(f"{where}: {key!r} must be more than 0, got {value}; {_FORMAT}")
    return value


def read_run(path: Path, workers: int, repeat: int) -> Run:
    """Read one run's throughput file and check that it measured ``workers`` workers.

    Raises:
        TfdistError: The file is missing, holds no epoch, or its epochs report another
            number of workers (the script did not run as ``workers`` workers).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TfdistError(f"the run of {workers} worker(s) wrote no throughput file {path}: pass "
                          "dist.callbacks() to model.fit (in a custom loop, use "
                          "tfdist.throughput.StepMeter), whose meter writes it on the chief when "
                          f"{THROUGHPUT_FILE} is set") from None
    epochs = parse_epochs(text, str(path))
    if not epochs:
        raise TfdistError(f"{path} holds no epoch record: the run of {workers} worker(s) ended "
                          "before its first epoch did, or its fit had no dist.callbacks()")
    found = sorted({epoch.workers for epoch in epochs})
    if found != [workers]:
        raise TfdistError(f"{path} is the run of {workers} worker(s), but its epochs report "
                          f"{' and '.join(map(str, found))} worker(s): the script did not join "
                          "the others (does it call tfdist.init() under the launcher?)")
    return Run(workers, repeat, tuple(epochs), str(path))


def load_runs(directory: Path) -> list[Run]:
    """Every run in ``directory/runs`` (``n<workers>-r<repeat>.jsonl``), by workers and repeat.

    Raises:
        TfdistError: No run file is there, or one cannot be read (see :func:`read_run`).
    """
    runs_dir = Path(directory) / RUNS
    named = sorted((parsed, path) for path in (runs_dir.iterdir() if runs_dir.is_dir() else ())
                   if (parsed := parse_run_name(path.name)) is not None)
    if not named:
        raise TfdistError(f"{runs_dir} holds no run files (n<WORKERS>-r<REPEAT>.jsonl): measure "
                          f"first, with `tfdist scaling -n 1,2 --out {directory} SCRIPT.py` or "
                          "the job of `tfdist job --kind scaling`")
    return [read_run(path, workers, repeat) for (workers, repeat), path in named]


# --------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class Row:
    """One size of the report; throughput in the report's unit, step times in milliseconds."""

    workers: int
    runs: int
    total: float
    total_min: float
    total_max: float
    per_worker: float
    speedup: float
    efficiency_pct: float
    ideal_total: float
    step_ms: float
    step_q1_ms: float
    step_q3_ms: float
    global_batch: int | None
    rank_excess_ms: float | None = None  # see Epoch.rank_excess_s; median over kept epochs
    slow_ranks: tuple[int, ...] = ()  # ranks the chief found slow in a kept epoch


@dataclass(frozen=True)
class Report:
    """The rows by workers, the unit (``examples/s`` or ``steps/s``), the backends and the
    numbers of epochs the runs had."""

    rows: tuple[Row, ...]
    unit: str
    backends: tuple[str, ...]
    epochs: tuple[int, ...]


def _unit(runs: Sequence[Run]) -> str:
    known = all(epoch.examples_per_s is not None for run in runs for epoch in run.kept)
    return EXAMPLES if known else STEPS


def run_rate(run: Run, unit: str) -> float:
    """A run's throughput: the median over its kept epochs, in ``unit``."""
    if unit == EXAMPLES:
        values = [epoch.examples_per_s for epoch in run.kept]
        if any(value is None for value in values):
            raise TfdistError(f"{run.source}: an epoch has no examples_per_s; report in {STEPS}")
        return statistics.median(value for value in values if value is not None)
    return statistics.median(1.0 / epoch.step_median for epoch in run.kept)


def summarize(runs: Sequence[Run]) -> Report:
    """Build the report of ``runs`` (see the module's docstring for the method).

    Raises:
        TfdistError: No runs.
    """
    if not runs:
        raise TfdistError("no runs to report")
    unit = _unit(runs)
    by_size: dict[int, list[Run]] = {}
    for one in runs:
        by_size.setdefault(one.workers, []).append(one)
    sizes = sorted(by_size)
    base = statistics.median(run_rate(one, unit) for one in by_size[sizes[0]])
    rows = []
    for size in sizes:
        group = by_size[size]
        rates = [run_rate(one, unit) for one in group]
        total = statistics.median(rates)
        speedup = total / base
        batches = {epoch.global_batch for one in group for epoch in one.kept}
        rows.append(Row(
            workers=size, runs=len(group), total=total, total_min=min(rates),
            total_max=max(rates), per_worker=total / size, speedup=speedup,
            efficiency_pct=100.0 * speedup / (size / sizes[0]),
            ideal_total=size * base / sizes[0],
            step_ms=1000 * _median_of(group, lambda epoch: epoch.step_median),
            step_q1_ms=1000 * _median_of(group, lambda epoch: epoch.step_q1),
            step_q3_ms=1000 * _median_of(group, lambda epoch: epoch.step_q3),
            global_batch=batches.pop() if len(batches) == 1 else None,
            rank_excess_ms=_rank_excess_ms(group),
            slow_ranks=tuple(sorted({e.slow_rank for one in group for e in one.kept
                                     if e.slow_rank is not None}))))
    backends = sorted({epoch.backend for one in runs for epoch in one.epochs})
    epochs = sorted({len(one.epochs) for one in runs})
    return Report(tuple(rows), unit, tuple(backends), tuple(epochs))


def _rank_excess_ms(group: Sequence[Run]) -> float | None:
    values = [e.rank_excess_s for one in group for e in one.kept if e.rank_excess_s is not None]
    return 1000 * statistics.median(values) if values else None


def _median_of(group: Sequence[Run], value: Callable[[Epoch], float]) -> float:
    """The median over runs of each run's median over its kept epochs."""
    return statistics.median(statistics.median(value(epoch) for epoch in one.kept)
                             for one in group)


def _throughput(row: Row) -> str:
    if row.runs == 1:
        return f"{row.total:.1f}"
    return f"{row.total:.1f} ({row.total_min:.1f}..{row.total_max:.1f})"


def table(report: Report) -> str:
    """The Markdown table of ``report``."""
    unit = report.unit
    ranks = any(row.rank_excess_ms is not None for row in report.rows)
    head = (f"| workers | {unit} (total) | {unit} per worker | speed-up | efficiency % "
            "| step time ms (q1..q3) |" + (" slowest rank's extra wait ms |" if ranks else ""))
    lines = [head, "|---:|---:|---:|---:|---:|---:|" + ("---:|" if ranks else "")]
    for row in report.rows:
        extra = ""
        if ranks:
            extra = " - |" if row.rank_excess_ms is None else f" {row.rank_excess_ms:.1f} |"
        lines.append(f"| {row.workers} | {_throughput(row)} | {row.per_worker:.1f} "
                     f"| {row.speedup:.2f} | {row.efficiency_pct:.1f} "
                     f"| {row.step_ms:.1f} ({row.step_q1_ms:.1f}..{row.step_q3_ms:.1f}) |"
                     + extra)
    return "\n".join(lines)


def markdown(report: Report) -> str:
    """``scaling.md``: a title, how the numbers were made, the table and notes."""
    rows = report.rows
    repeats = sorted({row.runs for row in rows})
    counted = "/".join(map(str, sorted({max(1, n - 1) for n in report.epochs})))
    method = (f"Throughput of a run: the median over its epochs after the first, which traces "
              f"the model ({counted} epoch(s) counted). "
              + ("A run of one epoch counts that one, tracing included: train 2 or more for "
                 "steady numbers. " if 1 in report.epochs else "")
              + (f"Per size: the median over {'/'.join(map(str, repeats))} runs, with their "
                 "range (min..max). " if repeats != [1] else "")
              + f"Speed-up and efficiency against {rows[0].workers} worker(s); the ideal is N "
              f"times its throughput per worker. Backend: {', '.join(report.backends)}.")
    notes = []
    if report.unit == STEPS:
        notes.append("The global batch size was not known to the meter, so throughput is in "
                      "steps/s (1 / median step time): the speed-up holds only if every size "
                      "trains the same global batch per step.")
    if any(row.rank_excess_ms is not None for row in rows):
        notes.append("The slowest rank's extra wait: per step, how much longer the rank that "
                     "waited most for a CPU or for its input waited than the other ranks' "
                     "median (median over the counted epochs; every rank waits for it).")
    for row in rows:
        if row.slow_ranks:
            notes.append(f"On {row.workers} workers the chief named rank(s) "
                         f"{', '.join(map(str, row.slow_ranks))} slow: see the runs' logs.")
    batches = {row.global_batch for row in rows}
    if len(batches) == 1 and None not in batches:
        notes.append(f"Global batch: {batches.pop()} at every size.")
    elif None not in batches:
        notes.append("Global batch: " + ", ".join(f"{row.global_batch} on {row.workers}"
                                                  for row in rows) + ".")
    return "\n\n".join(["# Scaling efficiency", method, table(report), *notes]) + "\n"


CSV_COLUMNS = ("workers", "runs", "unit", "total", "total_min", "total_max", "per_worker",
               "speedup", "efficiency_pct", "ideal_total", "step_ms", "step_q1_ms",
               "step_q3_ms", "global_batch", "rank_excess_ms")


def csv_text(report: Report) -> str:
    """``scaling.csv``: one row per size; ``total``, ``ideal_total`` and ``efficiency_pct``
    are the plotted points."""
    lines = [",".join(CSV_COLUMNS)]
    for row in report.rows:
        values = {**dataclasses.asdict(row), "unit": report.unit}
        lines.append(",".join(_csv_value(values[column]) for column in CSV_COLUMNS))
    return "\n".join(lines) + "\n"


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def plot(report: Report, path: Path) -> dict[str, list[tuple[float, float]]] | None:
    """Draw ``scaling.png``: throughput and the ideal by workers, efficiency on a second axis.

    Returns:
        The points as drawn (read back from the figure's lines), by series, or None when
        matplotlib is not installed.
    """
    try:
        import numpy as np
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rows = report.rows
    x = [row.workers for row in rows]
    figure = Figure(figsize=(6.4, 4.4), layout="constrained")
    axes = figure.add_subplot()
    measured = axes.errorbar(x, [row.total for row in rows],
                             yerr=[[row.total - row.total_min for row in rows],
                                   [row.total_max - row.total for row in rows]],
                             fmt="o-", capsize=3, label=f"measured ({report.unit})")
    (ideal,) = axes.plot(x, [row.ideal_total for row in rows], "--", color="gray",
                         label=f"ideal (N x per worker on {rows[0].workers})")
    axes.set(xlabel="workers", ylabel=f"{report.unit} (total)", xticks=x,
             title="Scaling efficiency")
    axes.set_ylim(bottom=0)
    second = axes.twinx()
    efficiency = [row.efficiency_pct for row in rows]
    (line,) = second.plot(x, efficiency, "s:", color="tab:orange", label="efficiency %")
    second.set(ylabel="efficiency %", ylim=(0, max(110.0, 1.1 * max(efficiency))))
    figure.legend(handles=[measured, ideal, line], loc="outside lower center", ncols=3,
                  fontsize="small")
    figure.savefig(path, dpi=120)
    return {name: [(float(a), float(b)) for a, b in np.asarray(artist.get_xydata(), dtype=float)]
            for name, artist in (("throughput", measured.lines[0]), ("ideal", ideal),
                                 ("efficiency", line))}


def write_report(report: Report, directory: Path) -> list[Path]:
    """Write ``scaling.md``, ``scaling.csv`` and, with matplotlib, ``scaling.png``.

    Returns:
        The files written.
    """
    directory = Path(directory)
    written = [directory / "scaling.md", directory / "scaling.csv"]
    written[0].write_text(markdown(report), encoding="utf-8")
    written[1].write_text(csv_text(report), encoding="utf-8")
    if plot(report, directory / "scaling.png") is not None:
        written.append(directory / "scaling.png")
    return written


# --------------------------------------------------------------------------------------------
# Running the sizes on this machine


@dataclass(frozen=True)
class Options:
    """What ``tfdist scaling`` runs: ``target`` (a script, or a module with ``module``) with
    ``args``, on each of ``sizes`` workers ``repeat`` times, each run within ``timeout_s``."""

    sizes: tuple[int, ...]
    target: str
    args: tuple[str, ...] = ()
    out_dir: Path = Path("scaling")
    repeat: int = 1
    timeout_s: float = 3600.0
    launch_args: tuple[str, ...] = ()
    module: bool = False


def _runs_dir(out_dir: Path) -> Path:
    """``out_dir/runs``, made; one line naming ``--out`` where it cannot be."""
    runs_dir = out_dir / RUNS
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out_dir}: cannot make the folder of the runs there "
                          f"({error.strerror or error}); choose a folder you can write to"
                          ) from None
    return runs_dir


def run(options: Options, out: TextIO | None = None, err: TextIO | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Run every size in turn, then write the report; ``tfdist scaling``.

    Prints one line per run, then the table, to ``out`` (default: stdout). The first run that
    fails or outlasts ``options.timeout_s`` ends it all: its size and the last lines of its
    output go to ``err`` (default: stderr).

    Returns:
        0, or the failed run's exit code (124 for a timeout).

    Raises:
        ConfigError: An impossible option.
        TfdistError: A run wrote no usable throughput records.
    """
    out, err = out or sys.stdout, err or sys.stderr
    env = dict(os.environ if environ is None else environ)
    commands = {size: launch_command(options.target, options.args, size,
                                     launch_args=options.launch_args, module=options.module)
                for size in options.sizes}
    order = plan(options.sizes, options.repeat)
    runs_dir = _runs_dir(options.out_dir)
    _say(out, f"{len(order)} run(s) of {', '.join(map(str, options.sizes))} worker(s), "
              f"{options.repeat} time(s) each; files in {options.out_dir}")
    # An earlier measurement's runs of other sizes would join a later `--report` of this folder.
    stale = [path for path in runs_dir.glob("n*-r*.jsonl")
             if parse_run_name(path.name) not in set(order)]
    for path in stale:
        path.unlink()
        path.with_suffix(".log").unlink(missing_ok=True)
    if stale:
        _say(out, f"removed {len(stale)} earlier run(s) of other sizes from {runs_dir}: "
                  f"{', '.join(sorted(path.name for path in stale))}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and max(options.sizes) > cores:
        _say(out, f"note: {max(options.sizes)} workers share this machine's {cores} cores, so "
                  "the largest sizes measure the cores rather than the scaling")
    done = []
    for workers, k in order:
        jsonl = (runs_dir / run_name(workers, k)).resolve()
        log = jsonl.with_suffix(".log")
        jsonl.unlink(missing_ok=True)  # the meter appends: no epochs of an earlier run
        code, seconds = _execute(commands[workers], {**env, THROUGHPUT_FILE: str(jsonl)}, log,
                                 options.timeout_s)
        if code != 0:
            why = {124: f"did not end within --timeout {options.timeout_s:g} s and was stopped",
                   130: "was interrupted"}.get(code, f"failed with exit code {code}")
            _say(err, f"the run of {workers} worker(s) (repeat {k}) {why} after {seconds:.1f} "
                      f"s; the last lines of {log}:\n{_tail(log)}")
            return code
        done.append(read_run(jsonl, workers, k))
        unit = _unit(done[-1:])
        _say(out, f"{workers} worker(s), repeat {k}/{options.repeat}: "
                  f"{run_rate(done[-1], unit):.1f} {unit}, {seconds:.1f} s ({log.name})")
    report = summarize(done)
    written = write_report(report, options.out_dir)
    out.write(table(report) + "\n")
    _written(out, written)
    return 0


def report_only(directory: Path, out: TextIO | None = None) -> int:
    """``tfdist scaling --report DIR``: the report of the runs already in ``DIR/runs``."""
    out = out or sys.stdout
    report = summarize(load_runs(directory))
    written = write_report(report, directory)
    out.write(table(report) + "\n")
    _written(out, written)
    return 0


def _written(out: TextIO, written: Sequence[Path]) -> None:
    if not any(path.suffix == ".png" for path in written):
        _say(out, PLOT_HINT)
    _say(out, "wrote " + ", ".join(map(str, written)))


def _say(out: TextIO, text: str) -> None:
    out.write(f"tfdist scaling: {text}\n")
    out.flush()


def _execute(argv: Sequence[str], env: Mapping[str, str], log: Path,
             timeout_s: float) -> tuple[int, float]:
    """Run one size with its output in ``log``; returns its exit code (124: timed out, 130:
    Ctrl-C) and seconds."""
    start = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = 124
        except KeyboardInterrupt:
            _stop(proc)
            code = 130
    return code, time.monotonic() - start


def _stop(proc: subprocess.Popen[bytes]) -> None:
    # tfdist launch passes SIGTERM on to its workers (each in a session of its own) and stops
    # them; SIGKILL only if it has not ended in time.
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "  (no output)"
    return "\n".join("  " + line for line in text.splitlines()[-lines:]) or "  (no output)"
