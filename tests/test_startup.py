"""Program startup: importing tfdist is cheap; initialising TensorFlow too early is explained."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT, WORKERS

TWO_WORKERS = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                          "task": {"type": "worker", "index": 0}})


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env}, check=False)


def test_import_loads_no_heavy_framework():
    run = _python("import sys, tfdist, tfdist.env, tfdist.cli, tfdist.launch; "
                  "print(sorted(m for m in ('tensorflow', 'keras', 'tf_keras', 'torch', "
                  "'horovod', 'numpy') if m in sys.modules))")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_import_loads_the_standard_library_only():
    # What keeps `import tfdist` fast (about 50 ms here) on any machine: no package outside
    # Python's standard library. A timing bound would fail on a busy machine; this cannot.
    code = ("import sys; before = set(sys.modules); import tfdist; "
            "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before "
            "if m.split('.')[0] not in sys.stdlib_module_names})))")
    assert _python(code).stdout.split() == ["tfdist"]


def test_tensorflow_op_before_init_raises_a_clear_error():
    # No peer is needed: the check runs before any connection is attempted.
    run = subprocess.run([sys.executable, str(WORKERS / "too_early_worker.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "TF_CONFIG": TWO_WORKERS,
                              "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert run.returncode == 3, run.stdout + run.stderr
    assert "InitOrderError" in run.stdout
    assert "import tfdist before the first TensorFlow op" in run.stdout
    assert "strategy_scope()" in run.stdout and "first TensorFlow work" in run.stdout
    assert "Collective ops must be configured" not in run.stdout + run.stderr


def test_single_process_gets_the_default_strategy_quietly():
    run = _python("import tfdist; d = tfdist.init(); import tensorflow as tf; "
                  "print(d.backend, d.size, d.rank, d.is_chief, "
                  "d.strategy is tf.distribute.get_strategy())", TF_CPP_MIN_LOG_LEVEL="2")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["single", "1", "0", "True", "True"]
    # Quietly: tfdist's one start-up line (shown in any script), no warning
    mine = [line for line in run.stderr.splitlines() if "tfdist" in line]
    assert len(mine) == 1 and mine[0].startswith("tfdist: backend "), run.stderr


def test_init_twice_returns_the_same_handle_and_refuses_a_switch():
    run = _python("import tfdist; a = tfdist.init(); print(a is tfdist.init(), "
                  "a is tfdist.current())\n"
                  "try:\n    tfdist.init(backend='mwms')\n"
                  "except tfdist.ConfigError as e:\n    print('refused:', e)",
                  TF_CPP_MIN_LOG_LEVEL="2")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "True True"
    assert "refused: tfdist is already initialised" in run.stdout


def test_unknown_backend_lists_the_choices():
    run = _python("import tfdist\ntry:\n    tfdist.init(backend='horovd')\n"
                  "except tfdist.ConfigError as e:\n    print(e)")
    assert ("'horovd' is not one of ('auto', 'mwms', 'horovod', 'mirrored', 'single', 'jax', "
            "'ddp', 'deepspeed')") in run.stdout
    assert "TFDIST_BACKEND" in run.stdout


def test_data_before_strategy_scope_starts_tfdist_at_the_first_op(tmp_path):
    """Public Keras examples make their data first: on 2 workers tfdist starts at that op and
    both ranks train one model; a switch of settings afterwards is refused with the fix. The
    control, the same script with the start left out, stops with InitOrderError."""
    worker = str(WORKERS / "data_first_worker.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", worker],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, env=env,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    digests = {line.split("] ", 1)[1].split(": weights ")[0]: line.rsplit(" ", 1)[1]
               for line in run.stdout.splitlines() if ": weights " in line}
    assert sorted(digests) == ["rank 0", "rank 1"] and len(set(digests.values())) == 1
    assert run.stdout.count("tfdist started at the script's first TensorFlow op") == 2
    assert "TFDIST_COLLECTIVE" in run.stdout
    control = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", worker],
                             cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
                             env={**env, "TFDIST_SKIP_PATCHES": "first-op-start"})
    assert control.returncode == 78  # InitOrderError: one line, once (tfdist.uncaught)
    assert control.stdout.count("tfdist: TensorFlow's runtime") == 1, control.stdout[-3000:]
