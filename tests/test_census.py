"""tools/census.py: which test each process of a run belongs to, and what it cost."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import venv

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("census", ROOT / "tools" / "census.py")
assert _spec is not None and _spec.loader is not None
census = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(census)

LOG = [
    # pytest's worker (no test yet), a test's launcher, its two ranks (one stopped by
    # os._exit: no exit line), and a Slurm task (its parent is slurmstepd: no ancestor).
    "S\t10\t1\t-\t-c",
    "S\t11\t10\ttests/test_a.py::test_one@group_(call)\t-m tfdist launch",
    "S\t12\t11\t-\tworker.py 0",
    "S\t13\t11\t-\tworker.py 1",
    "S\t20\t2\t-\texamples/keras_train.py",
    "E\t12\t9.50\ttensorflow",
    "E\t11\t0.25\t-",
    "E\t20\t12.00\ttensorflow",
    "E\t10\t3.00\t-",
]


def test_each_process_counts_for_the_test_of_its_nearest_recorded_ancestor():
    kinds, by = census.tally(LOG)
    # pytest's worker and the Slurm task: no test of their own or of an ancestor.
    assert by["test"] == {"tests/test_a.py::test_one": [3, 1, 9.75], "?": [2, 0, 15.0]}
    assert by["module"]["tests/test_a.py"] == [3, 1, 9.75]
    assert kinds == {"-": [2, 3.25], "tensorflow": [2, 21.5], "no exit line": [1, 0.0]}


def test_the_hook_records_a_child_only_where_the_variable_is_set(tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    census.install([str(env_dir)])
    python = str(env_dir / "bin" / "python")
    log = tmp_path / "census.log"
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import json'])"
    subprocess.run([python, "-c", child], env={**os.environ, "TFDIST_CENSUS_LOG": str(log)},
                   check=True, timeout=60)
    subprocess.run([python, "-c", "pass"], env={k: v for k, v in os.environ.items()
                                                  if k != "TFDIST_CENSUS_LOG"},
                   check=True, timeout=60)
    lines = log.read_text().splitlines()
    assert [line.split("\t")[0] for line in lines].count("S") == 2, lines
    kinds, _ = census.tally(lines)
    assert kinds["-"][0] == 2, kinds  # both exited normally, neither imported a framework
    census.uninstall([str(env_dir)])
    assert not list(env_dir.glob("lib/python3*/site-packages/_tfdist_census*"))
