"""How the suite shares out over two test processes (tests/parallel.py), checked by running
pytest-xdist for real on a small generated suite: the grouped tests must land in one process.

xdist's loadgroup reads the group from a suffix it adds to each test's node id; pytest 9.2
changed node ids so that the suffix is silently lost and every test goes anywhere (xdist issue
1386): requirements pin pytest 9.1.1, and this test fails if grouping stops working again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT

pytest.importorskip("xdist", reason="pytest-xdist is not installed (requirements/test.txt)")

SUITE = {
    "conftest.py": 'pytest_plugins = ["parallel"]\n',
    "test_shared.py": """
        import os, pytest

        @pytest.fixture(scope="module", params=["a", "b"])
        def launch(request):
            return request.param

        @pytest.mark.parametrize("case", range(4))
        def test_case(launch, case):
            print(os.environ["PYTEST_XDIST_WORKER"])
        """,
    "test_cluster.py": """
        import pytest

        @pytest.mark.slurm
        @pytest.mark.parametrize("job", range(3))
        def test_job(job):
            pass
        """,
    "test_free.py": """
        import pytest

        @pytest.mark.parametrize("n", range(6))
        def test_free(n):
            pass
        """,
}


def _run(folder: Path) -> dict[str, str]:
    """Each test's process (gw0, gw1) by node id, from a verbose 2-process run of ``folder``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", str(folder)], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return {test: worker for worker, test in
            re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", run.stdout, re.M)}


def test_grouped_tests_run_in_one_process_and_the_rest_anywhere(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    where = _run(tmp_path)
    assert len(where) == 8 + 3 + 6, where

    def workers(prefix: str) -> set[str]:
        return {worker for test, worker in where.items() if test.startswith(prefix)}

    # Each parameter of the module fixture is a group (the launch runs once, in one process),
    # the cluster's tests another; xdist names the group after an "@" in the node id.
    for param in ("a", "b"):
        group = [test for test in where if test.endswith(f"@test_shared.py::launch={param}")]
        assert len(group) == 4 and len({where[test] for test in group}) == 1, where
    cluster = [test for test in where if test.startswith("test_cluster.py")]
    assert all(test.endswith("@slurm") for test in cluster), where
    assert len({where[test] for test in cluster}) == 1, where
    assert not any("@" in test for test in where if test.startswith("test_free.py")), where
