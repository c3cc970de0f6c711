"""Times the phases of `make test` and prints where the time went.

    python3 tools/timed.py run DIR NAME -- COMMAND...   runs COMMAND, records its wall time
    python3 tools/timed.py report DIR                   prints the phases and the slowest tests

`run` appends one line per command to DIR/phases.tsv (name, start, end, exit status) and exits
with the command's status; several commands may share a NAME (their times add up) and phases
may run at once (the report gives the wall time from the first start to the last end too).
`report` reads that file and every pytest JUnit file DIR/*.xml (`--junitxml`), and prints the
phases in the order they started and the 15 slowest tests of all runs (setup, call and teardown
together). Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

PHASES = "phases.tsv"
SLOWEST = 15


def run(folder: Path, name: str, command: list[str]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        status = subprocess.call(command)
    except KeyboardInterrupt:
        status = 130
    with open(folder / PHASES, "a") as f:
        f.write(f"{name}\t{start:.3f}\t{time.time():.3f}\t{status}\n")
    return status


def phases(text: str) -> list[tuple[str, float, float, int]]:
    """The phases of a phases.tsv, one per name in the order they first started:
    (name, seconds summed over its commands, first start, worst exit status)."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        name, start, end, status = line.split("\t")
        seen = found.setdefault(name, [0.0, float(start), 0.0])
        seen[0] += float(end) - float(start)
        seen[1] = min(seen[1], float(start))
        seen[2] = max(seen[2], float(status))
    ordered = sorted(found.items(), key=lambda item: item[1][1])
    return [(name, seconds, start, int(status)) for name, (seconds, start, status) in ordered]


def slowest(junit_texts: dict[str, str], count: int = SLOWEST) -> list[tuple[float, str, str]]:
    """The ``count`` slowest tests of the JUnit files: (seconds, run, test id)."""
    tests = []
    for run_name, text in junit_texts.items():
        for case in ET.fromstring(text).iter("testcase"):
            module = case.get("classname", "").replace(".", "/")
            tests.append((float(case.get("time", 0)), run_name, f"{module}.py::{case.get('name')}"))
    return sorted(tests, key=lambda test: -test[0])[:count]


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def report(folder: Path) -> str:
    lines = ["", "make test: where the time went (wall clock, m:ss)"]
    path = folder / PHASES
    text = path.read_text() if path.exists() else ""
    found = phases(text)
    if found:
        first = min(start for _, _, start, _ in found)
        last = max(float(line.split("\t")[2]) for line in text.splitlines())
        width = max(len(name) for name, *_ in found)
        for name, seconds, start, status in found:
            failed = "" if status == 0 else f"  (exit {status})"
            lines.append(f"  {name:<{width}}  {_minutes(seconds):>7}  "
                         f"from +{_minutes(start - first)}{failed}")
        lines.append(f"  {'in all':<{width}}  {_minutes(last - first):>7}")
    junit = {p.stem: p.read_text() for p in sorted(folder.glob("*.xml"))}
    tests = slowest(junit)
    if tests:
        lines.append(f"the {len(tests)} slowest tests (s, pytest run, test):")
        lines += [f"  {seconds:6.1f}  {run_name}  {test}" for seconds, run_name, test in tests]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) >= 5 and argv[0] == "run" and argv[3] == "--":
        return run(Path(argv[1]), argv[2], argv[4:])
    if len(argv) == 2 and argv[0] == "report":
        print(report(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
