"""Runs the corpus: every Keras program in ``programs/``, in one process and on 2 workers.

Each program in ``programs/`` is a Keras script shaped like the ones users write (its docstring
names the public program it follows), changed only as the README says. Its ``# corpus:`` line
lists where it runs: ``mwms-k3`` (MultiWorkerMirroredStrategy, Keras 3), ``mwms-k2`` (tf_keras),
``hvd-k3``, ``hvd-k2`` (Horovod) and ``jax`` (Keras 3 on JAX). For each, ``tfdist verify``'s
comparison (:mod:`tfdist.verify`) runs the whole program (every step) in one process and on 2
local workers and gives one outcome:

- **equal**, **within rounding** (the bound and why);
- **told**: it differs and tfdist warned about it on the workers (the line);
- **refused**: the 2-worker run stopped before training with a tfdist line naming the fix;
- **differs**: it differs and nothing said so (a silent difference: a defect);
- **crashed**: the 2-worker run failed otherwise (a defect).

Usage (from the repository root)::

    python tests/corpus/run.py                  # every program, every run it lists: the table
    python tests/corpus/run.py --write          # ... keep the cells (results.json) and
                                                # rewrite docs/corpus.md's table from them
    python tests/corpus/run.py vae_sampling --runs mwms-k3   # some programs, some runs

docs/corpus.md holds the table of the last full run; tests/test_corpus.py runs a few cells of
it in CI and checks each against the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = HERE / "programs"
ROOT = HERE.parent.parent
DOC = ROOT / "docs" / "corpus.md"
sys.path.insert(0, str(ROOT))

from tfdist.verify.compare import CRASHED, DIFFERS, Verdict  # noqa: E402
from tfdist.verify.run import Options, verify  # noqa: E402

# The runs a program may list: the interpreter, the variables, tfdist launch's backend.
RUNS: dict[str, tuple[str, dict[str, str], str | None]] = {
    "mwms-k3": (".venv/bin/python", {"TF_USE_LEGACY_KERAS": "0"}, None),
    "mwms-k2": (".venv/bin/python", {"TF_USE_LEGACY_KERAS": "1"}, None),
    "hvd-k3": (".venv-horovod/bin/python", {"TF_USE_LEGACY_KERAS": "0"}, "horovod"),
    "hvd-k2": (".venv-horovod/bin/python", {"TF_USE_LEGACY_KERAS": "1"}, "horovod"),
    "jax": (".venv/bin/python", {"KERAS_BACKEND": "jax", "TF_USE_LEGACY_KERAS": "0"}, None),
}
TOLD, REFUSED = "told", "refused"
OUTCOMES = ("equal", "within rounding", TOLD, REFUSED, DIFFERS, CRASHED)
_LINE = re.compile(r"^# corpus:(?P<runs>( [a-z0-9-]+)+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Cell:
    """One program on one run: its outcome and the line that says why."""

    program: str
    run: str
    outcome: str
    line: str
    seconds: float = 0.0


def programs(folder: Path = PROGRAMS) -> dict[str, list[str]]:
    """Every program of the corpus, by name: the runs its ``# corpus:`` line lists."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        match = _LINE.search(path.read_text(encoding="utf-8"))
        if match is None:
            raise SystemExit(f"{path}: no '# corpus: RUN ...' line (runs: {', '.join(RUNS)})")
        runs = match["runs"].split()
        unknown = sorted(set(runs) - set(RUNS))
        if unknown:
            raise SystemExit(f"{path}: unknown runs {unknown} (known: {', '.join(RUNS)})")
        found[path.stem] = runs
    return found


def outcome(verdict: Verdict, refused: bool) -> tuple[str, str]:
    """The corpus's outcome of a verdict and its line (pure). ``refused``: the workers' run
    stopped before its first step with a tfdist line."""
    if verdict.outcome == CRASHED:
        return (REFUSED if refused else CRASHED), verdict.line
    if verdict.outcome == DIFFERS and verdict.told:
        return TOLD, f"{verdict.line} -- tfdist said: {verdict.told[0]}"
    return verdict.outcome, verdict.line


def run_cell(name: str, run: str, timeout_s: float = 300.0) -> Cell:
    """Runs program ``name`` on ``run``: its :class:`Cell`."""
    python, variables, backend = RUNS[run]
    environ = {**os.environ, **variables, "PYTHONHASHSEED": "0"}
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.monotonic()
    verdict, _, many = verify(str(PROGRAMS / f"{name}.py"), [], Options(
        backend=backend, steps=0, timeout_s=timeout_s, python=str(ROOT / python)), environ)
    stepped = any(r is not None and any(c["steps"] for c in r.calls) for r in many.records)
    refused = (verdict.outcome == CRASHED and not stepped
               and many.last_line().startswith("tfdist:"))
    kind, line = outcome(verdict, refused)
    return Cell(name, run, kind, line, time.monotonic() - start)


def markdown(cells: Iterable[Cell], listed: Mapping[str, Sequence[str]]) -> str:
    """docs/corpus.md's table: a row per program, a column per run (pure)."""
    by = {(c.program, c.run): c for c in cells}
    head = ["| program | " + " | ".join(RUNS) + " |", "|---|" + "---|" * len(RUNS)]
    rows, notes = [], []
    for name, runs in listed.items():
        shown = []
        for run in RUNS:
            cell = by.get((name, run))
            if run not in runs:
                shown.append("")
            elif cell is None:
                shown.append("not run")
            else:
                shown.append(cell.outcome)
                if cell.outcome not in ("equal", "within rounding"):
                    notes.append(f"- `{name}` on {run}: {cell.outcome}: {_one_line(cell.line)}")
        rows.append(f"| `{name}` | " + " | ".join(shown) + " |")
    return "\n".join([*head, *rows, "", *notes])


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def read_table(text: str) -> dict[tuple[str, str], str]:
    """The outcomes docs/corpus.md's table holds, by (program, run) (pure)."""
    found: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(RUNS) + 1 or not cells[0].startswith("`"):
            continue
        for run, value in zip(RUNS, cells[1:], strict=True):
            if value:
                found[(cells[0].strip("`"), run)] = value
    return found


RESULTS = HERE / "results.json"  # every cell's last outcome: --write keeps it, renders the doc


def load_results(path: Path = RESULTS) -> list[Cell]:
    """The cells of earlier runs (``--write``), or none."""
    if not path.exists():
        return []
    return [Cell(**cell) for cell in json.loads(path.read_text(encoding="utf-8"))]


def save_results(cells: Iterable[Cell], path: Path = RESULTS) -> None:
    rows = sorted((dataclasses.asdict(c) for c in cells), key=lambda c: (c["program"], c["run"]))
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


_BEGIN, _END = "<!-- corpus table: begin -->", "<!-- corpus table: end -->"


def write_doc(table: str, path: Path = DOC) -> None:
    """Replaces the table between docs/corpus.md's markers."""
    text = path.read_text(encoding="utf-8")
    head, _, rest = text.partition(_BEGIN)
    _, _, tail = rest.partition(_END)
    path.write_text(f"{head}{_BEGIN}\n{table}\n{_END}{tail}", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="programs (default: all)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), help="runs (default: listed)")
    parser.add_argument("--write", action="store_true", help="rewrite docs/corpus.md's table")
    args = parser.parse_args(argv)
    listed = programs()
    names = args.names or list(listed)
    cells = []
    for name in names:
        for run in listed[name]:
            if args.runs and run not in args.runs:
                continue
            cell = run_cell(name, run)
            cells.append(cell)
            print(f"{name:34} {run:8} {cell.outcome:16} {cell.seconds:5.0f} s  "
                  f"{_one_line(cell.line)[:160]}", flush=True)
    print(markdown(cells, {n: listed[n] for n in names}))
    if args.write:
        kept = {(c.program, c.run): c for c in load_results()}
        kept.update({(c.program, c.run): c for c in cells})
        cells_now = [c for key, c in kept.items() if key[0] in listed and key[1] in listed[key[0]]]
        save_results(cells_now)
        write_doc(markdown(cells_now, listed))
    silent = [c for c in cells if c.outcome in (DIFFERS, CRASHED)]
    print(f"{len(cells)} runs: " + ", ".join(
        f"{sum(c.outcome == o for c in cells)} {o}" for o in OUTCOMES))
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
