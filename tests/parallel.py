"""pytest plugin: how the tests share out over pytest-xdist's processes.

``pytest -n 2 --dist loadgroup`` (``make test XDIST="-n 2 --dist loadgroup"``) runs the tests
in two processes: most are real worker processes that spend part of their time waiting (on a
collective, a timeout, a Slurm job). Each test goes to whichever process is free, except these,
which stay together as one xdist group:

- every test on the Slurm test cluster (group ``slurm``): one process runs them in turn, so two
  tests' jobs never share the cluster's three nodes (the preemption test needs its partition to
  itself, and the failure tests time how long a step takes to end);
- the tests of a module-scoped fixture of a test module (a launch or an install shared by the
  module's tests), one group per fixture and parameter: the fixture runs once, in one process,
  instead of once in each;
- the tests a module marks ``pytest.mark.xdist_group(NAME)`` itself (kept as marked): in
  test_preemption.py, the tests that compare with one uninterrupted run, which each process
  would otherwise make once.

The groups run first, the longest (``slurm``) before all: a group started last would keep one
process busy long after the other ran out of tests. Without xdist the groups mean nothing and
only that order remains.
"""

from __future__ import annotations

import re

import pytest
from helpers import forget_shared_facts

_SHARED_SCOPES = ("module", "package", "session")


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped (or wider) fixtures of a test module that ``item`` uses, each with its
    parameter: ``tests/test_x.py::run=mwms-keras3``. The plugins' and pytest's own
    (``tmp_path_factory``, ``slurm_cluster``) are left out: cheap per process, or grouped as
    ``slurm``."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    module = item.nodeid.split("::")[0]
    shared = []
    for name in getattr(item, "fixturenames", ()):
        definitions = info.name2fixturedefs.get(name) or ()
        if definitions and definitions[-1].scope in _SHARED_SCOPES and definitions[-1].baseid:
            shared.append(f"{module}::{name}" + (f"={params[name]}" if name in params else ""))
    # xdist reads the group from the node id's end, after an "@" that comes after any "]".
    return [re.sub(r"[\[\]@]", "_", key) for key in shared]


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """The xdist group of each grouped test, by node id: ``slurm`` for the tests on the Slurm
    test cluster; else tests that share a fixture of :func:`shared_fixtures`, directly or
    through others, form one group, named after its first fixture in sorted order."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    found: dict[str, list[str]] = {}
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker(
                "slurm"):
            found[item.nodeid] = ["slurm"]
        elif keys := shared_fixtures(item):
            found[item.nodeid] = keys
            for key in keys[1:]:
                parent[root(key)] = root(keys[0])
    members: dict[str, list[str]] = {}
    for keys in found.values():
        members.setdefault(root(keys[0]), []).extend(keys)
    names = {top: min(keys) for top, keys in members.items()}
    return {nodeid: names[root(keys[0])] for nodeid, keys in found.items()}


def order(group_name: str | None) -> int:
    """Where a test of this group goes in the run: ``slurm`` first, other groups next, the
    ungrouped tests last (their order kept)."""
    return 0 if group_name == "slurm" else 2 if group_name is None else 1


def pytest_configure(config: pytest.Config) -> None:
    # Registered by xdist too; here for runs without it (the suite uses --strict-markers).
    config.addinivalue_line("markers", "xdist_group(name): tests that one xdist process runs")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: before xdist reads the groups.
    found = groups(items)
    for item in items:
        marked = item.get_closest_marker("xdist_group")
        if item.nodeid in found and marked is None:
            item.add_marker(pytest.mark.xdist_group(found[item.nodeid]))
        elif marked is not None and marked.args:
            found.setdefault(item.nodeid, str(marked.args[0]))  # a group of the module's own
    items.sort(key=lambda item: order(found.get(item.nodeid)))  # stable



def pytest_sessionfinish() -> None:
    forget_shared_facts()  # what the processes shared while they collected (tests/helpers.py)
