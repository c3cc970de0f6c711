"""docs/architecture.md is held to the code: every module of tfdist is named in it, every path
it names exists, every backend of the table appears, and the methods its recipe for a backend
lists are the handle's."""

from __future__ import annotations

import ast
import re

import pytest
from helpers import ROOT

from tfdist import backend_facts as facts
from tfdist.backends.base import Distributed

DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text()
MODULES = sorted(p.relative_to(ROOT) for p in (ROOT / "tfdist").rglob("*.py"))


def named(module) -> bool:
    """Its path, or its file name in the doc where its package is named too."""
    package = f"{module.parent}/"
    if str(module) in TEXT:
        return True
    if module.name == "__init__.py":
        return package in TEXT
    return package in TEXT and f"`{module.name}`" in TEXT


@pytest.mark.parametrize("module", MODULES, ids=str)
def test_every_module_is_named(module):
    assert named(module), f"{module} is not in {DOC.name}: give it a line in its room's row"


def test_every_path_the_doc_names_exists():
    paths = set(re.findall(r"`((?:tfdist|tests|docs|tools|examples|jobscripts)/[\w./<>-]*)`",
                           TEXT))
    missing = sorted(p for p in paths if "<" not in p and not (ROOT / p).exists())
    assert not missing, f"{DOC.name} names paths that do not exist: {missing}"


def test_every_backend_of_the_table_appears():
    names = {row.name for row in facts.BACKENDS} | {row.job_name for row in facts.BACKENDS
                                                     if row.job_name}
    assert {name for name in names if f"`{name}`" not in TEXT} == set()


def test_the_recipe_for_a_backend_names_the_handles_methods():
    recipe = TEXT[TEXT.index("**A backend.**"):TEXT.index("**A job launcher.**")]
    methods = set(re.findall(r"`(\w+)`", recipe.split("overriding what differs:")[1]
                             .split("; and `create")[0]))
    assert methods and {m for m in methods if not hasattr(Distributed, m)} == set(), methods


LONGEST = 60  # lines, docstring included


def test_no_function_is_longer_than_the_bound():
    long = []
    for path in (ROOT / "tfdist").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions longer than {LONGEST} lines: split them: {long}"


def test_every_patch_of_the_inventory_is_in_the_doc():
    from tfdist.patches import INVENTORY

    assert [p.key for p in INVENTORY if f"| `{p.key}` |" not in TEXT] == []
