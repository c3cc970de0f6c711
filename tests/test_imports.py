"""The import graph of tfdist: no cycles (imports inside functions count), light rooms stay light.

Read from the source with ``ast``, never by importing: an import inside a function runs later,
but a cycle through it still ties two rooms together, and the order they load in then depends on
who calls first. Imports under ``if TYPE_CHECKING:`` never run: the light rooms' check leaves them
out, and the cycle check is made twice, at run time (without them) and at type time (with them:
a room typed by another that imports it is tied to it all the same). As tools like import-linter
do, a module is not taken to import its parent packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

HEAVY = ("tensorflow", "keras", "tf_keras", "torch", "horovod", "numpy")


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path:line``; ``top`` when at module level."""

    source: str
    target: str
    path: str
    line: int
    top: bool


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and bool(node.args)
            and isinstance(node.args[0], ast.Constant))


def _imports(tree: ast.AST, top: bool = True,
             type_checking: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Import nodes (and ``importlib.import_module`` calls) with whether they run at import
    time; skips ``if TYPE_CHECKING:`` bodies unless ``type_checking`` (then they count as not
    run at import time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            branches = [*node.body, *node.orelse] if type_checking else node.orelse
            for child in branches:
                yield from _imports(ast.Module(body=[child], type_ignores=[]),
                                    top and child in node.orelse, type_checking)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_import_module(node):
            yield node, top
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(node, inner, type_checking)


def _targets(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)
    elif isinstance(node, ast.Call):
        yield node.args[0].value  # type: ignore[attr-defined]


def import_graph(root: Path, package: str, type_checking: bool = False) -> list[Edge]:
    """Every import of a module of ``package`` by a module of ``package`` (with those under
    ``if TYPE_CHECKING:`` when ``type_checking``)."""
    names = module_names(root, package)
    edges = []
    for module, path in names.items():
        is_package = path.name == "__init__.py"
        for node, top in _imports(ast.parse(path.read_text(), str(path)),
                                  type_checking=type_checking):
            found = [t for t in _targets(node, module, is_package) if t in names]
            # `from pkg import sub, other` names each submodule (the package is imported first
            # all the same, as its parent); `from pkg import name` the package.
            targets = found[1:] if isinstance(node, ast.ImportFrom) and found[1:] else found[-1:]
            for target in targets:
                if target != module:
                    edges.append(Edge(module, target, str(path.relative_to(root)),
                                      getattr(node, "lineno", 0), top))
    return edges


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle through each strongly connected group of modules, as its edges."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
    found, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path = _cycle_from(start, graph)
        if path:
            found.append(path)
            done.update(edge.source for edge in path)
    return found


def _cycle_from(start: str, graph: dict[str, list[Edge]]) -> list[Edge] | None:
    stack: list[tuple[str, list[Edge]]] = [(start, [])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for edge in graph.get(node, []):
            if edge.target == start:
                return [*path, edge]
            if edge.target not in seen:
                seen.add(edge.target)
                stack.append((edge.target, [*path, edge]))
    return None


def strongly_connected(edges: list[Edge]) -> list[list[str]]:
    """The groups of two modules or more that import each other, through any path (Tarjan's
    strongly connected components), each sorted; a graph without cycles has none."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(graph[target])))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return sorted(groups)


def _describe(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].source, *(f"{e.target} ({e.path}:{e.line})" for e in cycle)])


@pytest.mark.parametrize("type_checking", [False, True], ids=["run time", "type time"])
def test_no_import_cycles(type_checking):
    edges = import_graph(ROOT, "tfdist", type_checking)
    groups = strongly_connected(edges)
    assert not groups, "import cycles:\n" + "\n".join(
        f"{', '.join(group)}: " + _describe(cycles([e for e in edges if e.source in group
                                                    and e.target in group])[0])
        for group in groups)


def test_the_graph_counts_imports_inside_functions_but_not_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\n")
    (package / "a.py").write_text("def f():\n    import pkg.b\n")
    (package / "b.py").write_text("from pkg import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg import a\n")
    (package / "d.py").write_text("from . import c\nfrom .c import thing\n")
    edges = import_graph(tmp_path, "pkg")
    assert {(e.source, e.target, e.top) for e in edges} == {
        ("pkg", "pkg.a", True), ("pkg.a", "pkg.b", False), ("pkg.b", "pkg.a", True),
        ("pkg.d", "pkg.c", True)}
    assert [_describe(c) for c in cycles(edges)] == [
        "pkg.a -> pkg.b (pkg/a.py:2) -> pkg.a (pkg/b.py:1)"]
    assert strongly_connected(edges) == [["pkg.a", "pkg.b"]]
    typed = import_graph(tmp_path, "pkg", type_checking=True)
    assert {(e.source, e.target, e.top) for e in typed} - {(e.source, e.target, e.top)
                                                           for e in edges} == {
        ("pkg.c", "pkg.a", False)}


@pytest.mark.parametrize(("pairs", "groups"), [
    ([("a", "b"), ("b", "c")], []),
    ([("a", "b"), ("b", "a"), ("b", "c")], [["a", "b"]]),
    ([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")],
     [["a", "b", "c"], ["d", "e"]]),
    ([("a", "b"), ("b", "c"), ("c", "b"), ("c", "a")], [["a", "b", "c"]]),
])
def test_the_strongly_connected_groups(pairs, groups):
    edges = [Edge(source, target, "", 0, True) for source, target in pairs]
    assert strongly_connected(edges) == groups


def _light_modules() -> list[str]:
    """Modules whose import loads no framework: neither their module-level imports, directly or
    through tfdist, nor their parent packages (which Python imports first)."""
    names = module_names(ROOT, "tfdist")
    direct_heavy = set()
    for module, path in names.items():
        for node, top in _imports(ast.parse(path.read_text())):
            roots = {t.split(".")[0] for t in _targets(node, module, path.name == "__init__.py")}
            if top and roots & set(HEAVY):
                direct_heavy.add(module)
    top_edges = [e for e in import_graph(ROOT, "tfdist") if e.top]
    heavy = set(direct_heavy)
    changed = True
    while changed:
        changed = False
        for edge in top_edges:
            if edge.target in heavy and edge.source not in heavy:
                heavy.add(edge.source)
                changed = True
    def parents(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    return sorted(name for name in names if name not in heavy and not name.endswith("__main__")
                  and not heavy.intersection(parents(name)))


def test_light_modules_load_no_framework():
    light = _light_modules()
    for expected in ("tfdist", "tfdist.cli", "tfdist.env", "tfdist.launch", "tfdist.jobs",
                     "tfdist.settings", "tfdist.devices", "tfdist.replicas", "tfdist.backends",
                     "tfdist.strategy", "tfdist.sharding", "tfdist.horovod.rendezvous"):
        assert expected in light, f"{expected} imports a framework at module level"
    code = (f"import sys\nfor name in {light!r}:\n    __import__(name)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"importing {light} loaded {run.stdout.strip()}"


@pytest.mark.parametrize("module", ["tfdist.backends.base", "tfdist.backends.mwms",
                                    "tfdist.backends.single", "tfdist.backends.horovod"])
def test_backends_import_their_framework_only_when_created(module):
    assert module in _light_modules()
