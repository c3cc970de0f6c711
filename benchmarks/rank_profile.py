"""Is the straggler found, and only then? And what does the per-rank profile cost?

    .venv/bin/python benchmarks/rank_profile.py [--balanced 10] [--noisy 3] [--epochs 6]

Runs ``tests/workers/straggler_worker.py`` (a small MLP, ``fit`` on 2 MWMS workers under
``tfdist launch``, each pinned to its own core), alternating: a balanced run, then a run in
which rank 1 gets two busy processes on its core from epoch 3 on, until each kind has run its
count. Per run it prints the epochs' step times, each rank's queue wait per step and the ranks
the chief named slow. At the end: how many balanced runs named a rank (target: none), how many
noisy runs named rank 1 for a CPU (target: all), and the profile's cost (reading the
counters and the one sum at each epoch's end, which the record keeps as ``profile_s``) as a
share of the epoch's time: median and spread over every epoch of every run (target: at most
1 %). Run it on a quiet machine: another job's load on one core is a neighbour too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"tfdist: rank (\d+) \(host [^)]+\) is slow in \d+ epochs in a row: .* "
                   r"Likely cause: (\w+)\.")


def run_once(noisy_from: int, epochs: int) -> tuple[list[tuple[str, str]], list[dict]]:
    """One launch: the (rank, cause) pairs named, and the chief's records."""
    with tempfile.TemporaryDirectory(prefix="tfdist-profile-") as out:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",  # two neighbours, rank 1 not reniced
               "STRAGGLER_NEIGHBOURS": "2", "STRAGGLER_NICE": "0"}
        cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2",
               str(ROOT / "tests" / "workers" / "straggler_worker.py"), out, "mwms",
               str(noisy_from), str(epochs)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise SystemExit(f"the run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        records = [json.loads(line) for line in
                   Path(out, "model", "throughput.jsonl").read_text().splitlines()]
    return NAMED.findall(done.stdout + done.stderr), records


def describe(kind: str, named: list[tuple[str, str]], records: list[dict]) -> str:
    steps = " ".join(f"{r['step_time_s']['median'] * 1e3:.1f}" for r in records)
    queued = " ".join("/".join(f"{p['queued_s'] * 1e3:.0f}" for p in r["ranks"])
                      for r in records)
    return (f"{kind:8} step ms: {steps}; queue wait ms a step, rank 0/1: {queued}; "
            f"named: {sorted(set(named)) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--balanced", type=int, default=10)
    parser.add_argument("--noisy", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    order = []  # alternating: balanced, noisy, balanced, ... until each count is run
    for index in range(max(args.balanced, args.noisy)):
        order += ["balanced"] * (index < args.balanced) + ["noisy"] * (index < args.noisy)
    falsely, found, costs, seconds = 0, 0, [], []
    for number, kind in enumerate(order, 1):
        noisy_from = 3 if kind == "noisy" else args.epochs
        named, records = run_once(noisy_from, args.epochs)
        print(f"run {number} {describe(kind, named, records)}", flush=True)
        if kind == "balanced":
            falsely += bool(named)
        else:
            found += bool(named) and set(named) == {("1", "cpu")}
        costs += [r["profile_s"] / r["epoch_s"] for r in records if r.get("epoch_s")]
        seconds += [r["profile_s"] for r in records[1:]]  # the first traces the sum
    print(f"balanced runs that named a rank: {falsely} of {args.balanced}; noisy runs that "
          f"named rank 1 (cpu), and no other: {found} of {args.noisy}")
    print(f"the profile's cost, share of an epoch's time: median "
          f"{100 * statistics.median(costs):.3f} % (spread {100 * min(costs):.3f}-"
          f"{100 * max(costs):.3f} %) over {len(costs)} epochs; after the first epoch (which "
          f"traces the sum) it takes {1e3 * statistics.median(seconds):.2f} ms an epoch "
          f"(spread {1e3 * min(seconds):.2f}-{1e3 * max(seconds):.2f})")


if __name__ == "__main__":
    main()
