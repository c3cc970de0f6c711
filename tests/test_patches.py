"""The one room for patches (tfdist/patches.py): apply once, find a patch under a later
wrapper, scoped patches restore, every patch in the source goes through it with a row of the
inventory, nothing is patched on import, and `tfdist env` lists what applies to a launch.

The inventory as tables: what a launch plans, phase by phase and in order; the order of rows
that wrap one attribute (the nesting that ships); every row's installer; TFDIST_SKIP_PATCHES and
the old per-patch switches; docs/architecture.md's copy of the table. What real runs install is
held to their plan by the real-process tests (tests/patch_plan.py).
"""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
import types

import pytest
from helpers import ROOT, clean_env

from tfdist import backend_facts as facts
from tfdist import patches, settings
from tfdist.errors import ConfigError
from tfdist.strategy import resolve_settings

PACKAGE = ROOT / "tfdist"
LIBRARIES = ("keras", "tf_keras", "tensorflow", "horovod", "torch", "deepspeed")


class Owner:
    def method(self) -> str:
        return "original"


def wrapping(tag: str):
    def wrap(original):
        def replacement(self):
            return f"{tag}({original(self)})"
        return replacement
    return wrap


def test_a_patch_is_applied_once_and_found_under_a_later_wrapper(monkeypatch):
    owner = type("Owner", (Owner,), {})
    monkeypatch.setattr(patches, "_installed", [])
    assert patches.apply("failure-line", owner, "method", wrapping("a")) is True
    assert patches.apply("failure-line", owner, "method", wrapping("a")) is False
    assert patches.apply("timeout-line", owner, "method", wrapping("b")) is True
    # failure-line lies under timeout-line's wrapper: still found, not wrapped again
    assert patches.apply("failure-line", owner, "method", wrapping("a")) is False
    assert owner().method() == "b(a(original))"
    assert [p.key for p in patches.installed()] == ["failure-line", "timeout-line"]


def test_a_value_that_takes_no_attribute_is_marked_too():
    module = types.SimpleNamespace(record=(1, 2))  # a tuple takes no attribute
    assert patches.apply("eager-record", module, "record", lambda old: (*old, 3)) is True
    assert patches.apply("eager-record", module, "record", lambda old: (*old, 3)) is False
    assert module.record == (1, 2, 3)


def test_a_replaced_attribute_is_patched_again():
    # Someone put the original back (a test's monkeypatch): the patch is not in place.
    owner = type("Owner", (Owner,), {})
    original = owner.method
    assert patches.apply("failure-line", owner, "method", wrapping("a"))
    owner.method = original
    assert patches.apply("failure-line", owner, "method", wrapping("a"))
    assert owner().method() == "a(original)"


def test_a_scoped_patch_is_gone_after_its_block():
    owner = type("Owner", (Owner,), {})
    with patches.scoped("mwms-cpu-replicas", owner, "method", wrapping("s")):
        assert owner().method() == "s(original)"
    assert owner().method() == "original"


def test_a_patch_outside_the_inventory_is_refused():
    with pytest.raises(KeyError, match="nope"):
        patches.apply("nope", Owner, "method", wrapping("x"))


def _row(name):
    return facts.backend(name, facts.TF)


def _where(backend, keras="3.15.1", environ=None, *, several=True, gpus=False,
           tensorflow="2.21.0", **process):
    """A launch's Where, built as tfdist.init and tfdist env build it (settings from environ)."""
    row = facts.backend("jax", facts.JAX) if backend == "jax" else _row(backend)
    environ = environ or {}
    return patches.where(row, {"keras": keras, "tensorflow": tensorflow}, environ,
                         resolve_settings(environ=environ), several_processes=several,
                         gpus=gpus, **process)


def _keys(where, phase=None):
    return [p.key for p in patches.planned(where, phase)]


# Each launch's START rows, in the order patches.install runs them.
KERAS3_MWMS = ["keras3-symbolic-build", "keras3-reduce-per-replica", "keras3-steps-per-execution",
               "keras3-epoch-chunks", "keras3-step-logs"]
TF_TAIL = ["fit-input-wait", "iterator-free-thread"]
WRITERS = ["user-writers", "save-once"]


@pytest.mark.parametrize(("backend", "keras", "several", "gpus", "start"), [
    ("single", "3.15.1", False, False, ["keras3-input-position", *TF_TAIL]),
    ("mirrored", "2.15.0", False, True, ["keras2-loss-objects", "keras2-told-draws",
                                          "keras2-input-position", *TF_TAIL]),
    ("mwms", "3.15.1", True, True, [
        *KERAS3_MWMS, "keras3-loss-scaling", "keras3-global-draws",
        "predict-on-batch", "epoch-results",
        "input-end-check", "arrays-one-order",
        "sequence-one-order", "generator-copies", "keras3-input-position", *TF_TAIL, *WRITERS,
        "failure-line"]),
    ("mwms", "3.15.1", True, False, [
        *KERAS3_MWMS, "keras3-loss-scaling", "keras3-global-draws", "predict-on-batch",
        "predict-empty-replica", "epoch-results", "input-end-check", "host-input-iterator",
        "arrays-one-order",
        "sequence-one-order", "generator-copies", "compile-without-xla", "keras3-input-position",
        *TF_TAIL, *WRITERS, "failure-line"]),
    ("mwms", "2.15.0", True, False, [
        "keras2-loss-objects", "keras2-told-draws", "keras2-step-results", "epoch-results",
        "input-end-check", "host-input-iterator",
        "arrays-one-order", "sequence-one-order", "generator-copies", "compile-without-xla",
        "keras2-input-position", *TF_TAIL, *WRITERS, "failure-line"]),
    # One MWMS worker (TF_CONFIG of one): what its installers did when they asked no more
    ("mwms", "3.15.1", False, False, [*KERAS3_MWMS, "keras3-input-position", *TF_TAIL,
                                      "failure-line"]),
    ("horovod", "2.15.0", True, True, [
        "keras2-told-draws", "epoch-results", "sequence-one-order", "horovod-fit",
        "compile-without-xla", "keras2-input-position", *TF_TAIL, *WRITERS, "failure-line"]),
    ("horovod", "3.15.1", False, True, ["horovod-fit", "compile-without-xla",
                                        "keras3-input-position", *TF_TAIL, "failure-line"]),
    ("jax", "3.15.1", True, False, ["sequence-one-order", "jax-input-position",
                                    "jax-rank0-values", "jax-inputs-by-rank",
                                    "jax-predict-every-row"]),
    ("jax", "3.15.1", False, False, ["jax-input-position"]),
])
def test_what_a_launch_installs_when_the_engine_starts(backend, keras, several, gpus, start):
    assert _keys(_where(backend, keras, several=several, gpus=gpus), patches.START) == start


@pytest.mark.parametrize(("backend", "several", "environ", "phases"), [
    ("mwms", True, {}, {"create": ["mwms-heartbeat"], "call": ["arrays-shuffle-seed"],
                        "lazy": []}),
    ("mwms", True, {"TFDIST_CPU_REPLICAS": "2"},
     {"create": ["mwms-cpu-replicas", "mwms-heartbeat"], "call": ["arrays-shuffle-seed"],
      "lazy": []}),
    ("mwms", False, {"TFDIST_CPU_REPLICAS": "2"},
     {"create": ["mwms-cpu-replicas"], "call": [], "lazy": []}),
    ("horovod", True, {}, {"create": [], "call": ["arrays-shuffle-seed"], "lazy": []}),
    ("horovod", False, {}, {"create": [], "call": [], "lazy": []}),
    ("jax", True, {}, {"create": [], "call": ["arrays-shuffle-seed"],
                       "lazy": ["iterator-free-thread"]}),
    ("jax", False, {}, {"create": [], "call": [], "lazy": ["iterator-free-thread"]}),
    ("single", True, {}, {"create": [], "call": [], "lazy": []}),
])
def test_the_later_phases_of_a_launch(backend, several, environ, phases):
    where = _where(backend, environ=environ, several=several)
    assert {phase: _keys(where, phase) for phase in phases} == phases


# Rows that replace one attribute, innermost first: the nesting that ships on each backend
# (a later row's wrapper around an earlier one's). Keras 3's Model.fit is TensorFlowTrainer.fit,
# which keras3-step-logs wraps, until a row sets Model.fit itself.
NESTINGS = {
    "Model.fit, MWMS, Keras 3": ["keras3-step-logs", "arrays-one-order", "user-writers"],
    "Model.fit, MWMS, tf_keras": ["keras2-step-results", "arrays-one-order", "user-writers"],
    "Model.fit, Horovod": ["horovod-fit", "user-writers"],
    "Model.compile, Horovod": ["horovod-fit", "compile-without-xla"],
    "sys.excepthook, MWMS": ["failure-line", "timeout-line"],
}


@pytest.mark.parametrize("rows", NESTINGS.values(), ids=NESTINGS.keys())
def test_rows_of_one_attribute_nest_in_the_inventorys_order(rows):
    order = [p.key for p in patches.INVENTORY]
    assert sorted(rows, key=order.index) == rows


@pytest.mark.parametrize(("backend", "keras", "environ", "rows"), [
    ("mwms", "3.15.1", {"TFDIST_COLLECTIVE_TIMEOUT": "30"},
     ["keras3-step-logs", "arrays-one-order", "user-writers", "failure-line", "timeout-line"]),
    ("mwms", "3.15.1", {"TF_USE_LEGACY_KERAS": "1"},
     ["keras2-step-results", "arrays-one-order", "user-writers"]),
    ("horovod", "3.15.1", {}, ["horovod-fit", "compile-without-xla", "user-writers"]),
])
def test_each_nesting_is_planned_together_where_it_ships(backend, keras, environ, rows):
    assert set(rows) <= set(_keys(_where(backend, keras, environ)))


def test_settings_and_the_process_decide_too():
    environ = {"TF_USE_LEGACY_KERAS": "1", "TFDIST_CPU_REPLICAS": "2",
               "TFDIST_COLLECTIVE_TIMEOUT": "30"}
    keys = set(_keys(_where("mwms", environ=environ)))
    assert {"mixed-keras", "keras2-input-position", "mwms-cpu-replicas", "timeout-line",
            "keras2-step-results"} <= keys
    assert "keras3-symbolic-build" not in keys  # tf.keras is tf_keras: Keras 3's fix is moot
    # A running process knows: Keras 3 not imported (no mixed-keras), the eager record lost
    keys = set(_keys(_where("mwms", environ=environ, imported={"tensorflow"},
                            eager_record_lost=True)))
    assert "mixed-keras" not in keys and "eager-record" in keys
    assert "eager-record" in _keys(_where("single", "2.14.0", tensorflow="2.14.1"))


def test_a_keras_outside_the_fixed_range_gets_no_fix():
    assert not set(KERAS3_MWMS) & set(_keys(_where("mwms", "4.0.0")))


def test_skip_patches_leaves_rows_out_and_refuses_an_unknown_key():
    where = _where("mwms", environ={"TFDIST_SKIP_PATCHES": " input-end-check, arrays-shuffle-seed"})
    assert "input-end-check" not in _keys(where)
    assert "arrays-shuffle-seed" not in _keys(where, patches.CALL)
    with pytest.raises(ConfigError) as refused:
        settings.resolve("skip_patches", environ={"TFDIST_SKIP_PATCHES": "input-end-chek"})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("TFDIST_SKIP_PATCHES='input-end-chek' names no patch: "
                              "input-end-chek; the patches are own-error-line, first-op-start, "
                              "eager-record, ")
    assert all(p.key in message for p in patches.INVENTORY)


@pytest.mark.parametrize(("environ", "skipped"), [
    ({"TFDIST_KERAS_FIX": "0"}, set(KERAS3_MWMS)),
    ({"TFDIST_KERAS_FIX": "1"}, set()),
    ({"TFDIST_INPUT_END_CHECK": "always"}, {"input-end-check"}),
    ({"TFDIST_INPUT_ITERATOR": "tensorflow"}, {"host-input-iterator"}),
    ({"TFDIST_ITERATOR_FREE": "tensorflow"}, {"iterator-free-thread"}),
    ({"TFDIST_ITERATOR_FREE": "thread", "TFDIST_SKIP_PATCHES": "save-once"}, {"save-once"}),
])
def test_the_old_switches_still_work_with_one_line_naming_the_new_form(
        monkeypatch, caplog, environ, skipped):
    monkeypatch.setattr(settings, "_deprecated", set())
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert settings.skipped_patches(environ) == skipped
        settings.skipped_patches(environ)  # once a process
    old = [name for name in environ if name != "TFDIST_SKIP_PATCHES"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(old)
    for name, line in zip(old, lines, strict=True):
        assert line.startswith(f"tfdist: {name}={environ[name]} is deprecated (it still works): "
                               "TFDIST_SKIP_PATCHES="), line
    assert not skipped & set(_keys(_where("mwms", environ=environ)))


def test_every_row_names_an_installer_of_its_phase():
    for patch in patches.INVENTORY:
        module, _, name = patch.installer.partition(":")
        assert patch.by == module and module.startswith("tfdist."), patch.key
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        found = [node for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.FunctionDef) and node.name == name]
        assert found, f"{patch.key}: {patch.installer} is no function"
        arguments = [a.arg for a in found[0].args.args]
        if patch.phase in (patches.START, patches.CREATE) or callable(patch.phase):
            assert len(arguments) == 2 and arguments[0] == "where", (patch.key, arguments)


def test_install_runs_the_start_rows_in_order_and_keeps_the_plan(monkeypatch):
    ran = []
    monkeypatch.setattr(patches, "_installer",
                        lambda patch: lambda where, handle: ran.append(patch.key))
    monkeypatch.setattr(patches, "_plan", [])
    assert patches.planned_here("arrays-shuffle-seed")  # no plan yet: a script's own call
    where = _where("mwms", environ={"TFDIST_SKIP_PATCHES": "arrays-shuffle-seed"})
    assert [p.key for p in patches.install(where, handle=None)] == ran == _keys(where, "start")
    assert patches.plan() == where
    assert "mwms-heartbeat" not in ran and not patches.planned_here("arrays-shuffle-seed")
    with pytest.raises(KeyError):
        patches.planned_here("nope")


def test_creating_enters_the_creation_rows_in_order(monkeypatch):
    import contextlib

    entered = []

    @contextlib.contextmanager
    def scope(key):
        entered.append(key)
        yield
        entered.append(f"/{key}")

    monkeypatch.setattr(patches, "_installer",
                        lambda patch: lambda where, settings: scope(patch.key))
    monkeypatch.setattr(patches, "_plan", [])
    with patches.creating(_where("mwms", environ={"TFDIST_CPU_REPLICAS": "2"}), {}):
        assert entered == ["mwms-cpu-replicas", "mwms-heartbeat"]
    assert entered[2:] == ["/mwms-heartbeat", "/mwms-cpu-replicas"]


def test_the_documented_inventory_is_the_inventory():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert patches.markdown_table() in page, (
        "docs/architecture.md's table of patches differs from tfdist/patches.py: paste "
        "`python -c 'from tfdist import patches; print(patches.markdown_table())'` there")


def library_names(tree: ast.AST) -> set[str]:
    """Names a module binds to a library's modules or their attributes (``trainer``,
    ``tf``, ``cls = trainer.TFEpochIterator``), in any scope."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            bound |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            bound |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] in LIBRARIES}
    changed = True
    while changed:  # names assigned from those: cls = trainer.TFEpochIterator
        changed = False
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and _attribute_root(node.value) in bound
                    and node.targets[0].id not in bound):
                bound.add(node.targets[0].id)
                changed = True
    return bound


def _attribute_root(node: ast.AST) -> str | None:
    """The name under a chain of attributes (not calls: a call's result is a new object)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call)):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node.id if isinstance(node, ast.Name) else None


def patches_outside_the_room(source: str) -> list[int]:
    """Lines that set an attribute of a library's module or class, or ``sys.excepthook``."""
    tree = ast.parse(source)
    bound = library_names(tree) | {"sys"}
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(element, ast.Attribute) and _root(element) in bound:
                    lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr" and node.args and _root(node.args[0]) in bound):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(("source", "found"), [
    ("from keras.src.backend.tensorflow import trainer\n"
     "trainer.TensorFlowTrainer._make_function = f", True),
    ("from keras.src.backend.tensorflow import trainer\ncls = trainer.TFEpochIterator\n"
     "cls.__init__, cls._get_iterator = a, b", True),
    ("import tensorflow as tf\nsetattr(tf.keras.Model, 'fit', f)", True),
    ("import sys\nsys.excepthook = hook", True),
    ("import tensorflow as tf\nx = tf.constant(1)\nself.value = x", False),
    ("import tensorflow as tf\noptions = tf.data.Options()\noptions.experimental = 1", False),
    ("from tfdist import patches\npatches.apply('k', owner, 'name', wrap)", False),
])
def test_the_detector_tells_a_patch(source, found):
    assert bool(patches_outside_the_room(source)) is found


def test_every_patch_goes_through_the_room():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "patches.py"
             for line in patches_outside_the_room(path.read_text())]
    assert not found, f"library internals changed outside tfdist/patches.py: {found}"


def test_every_key_in_the_source_is_a_row_and_every_row_is_used():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("apply", "scoped") and _root(node.func) == "patches"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                used.add(node.args[0].value)
    assert used == {p.key for p in patches.INVENTORY}


def test_importing_tfdist_and_its_callbacks_patches_only_the_error_line():
    code = ("import tensorflow as tf\nimport tfdist, tfdist.keras.callbacks, tfdist.keras.keras3\n"
            "from tfdist import patches\nprint([p.key for p in patches.installed()])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=clean_env(), timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "['own-error-line']", run.stdout  # sys.excepthook


def test_tfdist_env_lists_the_patches_of_the_launch():
    config = {"cluster": {"worker": ["localhost:1", "localhost:2"]},
              "task": {"type": "worker", "index": 1}}
    run = subprocess.run([sys.executable, "-m", "tfdist", "env", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False,
                         env={**clean_env(), "TF_CONFIG": json.dumps(config)})
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)["patches"]
    keys = {patch["key"] for patch in shown}
    assert {"input-end-check", "failure-line"} <= keys, keys
    assert all(patch["reason"] and patch["target"] for patch in shown)
    plain = subprocess.run([sys.executable, "-m", "tfdist", "env"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False,
                           env={**clean_env(), "TF_CONFIG": json.dumps(config)})
    assert f"patches: {len(shown)} change(s) to library internals here" in plain.stdout


def test_undo_puts_back_the_original_where_the_wrapper_is_outermost():
    class Owner:
        @staticmethod
        def ensure_initialized():
            return "original"

    original = Owner.ensure_initialized
    assert patches.apply("first-op-start", Owner, "ensure_initialized",
                         lambda f: lambda: "wrapped")
    assert Owner.ensure_initialized() == "wrapped"
    assert "first-op-start" in [p.key for p in patches.installed()]
    patches.undo("first-op-start")
    assert Owner.ensure_initialized is original
    assert "first-op-start" not in [p.key for p in patches.installed()]
