"""The suite's hermeticity: tests/hermetic.py hides the machine's GPUs from every test but those
marked ``gpu``, and helpers.py skips tests whose optional packages are missing, with the reason.

The plugin is checked in pytest sessions of its own, started here with a machine's
``CUDA_VISIBLE_DEVICES`` of our choosing: ``0`` (a GPU, whatever this machine has), ``-1``
(none), unset (then this machine's ``/dev/nvidiaN`` decide), and under pytest-xdist.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import helpers
import pytest
from hermetic import MACHINE_VARIABLE, no_gpu_reason

from tfdist.devices import node_gpus

# Each test writes what it saw; the gpu test runs between two others, which see "" again.
INNER = '''
import json, os, subprocess, sys
import pytest

def _saw(name):
    child = subprocess.run([sys.executable, "-c", "import os, json; "
                            "print(json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES')))"],
                           capture_output=True, text=True, check=True)
    seen = {"here": os.environ.get("CUDA_VISIBLE_DEVICES"), "child": json.loads(child.stdout)}
    with open(os.path.join(os.environ["SEEN_DIR"], name + ".json"), "w") as out:
        json.dump(seen, out)

def test_a_before():
    _saw("before")

@pytest.mark.gpu
def test_b_gpu():
    _saw("gpu")

def test_c_after():
    _saw("after")
'''


def _session(tmp_path: Path, machine: str | None, *args: str) -> tuple[str, dict]:
    """Runs INNER in a pytest session of its own, on a machine whose CUDA_VISIBLE_DEVICES is
    ``machine`` (None: unset); returns its output and what each test saw."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    seen = tmp_path / "seen"
    seen.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", MACHINE_VARIABLE)}
    env.update(PYTHONPATH=str(Path(__file__).parent), SEEN_DIR=str(seen))
    if machine is not None:
        env["CUDA_VISIBLE_DEVICES"] = machine
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "hermetic", "-p",
                          "no:cacheprovider", "-rs", "-q", *args, "test_inner.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout, {p.stem: json.loads(p.read_text()) for p in seen.glob("*.json")}


HIDDEN = {"here": "", "child": ""}


def test_this_session_hides_the_gpus_from_this_test_and_its_processes():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ["
                            "'CUDA_VISIBLE_DEVICES'] == '')"], capture_output=True, text=True,
                           timeout=60, check=True)
    assert child.stdout.strip() == "True"


def test_a_gpu_test_sees_the_machines_gpus_and_the_others_none(tmp_path):
    out, seen = _session(tmp_path, "0")
    assert "3 passed" in out, out
    assert seen == {"before": HIDDEN, "gpu": {"here": "0", "child": "0"}, "after": HIDDEN}


def test_a_gpu_test_skips_with_the_reason_where_the_machine_has_no_gpu(tmp_path):
    out, seen = _session(tmp_path, "-1")
    assert "2 passed, 1 skipped" in out, out
    assert "needs a GPU, and this machine has none (CUDA_VISIBLE_DEVICES=-1)" in out, out
    assert seen == {"before": HIDDEN, "after": HIDDEN}


def test_unset_the_device_files_decide_and_a_gpu_test_gets_it_unset(tmp_path):
    out, seen = _session(tmp_path, None)
    if node_gpus():
        assert seen["gpu"] == {"here": None, "child": None}, out
    else:
        assert "no /dev/nvidiaN device file" in out and "gpu" not in seen, out
    assert (seen["before"], seen["after"]) == (HIDDEN, HIDDEN)


def test_xdists_workers_hide_the_gpus_and_give_them_to_a_gpu_test(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (requirements/test.txt)")
    out, seen = _session(tmp_path, "0", "-n", "2", "-p", "xdist")
    assert "3 passed" in out, out
    assert seen == {"before": HIDDEN, "gpu": {"here": "0", "child": "0"}, "after": HIDDEN}


@pytest.mark.parametrize(("visible", "node", "reason"), [
    (None, 0, "CUDA_VISIBLE_DEVICES is unset and there is no /dev/nvidiaN device file"),
    (None, 2, None),  # the framework will count them
    ("", 4, "CUDA_VISIBLE_DEVICES="),  # hidden, as Slurm or a user hides them
    ("-1", 0, "CUDA_VISIBLE_DEVICES=-1"),
    ("NoDevFiles", 0, "CUDA_VISIBLE_DEVICES=NoDevFiles"),
    (" , ", 4, "CUDA_VISIBLE_DEVICES= , "),
    ("0,1", 0, None),
    ("GPU-5d2b", 0, None),  # a UUID
])
def test_no_gpu_reason(visible, node, reason):
    found = no_gpu_reason(visible, node)
    expected = None if reason is None else f"needs a GPU, and this machine has none ({reason})"
    assert found == expected


@pytest.fixture
def fresh_answers():
    helpers._installed.cache_clear()
    yield
    helpers._installed.cache_clear()


def test_a_missing_package_is_named_with_how_to_get_it(monkeypatch, fresh_answers):
    for module in ("tensorboard", "tensorflow_datasets", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    assert helpers.missing("tensorboard") == (
        "tensorboard is not installed (pip install tensorboard: TensorFlow 2.21 no longer "
        "installs it)")
    assert helpers.missing("tensorflow_datasets", "matplotlib") == (
        "tensorflow-datasets is not installed (tfdist[datasets]); "
        "matplotlib is not installed (tfdist[plot])")
    assert helpers.tensorboard_logs() == []
    mark = helpers.needs("matplotlib").mark
    assert mark.args == (True,) and mark.kwargs["reason"].startswith("matplotlib is not")


def test_another_pythons_packages_are_asked_of_it(tmp_path, fresh_answers):
    # A Python without its site-packages (-S): none of the optional packages.
    bare = tmp_path / ".venv-bare" / "bin" / "python"
    bare.parent.mkdir(parents=True)
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    assert helpers.missing("horovod", "deepspeed", python=bare) == (
        f"horovod is not installed in {bare} (make venv-horovod); "
        f"deepspeed is not installed in {bare} (requirements/deepspeed.txt)")
    gone = tmp_path / ".venv-gone" / "bin" / "python"
    assert helpers.missing("horovod", python=gone) == (
        f"{gone} does not exist: build it with `make venv-gone`")
    assert helpers.missing(python=sys.executable) is None
