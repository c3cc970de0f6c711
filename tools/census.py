"""Where the tests' processor time goes: a census of the Python processes a command starts.

    python tools/census.py install .venv .venv-horovod .venv-tf215
    TFDIST_CENSUS_LOG=/tmp/census.log .venv/bin/python -m pytest -n 2 --dist loadgroup
    python tools/census.py report /tmp/census.log [--tests N]
    python tools/census.py uninstall .venv .venv-horovod .venv-tf215

``install`` puts a ``.pth`` hook in each environment: every Python process started there while
``TFDIST_CENSUS_LOG`` is set (it passes through the launchers, srun and pytest's children)
appends a start line (pid, parent, the pytest test that was running, its arguments) and, at a
normal exit, its processor seconds and what it imported (tensorflow, jax, torch or neither).
A process ending by ``os._exit`` or a signal leaves no exit line: ``report`` counts those apart.
``report`` attributes each process to the test of its nearest recorded ancestor (a Slurm job's
tasks have none: ``?``) and prints the seconds by module and by test. The hook does nothing
without the variable; ``uninstall`` removes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HOOK = "_tfdist_census"
HOOK_SOURCE = '''\
import os
_LOG = os.environ.get("TFDIST_CENSUS_LOG")
if _LOG:
    import atexit, resource, sys, time

    def _write(line):
        try:
            fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            os.write(fd, (line + "\\n").encode())
            os.close(fd)
        except OSError:
            pass

    _test = os.environ.get("PYTEST_CURRENT_TEST", "-").replace(" ", "_")
    _write("S\\t%d\\t%d\\t%s\\t%s" % (os.getpid(), os.getppid(), _test, " ".join(sys.argv)[:200]))

    def _end():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        kind = next((m for m in ("tensorflow", "jax", "torch") if m in sys.modules), "-")
        _write("E\\t%d\\t%.2f\\t%s" % (os.getpid(), usage.ru_utime + usage.ru_stime, kind))

    atexit.register(_end)
'''


def _site_packages(venv: str) -> Path:
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"tools/census.py: no site-packages under {venv}")
    return found[0]


def install(venvs: list[str]) -> None:
    for venv in venvs:
        site = _site_packages(venv)
        (site / f"{HOOK}.py").write_text(HOOK_SOURCE)
        (site / f"{HOOK}.pth").write_text(f"import {HOOK}\n")
        print(f"census hook in {site}")


def uninstall(venvs: list[str]) -> None:
    for venv in venvs:
        site = _site_packages(venv)
        for name in (f"{HOOK}.py", f"{HOOK}.pth"):
            (site / name).unlink(missing_ok=True)


def tally(lines: list[str]) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """The log's processes: by what they imported, and by module and by test (each row:
    processes, those without an exit line, processor seconds)."""
    started: dict[str, tuple[str, str]] = {}  # pid: (parent, test)
    ended: dict[str, tuple[float, str]] = {}  # pid: (processor seconds, import)
    for line in lines:
        fields = line.split("\t")
        if fields[0] == "S" and len(fields) >= 4:
            started[fields[1]] = (fields[2], fields[3])
        elif fields[0] == "E" and len(fields) == 4:
            ended[fields[1]] = (float(fields[2]), fields[3])

    def test_of(pid: str) -> str:
        for _ in range(32):
            if pid not in started:
                return "?"
            parent, test = started[pid]
            if test != "-":
                return test.split("@")[0].removesuffix("_(call)").removesuffix("_(setup)")
            pid = parent
        return "?"

    kinds: dict[str, list[float]] = {}
    by: dict[str, dict[str, list[float]]] = {"module": {}, "test": {}}
    for pid in started:
        test = test_of(pid)
        cpu, kind = ended.get(pid, (0.0, "no exit line"))
        row = kinds.setdefault(kind, [0, 0.0])
        row[0] += 1
        row[1] += cpu
        for key, name in (("module", test.split("::")[0]), ("test", test)):
            row = by[key].setdefault(name, [0, 0, 0.0])
            row[0] += 1
            row[1] += pid not in ended
            row[2] += cpu
    return kinds, by


def report(log: str, tests: int) -> None:
    kinds, by = tally(Path(log).read_text().splitlines())
    print(f"{sum(int(n) for n, _ in kinds.values())} processes, "
          f"{sum(cpu for _, cpu in kinds.values()):.0f} processor seconds recorded")
    for kind, (count, cpu) in sorted(kinds.items(), key=lambda item: -item[1][0]):
        print(f"  {kind:>14}: {int(count):5d} processes {cpu:8.0f} s")
    for key, limit in (("module", None), ("test", tests)):
        print(f"\nby {key} (processes, without an exit line, seconds):")
        rows = sorted(by[key].items(), key=lambda item: -item[1][2])
        for name, (count, unended, cpu) in rows[:limit]:
            print(f"  {int(count):5d} {int(unended):4d} {cpu:8.0f}  {name}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "uninstall"):
        sub.add_parser(name).add_argument("venvs", nargs="+")
    reporting = sub.add_parser("report")
    reporting.add_argument("log")
    reporting.add_argument("--tests", type=int, default=30)
    args = parser.parse_args(argv)
    if args.command == "install":
        install(args.venvs)
    elif args.command == "uninstall":
        uninstall(args.venvs)
    else:
        report(args.log, args.tests)


if __name__ == "__main__":
    main(sys.argv[1:])
