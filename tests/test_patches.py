"""The one room for patches (tfdist/patches.py): apply once, find a patch under a later
wrapper, scoped patches restore, every patch in the source goes through it with a row of the
inventory, nothing is patched on import, and `tfdist env` lists what applies to a launch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import types

import pytest
from helpers import ROOT, clean_env

from tfdist import patches
from tfdist.backends import facts

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


@pytest.mark.parametrize(("backend", "keras", "several", "gpus", "expected"), [
    ("single", "3.15.1", False, False, {"keras3-input-position", "fit-input-wait",
                                        "iterator-free-thread"}),
    ("mwms", "3.15.1", True, True, {"keras3-symbolic-build", "keras3-reduce-per-replica",
                                    "keras3-steps-per-execution", "keras3-epoch-chunks",
                                    "keras3-step-logs", "keras3-input-position",
                                    "fit-input-wait", "iterator-free-thread",
                                    "input-end-check", "failure-line", "user-writers",
                                    "save-once", "arrays-one-order", "arrays-shuffle-seed",
                                    "predict-on-batch", "epoch-results",
                                    "sequence-one-order", "generator-copies",
                                    "mwms-heartbeat"}),
    ("mwms", "3.15.1", True, False, {"keras3-symbolic-build", "keras3-reduce-per-replica",
                                     "keras3-steps-per-execution", "keras3-epoch-chunks",
                                     "keras3-step-logs", "keras3-input-position",
                                     "fit-input-wait", "iterator-free-thread",
                                     "input-end-check", "host-input-iterator",
                                     "failure-line",
                                     "compile-without-xla", "user-writers", "save-once",
                                     "arrays-one-order", "arrays-shuffle-seed",
                                     "predict-on-batch", "epoch-results",
                                     "sequence-one-order", "generator-copies",
                                    "mwms-heartbeat"}),
    ("horovod", "2.15.0", True, True, {"keras2-input-position", "fit-input-wait",
                                       "iterator-free-thread",
                                       "compile-without-xla",
                                       "horovod-fit", "failure-line", "user-writers",
                                       "save-once", "arrays-shuffle-seed",
                                       "epoch-results", "sequence-one-order"}),
])
def test_what_applies_to_a_launch(backend, keras, several, gpus, expected):
    where = patches.where(_row(backend), {"keras": keras, "tensorflow": "2.21.0"}, {},
                          several_processes=several, gpus=gpus)
    assert {p.key for p in patches.planned(where)} == expected


def test_keras3_on_jax_frees_tf_data_iterators_on_tfdists_thread_too():
    where = patches.where(facts.backend("jax", facts.JAX), {"keras": "3.15.1", "jax": "0.8.0"},
                          {}, several_processes=False, gpus=False)
    assert "iterator-free-thread" in {p.key for p in patches.planned(where)}


def test_settings_decide_too():
    environ = {"TF_USE_LEGACY_KERAS": "1", "TFDIST_CPU_REPLICAS": "2",
               "TFDIST_COLLECTIVE_TIMEOUT": "30"}
    where = patches.where(_row("mwms"), {"keras": "3.15.1", "tensorflow": "2.21.0"}, environ,
                          several_processes=True, gpus=False)
    keys = {p.key for p in patches.planned(where)}
    assert {"mixed-keras", "keras2-input-position", "mwms-cpu-replicas", "timeout-line",
            "keras2-step-results"} <= keys
    assert "keras3-symbolic-build" not in keys  # tf.keras is tf_keras: Keras 3's fix is moot
    where = patches.where(_row("mwms"), {"keras": "3.15.1", "tensorflow": "2.21.0"},
                          {"TFDIST_ITERATOR_FREE": "tensorflow"}, several_processes=True,
                          gpus=False)
    assert "iterator-free-thread" not in {p.key for p in patches.planned(where)}


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


def test_importing_tfdist_and_its_callbacks_patches_nothing():
    code = ("import tensorflow as tf\nimport tfdist, tfdist.keras.callbacks, tfdist.keras.keras3\n"
            "from tfdist import patches\nprint(len(patches.installed()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=clean_env(), timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0", run.stdout


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
