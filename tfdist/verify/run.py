"""``tfdist verify SCRIPT [ARGS]``: the script in one process, then on N local workers, compared.

Both runs get the same arguments, the same seed (``TFDIST_VERIFY_SEED``, applied when the
strategy is created) and the same global batch (the script's: ``dist.shard`` splits it, and
``dist.scale_lr`` scales by the N workers' replicas in both runs); each ``fit`` stops after
``--steps`` steps. :mod:`tfdist.verify.record` writes each process's record;
:func:`tfdist.verify.compare.compare` gives the verdict, printed in one line with the cause and
the fix when the runs differ. The exit status: 0 equal or within rounding, 1 differs, 2 a run
failed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tfdist.verify import DIR, REPLICAS, SEED, STEPS
from tfdist.verify.compare import CRASHED, DIFFERS, Record, Run, Verdict, compare

__all__ = ["Options", "exit_status", "last_lines", "run_once", "verify"]


@dataclass(frozen=True)
class Options:
    """How ``tfdist verify`` runs the script."""

    workers: int = 2
    backend: str | None = None  # tfdist launch --backend (None: the launch's default)
    steps: int = 10  # each fit stops after this many steps; 0: as many as the script runs
    seed: int = 0
    timeout_s: float = 600.0  # each run
    python: str = sys.executable
    keep: str | None = None  # keep the records in this folder


def run_once(command: Sequence[str], folder: str, world_size: int,
             environ: Mapping[str, str], timeout_s: float) -> Run:
    """Runs ``command`` with the record written into ``folder``; its :class:`Run`."""
    os.makedirs(folder, exist_ok=True)
    env = {**environ, DIR: folder}
    try:
        done = subprocess.run(list(command), env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as error:
        said = error.output or ""
        output = said.decode(errors="replace") if isinstance(said, bytes) else said
        code, output = 124, output + f"\ntfdist verify: the run did not end in {timeout_s:g} s"
    return Run(code, output, [Record.load(folder, rank) for rank in range(world_size)])


def verify(script: str, args: Sequence[str], options: Options,
           environ: Mapping[str, str] | None = None) -> tuple[Verdict, Run, Run]:
    """Runs ``script`` in one process and on ``options.workers`` local workers; the verdict
    and both runs."""
    base = dict(os.environ if environ is None else environ)
    base.update({STEPS: str(options.steps), SEED: str(options.seed),
                 # every step's logs over all workers, so they compare with one process's
                 "TFDIST_STEP_LOGS": "global"})
    base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    folder = options.keep or tempfile.mkdtemp(prefix="tfdist-verify-")
    try:
        one = run_once([options.python, script, *args], os.path.join(folder, "one"), 1,
                       {**base, REPLICAS: str(options.workers)}, options.timeout_s)
        launch = [options.python, "-m", "tfdist", "launch", "-n", str(options.workers)]
        if options.backend:
            launch += ["--backend", options.backend]
        many = run_once([*launch, script, *args], os.path.join(folder, f"n{options.workers}"),
                        options.workers, base, options.timeout_s)
    finally:
        if options.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    return compare(one, many), one, many


def last_lines(output: str, keep: int) -> list[tuple[str, list[str]]]:
    """A failed run's output in parts, each with its last ``keep`` lines (pure): each rank's
    (``tfdist launch`` prefixes its lines with ``[R]``), the first that failed first (its
    ``worker R exited`` line, else the lowest rank), then the launcher's own lines."""
    parts: dict[str, list[str]] = {}
    for line in output.splitlines():
        rank, found, rest = line[1:].partition("] ") if line.startswith("[") else ("", "", line)
        if found and rank.isdigit():
            parts.setdefault(f"rank {rank}", []).append(rest)
        else:
            parts.setdefault("", []).append(line)
    failed = re.search(r"worker (\d+) exited with code", output)
    first = f"rank {failed.group(1)}" if failed else None
    order = sorted((name for name in parts if name), key=lambda n: (n != first, int(n[5:])))
    return [(name, parts[name][-keep:]) for name in [*order, ""] if name in parts]


def exit_status(verdict: Verdict) -> int:
    """0 equal or within rounding, 1 differs, 2 a run failed."""
    return {DIFFERS: 1, CRASHED: 2}.get(verdict.outcome, 0)


def main(script: str, args: Sequence[str], options: Options, show_output: bool = False) -> int:
    """The ``tfdist verify`` command: runs, prints the verdict, returns the exit status."""
    backend = options.backend or "the launch's default"
    steps = f"{options.steps} steps per fit" if options.steps else "every step"
    print(f"tfdist verify: {script} in one process, then on {options.workers} workers "
          f"({backend}; the script's global batch, seed {options.seed}, {steps})", flush=True)
    verdict, one, many = verify(script, args, options)
    if show_output or verdict.outcome == CRASHED:
        for title, run in (("one process", one), (f"{options.workers} workers", many)):
            for part, lines in last_lines(run.output, 30):
                where = f", {part}" if part else ""
                print(f"--- {title}{where} (exit {run.returncode}), the last lines:\n"
                      + "\n".join(lines), flush=True)
    print(f"tfdist verify: {verdict.line}", flush=True)
    for line in verdict.told:
        print(f"tfdist verify: tfdist warned on the workers: {line}", flush=True)
    return exit_status(verdict)
