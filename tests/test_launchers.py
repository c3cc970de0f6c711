"""The launcher table (tfdist/env/launchers.py): every launch that detection finds has a row, a
row holds what its launcher does, and launcher names are compared in tfdist/env/ and
tfdist/jobs/ only: the other rooms read a column of ``environment.facts``."""

from __future__ import annotations

import ast
from dataclasses import fields

import pytest
from helpers import ROOT
from test_env import DETECTED

from tfdist.env import ClusterEnvironment, detect
from tfdist.env.launchers import LAUNCHERS, launcher
from tfdist.errors import ConfigError

PACKAGE = ROOT / "tfdist"
# The rooms that may name launchers: detection, and tfdist job's `launcher` key (the commands
# of a job script: srun, torchrun, mpirun, horovodrun).
ROOMS = (PACKAGE / "env", PACKAGE / "jobs")
# The launchers' names (ClusterEnvironment.launcher) that mean nothing else; "local" (also a
# step_logs mode and a collective) and "single" (also a backend) count only where the other side
# is about a launcher, and "srun" is a command (tfdist survive checks its program's name).
NAMES = {"slurm", "tf_config", "torchrun", "horovodrun", "mpirun"}
WORDS = {"local", "single"}
# Comparisons with a launcher's name left outside the rooms, at most: none (22 in 10 modules
# before the table). A room that must tell launchers apart reads a column.
MOST_OUTSIDE = 0


def test_every_detected_launch_has_a_row_and_every_row_is_detected():
    found = {(env.launcher, env.launched_for)
             for env in (detect(environ) for environ, _ in DETECTED.values())}
    assert found == {(row.name, row.launched_for) for row in LAUNCHERS}
    for name, launched_for in found:
        row = ClusterEnvironment(name, launched_for=launched_for).facts
        assert (row.name, row.launched_for) == (name, launched_for)


def test_the_launchers_are_the_documented_ones():
    names = {row.name for row in LAUNCHERS}
    doc = ClusterEnvironment.__doc__ or ""
    assert all(f'``"{name}"``' in doc for name in names), names
    assert len({(row.name, row.launched_for) for row in LAUNCHERS}) == len(LAUNCHERS)


COLUMNS = {  # the columns that are true for each row; every other is false
    ("slurm", None): {"horovod_joins", "serves_rendezvous", "slurm_addresses",
                      "output_per_task", "batch_script_steps"},
    ("tf_config", None): {"tf_config_addresses"},
    ("local", "mwms"): {"tf_config_addresses"},
    ("local", "horovod"): {"horovod", "horovod_joins"},
    ("torchrun", None): {"torch_store"},
    ("horovodrun", None): {"horovod", "horovod_joins"},
    ("mpirun", None): {"horovod", "horovod_joins"},
    ("single", None): {"horovod_joins", "one_process"},
}


@pytest.mark.parametrize(("name", "launched_for"), sorted(COLUMNS, key=str))
def test_a_row_holds_what_its_launcher_does(name, launched_for):
    row = launcher(name, launched_for)
    true = {f.name for f in fields(row) if f.type == "bool" and getattr(row, f.name)}
    assert true == COLUMNS[name, launched_for]
    assert row.tfdist_launch is (name == "local")


def test_tfdist_launch_without_a_backend_is_mwms_row():
    # A ClusterEnvironment("local") made by hand (tests, scripts) reads as TF_CONFIG workers.
    assert launcher("local") is launcher("local", "mwms")
    assert ClusterEnvironment("local").facts is launcher("local", "mwms")


def test_an_unknown_launcher_names_the_choices():
    with pytest.raises(ConfigError, match="launcher 'srun' is not one of slurm, tf_config, "
                                          "local, torchrun, horovodrun, mpirun, single"):
        launcher("srun")


def launcher_comparisons(source: str) -> list[int]:
    """The lines of the comparisons in ``source`` that ask which launcher started the processes:
    a ``launcher`` or ``launched_for`` compared with anything, a launcher's name (or a tuple of
    them) compared with anything; ``"local"`` and ``"single"`` only against a launcher."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = {value for operand in operands for value in _strings(operand)}
        others = " ".join(ast.get_source_segment(source, o) or "" for o in operands
                          if not _strings(o))
        about_launcher = "launcher" in others or "launched_for" in others
        if about_launcher or named & NAMES:
            lines.append(node.lineno)
    return lines


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


@pytest.mark.parametrize(("source", "counted"), [
    ('environment.launcher == "slurm"', True),
    ('launcher in ("local", "tf_config")', True),
    ('env.launched_for != "horovod"', True),
    ('environment.launcher in HOROVOD_LAUNCHERS', True),
    ('name == "torchrun"', True),
    ('"mpirun" in text', True),
    ('srun[0].rsplit("/", 1)[-1] != "srun"', False),  # a command's program
    ('mode == "local"', False),             # a step_logs mode
    ('chosen == "single"', False),          # a backend (tests/test_backend_facts.py)
    ('environment.facts.slurm_addresses and x == 1', False),
])
def test_the_counter_tells_a_launcher_comparison(source, counted):
    assert bool(launcher_comparisons(source)) is counted


def test_launcher_names_are_compared_in_the_launcher_rooms_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if not any(room in path.parents for room in ROOMS):
            found += [f"{path.relative_to(ROOT)}:{line}"
                      for line in launcher_comparisons(path.read_text())]
    assert len(found) <= MOST_OUTSIDE, (
        f"{len(found)} comparisons with a launcher's name outside tfdist/env/ and tfdist/jobs/ "
        f"(at most {MOST_OUTSIDE}): {found}. Read a column of the launcher table "
        "(environment.facts, tfdist/env/launchers.py) instead, or add one")
