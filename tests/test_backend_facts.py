"""The backend table (tfdist/backend_facts.py): the rooms that behave differently per backend
read its columns, and backend names are compared in the backend rooms only (the count outside
them is held to a bound)."""

from __future__ import annotations

import ast
import importlib

import pytest
from helpers import ROOT

from tfdist import backend_facts as facts
from tfdist import settings
from tfdist.backends import MODULES, TORCH_BACKENDS
from tfdist.errors import ConfigError
from tfdist.jobs import choices

PACKAGE = ROOT / "tfdist"
# The rooms that may name backends: the TensorFlow backends' package, Horovod's own package
# (both frameworks' Horovod backends use it) and every module the table names (the torch
# backends).
ROOMS = {PACKAGE / "backends", PACKAGE / "horovod"} | {
    PACKAGE.parent / (row.module.replace(".", "/") + ".py") for row in facts.BACKENDS}
NAMES = {row.name for row in facts.BACKENDS} | {row.job_name for row in facts.BACKENDS
                                                if row.job_name}
# Backend-name comparisons left outside the rooms, at most: none (24 before the table; the
# target was 6). A room that must tell backends apart reads a column of the table.
MOST_OUTSIDE = 0


def test_every_row_names_a_module_that_exists_and_is_unique_per_framework():
    for row in facts.BACKENDS:
        assert (PACKAGE.parent / (row.module.replace(".", "/") + ".py")).is_file(), row
        assert row.devices_per_process in ("one", "several"), row
        assert row.framework in (facts.TF, facts.TORCH, facts.JAX), row
        assert facts.backend(row.name, row.framework) is row
    keys = [(row.name, row.framework) for row in facts.BACKENDS]
    assert len(keys) == len(set(keys))


def test_the_choices_everywhere_come_from_the_table():
    assert settings.setting("backend").choices == (
        "auto", "mwms", "horovod", "mirrored", "single", "jax", "ddp", "deepspeed")
    assert MODULES == {"mwms": "tfdist.backends.mwms", "horovod": "tfdist.backends.horovod",
                       "mirrored": "tfdist.backends.mirrored",
                       "single": "tfdist.backends.single", "jax": "tfdist.backends.keras_jax"}
    assert TORCH_BACKENDS == ("ddp", "horovod", "deepspeed")
    assert choices.BACKENDS == ("mwms", "horovod", "jax", "torch", "torch-horovod",
                                "torch-deepspeed")
    assert choices.ENGINES == {"mwms": "mwms", "horovod": "horovod", "jax": "jax", "torch": "ddp",
                               "torch-horovod": "horovod", "torch-deepspeed": "deepspeed"}
    assert choices.BACKEND_LAUNCHERS["mwms"] == ("srun",)
    assert choices.BACKEND_LAUNCHERS["torch"][0] == "torchrun"


@pytest.mark.parametrize(("name", "framework", "several", "crosses", "horovod"), [
    ("mwms", "tf", True, True, False),
    ("horovod", "tf", False, True, True),
    ("mirrored", "tf", True, False, False),
    ("single", "tf", False, False, False),
    ("ddp", "torch", False, True, False),
    ("horovod", "torch", False, True, True),
    ("deepspeed", "torch", False, True, False),
])
def test_a_row_holds_what_its_engine_does(name, framework, several, crosses, horovod):
    row = facts.backend(name, framework)
    assert (row.several_devices, row.crosses_processes, row.horovod) == (several, crosses,
                                                                         horovod)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: facts.backend("ddp", "tf"), "backend 'ddp' is not one of tf's: mwms, horovod, "
                                         "mirrored, single"),
    (lambda: facts.backend("mwms", "torch"), "not one of torch's: ddp, horovod, deepspeed"),
    (lambda: facts.job_backend("ddp"), "not one of tfdist job's: mwms, horovod, jax, torch, "
                                       "torch-horovod, torch-deepspeed"),
])
def test_an_unknown_backend_names_the_choices(call, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        call()


def test_the_tensorflow_handles_say_the_name_their_row_has():
    # The handle classes are importable without starting a framework; their `backend` is the
    # row's name, so a handle's `facts` is its own row.
    for name, module in MODULES.items():
        classes = [value for value in vars(importlib.import_module(module)).values()
                   if isinstance(value, type) and value.__module__ == module
                   and getattr(value, "backend", None) == name]
        assert len(classes) == 1, (module, classes)


def backend_comparisons(source: str) -> list[int]:
    """The lines of the comparisons in ``source`` that compare with a backend's name.

    A literal counts when it is a backend name (or a job's), compared with anything but a
    launcher or a framework (``"single"`` is a launcher too, ``"torch"`` the framework's
    name: those count only where the other side is about a backend).
    """
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = {value for operand in operands for value in _strings(operand)} & NAMES
        others = " ".join(ast.get_source_segment(source, o) or "" for o in operands
                          if not _strings(o))
        if "launcher" in others or "framework" in others:
            continue
        if named - {"torch"} or ("torch" in named and "backend" in others):
            lines.append(node.lineno)
    return lines


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


@pytest.mark.parametrize(("source", "counted"), [
    ('dist.backend == "horovod"', True),
    ('backend not in ("mwms", "mirrored")', True),
    ('c.backend != "torch"', True),
    ('chosen == "single"', True),
    ('framework == "torch"', False),     # the framework, not a backend
    ('err.name != "torch"', False),      # a module
    ('launcher == "single"', False),     # a launcher
    ('row.horovod and x == "gloo"', False),
    ('"horovod" in text', True),
])
def test_the_counter_tells_a_backend_comparison(source, counted):
    assert bool(backend_comparisons(source)) is counted


def test_backend_names_are_compared_in_the_backend_rooms_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in ROOMS and not any(room in path.parents for room in ROOMS):
            found += [f"{path.relative_to(ROOT)}:{line}"
                      for line in backend_comparisons(path.read_text())]
    assert len(found) <= MOST_OUTSIDE, (
        f"{len(found)} comparisons with a backend's name outside tfdist/backends/ and the torch "
        f"backends' modules (at most {MOST_OUTSIDE}): {found}. Read a column of "
        "tfdist.backend_facts instead, or add one")
