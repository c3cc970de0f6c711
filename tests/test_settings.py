"""The one settings table: precedence, one parser per kind, its copy in docs/settings.md, and
who reads what.

Pure: no framework, no process. The last two tests read tfdist's source (``ast``) to keep every
``TFDIST_*`` setting in :data:`tfdist.settings.SETTINGS` and every launcher variable in
:mod:`tfdist.env`.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT

from tfdist import settings
from tfdist.errors import ConfigError
from tfdist.settings import SETTINGS, resolve

PACKAGE = ROOT / "tfdist"
# Written by `tfdist launch` for its workers and read by detection: a protocol, not settings.
LAUNCH_PROTOCOL = {"TFDIST_LAUNCHER", "TFDIST_LOCAL_RANK", "TFDIST_LOCAL_WORLD_SIZE",
                   "TFDIST_END_TIME", "TFDIST_STEP_LOOP"}


# --- precedence and parsing ------------------------------------------------------------------

@pytest.mark.parametrize(("name", "argument", "environ", "expected"), [
    ("backend", None, {}, "auto"),
    ("backend", None, {"TFDIST_BACKEND": "Horovod"}, "horovod"),
    ("backend", "single", {"TFDIST_BACKEND": "horovod"}, "single"),  # the argument wins
    ("backend", None, {"TFDIST_BACKEND": "  "}, "auto"),  # blank is unset
    ("threads", None, {"TFDIST_NUM_THREADS": "4"}, 4),
    ("threads", 2, {"TFDIST_NUM_THREADS": "4"}, 2),
    ("threads", None, {}, None),
    ("sync_check", None, {"TFDIST_SYNC_CHECK": "false"}, False),
    ("sync_check", None, {"TFDIST_SYNC_CHECK": "Off"}, False),
    ("sync_check", None, {"TFDIST_SYNC_CHECK": "1"}, True),
    ("sync_check", True, {"TFDIST_SYNC_CHECK": "0"}, True),
    ("keras_fix", None, {"TFDIST_KERAS_FIX": "false"}, False),  # the same parser as above
    ("keras_fix", None, {}, True),
    ("horovod_start_timeout", None, {"TFDIST_HOROVOD_START_TIMEOUT": "2.5"}, 2.5),
    ("torch_timeout", None, {}, 600.0),
    ("port_base", None, {"TFDIST_PORT_BASE": "30000"}, 30000),
    ("host_template", None, {"TFDIST_HOST_TEMPLATE": "{host}-ib0"}, "{host}-ib0"),
    ("torch_collective", None, {"TFDIST_TORCH_COLLECTIVE": "GLOO"}, "gloo"),
])
def test_argument_then_variable_then_default(name, argument, environ, expected):
    assert resolve(name, argument, environ) == expected


@pytest.mark.parametrize(("name", "argument", "environ", "message"), [
    ("backend", "mwm", {}, r"backend 'mwm' is not one of \('auto', 'mwms', 'horovod', "
                           r"'mirrored', 'single', 'jax', 'ddp', 'deepspeed'\) \(argument "
                           r"`init\(backend=\), tfdist.torch.init\(backend=\)` or "
                           r"TFDIST_BACKEND\)"),
    ("backend", None, {"TFDIST_BACKEND": "mwm"}, r"'mwm' is not one of .*TFDIST_BACKEND"),
    ("threads", 0, {}, r"threads=0 must be a positive integer"),
    ("threads", None, {"TFDIST_NUM_THREADS": "many"}, r"TFDIST_NUM_THREADS='many' is not an int"),
    ("sync_check", None, {"TFDIST_SYNC_CHECK": "maybe"}, r"TFDIST_SYNC_CHECK='maybe' use 1 "),
    ("keras_fix", None, {"TFDIST_KERAS_FIX": "maybe"}, r"TFDIST_KERAS_FIX='maybe' use 1 "),
    ("port_base", None, {"TFDIST_PORT_BASE": "80"}, r"TFDIST_PORT_BASE='80' must be a port"),
    ("host_template", None, {"TFDIST_HOST_TEMPLATE": "ib0"}, r"must contain '\{host\}'"),
    ("torch_timeout", None, {"TFDIST_TORCH_TIMEOUT": "-1"}, r"is no positive duration: write 90s, "
                                                            r"10min, 2h or 1d \(a bare number "),
    ("horovod_controller", None, {"TFDIST_HOROVOD_CONTROLLER": "nccl"},
     r"'nccl' is not one of \('auto', 'gloo', 'mpi'\).*TFDIST_HOROVOD_CONTROLLER"),
])
def test_invalid_values_name_the_setting_and_what_is_allowed(name, argument, environ, message):
    with pytest.raises(ConfigError, match=message):
        resolve(name, argument, environ)


# Every duration setting reads one dialect, as TFDIST_CHECKPOINT_EVERY always did (a margin of
# "5min" was once "not a number of seconds").
DURATIONS = [entry for entry in SETTINGS if entry.parse is settings._duration]


def test_the_duration_settings_are_the_timeouts_intervals_and_margins():
    assert {entry.variable for entry in DURATIONS} >= {
        "TFDIST_CHECKPOINT_EVERY", "TFDIST_WALLTIME_MARGIN", "TFDIST_HEARTBEAT_TIMEOUT",
        "TFDIST_COLLECTIVE_TIMEOUT", "TFDIST_TORCH_TIMEOUT", "TFDIST_PREEMPT_CHECK_SECONDS",
        "TFDIST_HOROVOD_START_TIMEOUT"}


@pytest.mark.parametrize("entry", DURATIONS, ids=lambda entry: entry.variable)
@pytest.mark.parametrize(("text", "seconds"), [("5min", 300.0), ("90s", 90.0), ("2.5", 2.5),
                                               ("1h", 3600.0), (" 10 min ", 600.0)])
def test_every_duration_setting_reads_one_dialect(entry, text, seconds):
    assert resolve(entry.name, None, {entry.variable: text}) == seconds


def test_an_old_variable_name_still_works_and_says_the_new_one(caplog):
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert resolve("torch_collective", None, {"TFDIST_TORCH_BACKEND": "gloo"}) == "gloo"
    assert "TFDIST_TORCH_BACKEND is deprecated: set TFDIST_TORCH_COLLECTIVE" in caplog.text
    both = {"TFDIST_TORCH_BACKEND": "gloo", "TFDIST_TORCH_COLLECTIVE": "nccl"}
    assert resolve("torch_collective", None, both) == "nccl"  # the new name wins


def test_every_default_is_a_valid_value():
    for entry in SETTINGS:
        if entry.default is not None:
            assert entry.convert(entry.default, "default") == entry.default, entry.name


def test_current_says_where_each_value_came_from():
    found = {entry.variable: (value, source) for entry, value, source in
             settings.current({"TFDIST_BACKEND": "horovod", "TFDIST_TORCH_BACKEND": "nccl"})}
    assert found["TFDIST_BACKEND"] == ("horovod", "TFDIST_BACKEND")
    assert found["TFDIST_COLLECTIVE"] == ("auto", "default")
    assert found["TFDIST_TORCH_COLLECTIVE"] == ("nccl", "TFDIST_TORCH_BACKEND")


# --- docs/settings.md -----------------------------------------------------------------------

def test_the_documented_settings_table_is_the_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    match = re.search(r"<!-- settings table:.*?-->\n(.*?)\n<!-- end of settings table -->",
                      page, re.S)
    assert match, "docs/settings.md lost its settings table markers"
    assert match.group(1).strip() == settings.markdown_table(), (
        "docs/settings.md's settings table differs from tfdist/settings.py: paste the output of "
        "`tfdist settings --markdown` between the markers")


# --- who reads which variables ---------------------------------------------------------------

def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _variable_reads(tree: ast.Module, pattern: re.Pattern[str]) -> Iterator[tuple[str, int]]:
    """Names matching ``pattern`` that ``tree`` reads from an environment (an expression naming
    ``env`` or ``environ``): ``env.get(NAME)``, ``env[NAME]`` (not as an assignment target),
    ``NAME in env``. Writes (``environ[NAME] = ...``, ``setdefault``) are not reads."""
    def named(node: ast.AST, container: ast.AST) -> str | None:
        if "env" not in ast.unparse(container):
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value if pattern.fullmatch(node.value) else None
        return None

    for node in ast.walk(tree):
        found = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and node.args):
            found = named(node.args[0], node.func.value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            found = named(node.slice, node.value)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            found = named(node.left, node.comparators[0])
        if found:
            yield found, node.lineno


def test_every_tfdist_variable_is_a_setting_or_the_launch_protocol():
    known = {name for entry in SETTINGS for name in (entry.variable, *entry.aliases)}
    pattern = re.compile(r"TFDIST_[A-Z0-9_]+")
    stray = []
    for path, tree in _modules():
        for name, line in _variable_reads(tree, pattern):
            inside_env = path.parent.name == "env"
            if name in known and path.name != "settings.py":
                stray.append(f"{path.relative_to(ROOT)}:{line}: reads {name} itself; use "
                             "tfdist.settings.resolve")
            elif name in LAUNCH_PROTOCOL and not inside_env:
                stray.append(f"{path.relative_to(ROOT)}:{line}: reads {name} after detection")
            elif name not in known | LAUNCH_PROTOCOL:
                stray.append(f"{path.relative_to(ROOT)}:{line}: {name} is not in SETTINGS")
    assert not stray, "\n".join(stray)


def test_launcher_variables_are_read_by_detection_only():
    pattern = re.compile(r"(SLURM|HOROVOD|MASTER|PMIX|PMI|OMPI|TORCHELASTIC)_[A-Z0-9_]+")
    known = {entry.variable for entry in SETTINGS}  # Horovod's own settings, read there
    stray = [f"{path.relative_to(ROOT)}:{line}: reads {name}"
             for path, tree in _modules() if path.parent.name != "env"
             and path.name != "settings.py"
             for name, line in _variable_reads(tree, pattern) if name not in known]
    assert not stray, ("only tfdist/env/ reads launcher variables; carry what you need in "
                       "ClusterEnvironment:\n" + "\n".join(stray))
