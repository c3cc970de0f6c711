"""tools/timed.py: the table `make test` ends with (pure parts, and one real run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from helpers import ROOT

_spec = importlib.util.spec_from_file_location("timed", ROOT / "tools" / "timed.py")
assert _spec is not None and _spec.loader is not None
timed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timed)

PHASES = {
    # name: (phases.tsv, expected phases: name, seconds, start, worst status)
    "one step": ("lint\t10.0\t12.5\t0\n", [("lint", 2.5, 10.0, 0)]),
    "a phase of several commands adds up, the worst status counts": (
        ".venv\t1.0\t3.0\t0\n.venv\t3.0\t4.0\t2\n", [(".venv", 3.0, 1.0, 2)]),
    "phases at once, in the order they started": (
        "b\t5.0\t9.0\t0\na\t2.0\t8.0\t0\n", [("a", 6.0, 2.0, 0), ("b", 4.0, 5.0, 0)]),
    "nothing yet": ("", []),
}


@pytest.mark.parametrize("case", sorted(PHASES))
def test_phases(case):
    text, expected = PHASES[case]
    assert timed.phases(text) == expected


JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_a" name="test_x" time="3.5"/>
<testcase classname="tests.test_b" name="test_y[p]" time="12.0"/>
<testcase classname="tests.test_a" name="test_z" time="0.1"/>
</testsuite></testsuites>"""


def test_slowest_tests_of_every_run_first():
    found = timed.slowest({"venv": JUNIT, "venv-tf215": JUNIT.replace("12.0", "7.0")}, count=3)
    assert found == [(12.0, "venv", "tests/test_b.py::test_y[p]"),
                     (7.0, "venv-tf215", "tests/test_b.py::test_y[p]"),
                     (3.5, "venv", "tests/test_a.py::test_x")]


def test_a_failing_step_keeps_its_status_and_the_report_shows_it(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "timed.py")]
    ok = subprocess.run([*tool, "run", str(tmp_path), "system", "--", "true"], check=False)
    failed = subprocess.run([*tool, "run", str(tmp_path), "lint", "--", "false"], check=False)
    assert (ok.returncode, failed.returncode) == (0, 1)
    (tmp_path / "venv.xml").write_text(JUNIT)
    report = subprocess.run([*tool, "report", str(tmp_path)], capture_output=True, text=True,
                            check=True).stdout
    assert "system" in report and "lint" in report and "(exit 1)" in report, report
    assert "in all" in report and "tests/test_b.py::test_y[p]" in report, report
