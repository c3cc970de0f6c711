"""The import graph of tfdist: no cycles (imports inside functions count), light rooms stay light.

Read from the source with ``ast``, never by importing: an import inside a function runs later,
but a cycle through it still ties two rooms together, and the order they load in then depends on
who calls first. Imports under ``if TYPE_CHECKING:`` never run and are not counted. As tools
like import-linter do, a module is not taken to import its parent packages.
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


def _imports(tree: ast.AST, top: bool = True) -> Iterator[tuple[ast.AST, bool]]:
    """Import nodes (and ``importlib.import_module`` calls) with whether they run at import
    time; skips ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), top)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_import_module(node):
            yield node, top
        inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(node, inner)


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


def import_graph(root: Path, package: str) -> list[Edge]:
    """Every import of a module of ``package`` by a module of ``package``."""
    names = module_names(root, package)
    edges = []
    for module, path in names.items():
        is_package = path.name == "__init__.py"
        for node, top in _imports(ast.parse(path.read_text(), str(path))):
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


def _describe(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].source, *(f"{e.target} ({e.path}:{e.line})" for e in cycle)])


def test_no_import_cycles():
    found = cycles(import_graph(ROOT, "tfdist"))
    assert not found, "import cycles:\n" + "\n".join(_describe(c) for c in found)


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
