"""tfdist's own errors, uncaught in a script: one line, once, exit code 78, not retried
(tfdist/uncaught.py); and inputs checked before a framework trips on them. Most processes here
import tfdist, not TensorFlow: they start in a second."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from helpers import ROOT, clean_env, require

from tfdist import errors, uncaught
from tfdist.errors import EXIT_CONFIG

# Every error type tfdist raises on purpose, and what ends a script with it.
OWN_ERRORS = sorted(
    name for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name),
                                                              errors.TfdistError))
# (exit code, one line only?): the sync check's report has its own printing (tfdist.failures).
ENDS = {name: (EXIT_CONFIG, True) for name in OWN_ERRORS}
ENDS["ReplicaMismatchError"] = (1, False)


def test_every_error_type_is_in_the_table():
    assert set(ENDS) == set(OWN_ERRORS) and len(OWN_ERRORS) >= 6


LINES = {
    # message: the line
    "TFDIST_CHECKPOINT_EVERY='abc' is not a duration. Fix: ...":
        "tfdist: TFDIST_CHECKPOINT_EVERY='abc' is not a duration. Fix: ...",
    "tfdist: already prefixed": "tfdist: already prefixed",
    "tfdist launch: a launcher's own": "tfdist launch: a launcher's own",
    "  padded\n": "tfdist: padded",
    "": "tfdist: ConfigError",
}


@pytest.mark.parametrize("message", sorted(LINES))
def test_the_line(message):
    assert uncaught.line(errors.ConfigError(message)) == LINES[message]


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


@pytest.mark.parametrize("name", OWN_ERRORS)
def test_each_own_error_is_one_line_and_exit_78(name):
    run = subprocess.run(_script(f"""
        import tfdist
        from tfdist import errors
        print("before", flush=True)
        raise errors.{name}("what is wrong. Fix: how to fix it")
    """), cwd=ROOT, env=clean_env("TFDIST_TRACEBACK"), capture_output=True, text=True,
        timeout=60, check=False)
    code, one_line = ENDS[name]
    assert run.returncode == code, run.stderr
    assert run.stdout == "before\n"  # the script's own output comes out first
    if one_line:
        assert run.stderr == "tfdist: what is wrong. Fix: how to fix it\n"
    else:
        assert "Traceback" in run.stderr, run.stderr


@pytest.mark.parametrize("asked", [{"TFDIST_TRACEBACK": "1"}, {"TFDIST_VERBOSE": "1"}])
def test_the_traceback_on_request(asked):
    run = subprocess.run(_script("""
        import tfdist
        raise tfdist.ConfigError("a bad value. Fix: a good one")
    """), cwd=ROOT, env=clean_env(**asked), capture_output=True, text=True, timeout=60,
        check=False)
    assert run.returncode == EXIT_CONFIG, run.stderr
    assert "Traceback (most recent call last)" in run.stderr
    assert run.stderr.rstrip().endswith("tfdist.errors.ConfigError: a bad value. Fix: a good one")


# Issue 49's inputs whose error tfdist raises in one process too: each is one line, exit 78.
SCRIPTS = {
    # name: (the script, its environment, what the line says)
    "a duration that is none": (
        "from tfdist.settings import resolve\nresolve('checkpoint_every')",
        {"TFDIST_CHECKPOINT_EVERY": "abc"}, "TFDIST_CHECKPOINT_EVERY='abc' is no positive "
                                            "duration"),
    "Keras on torch": ("import tfdist\ntfdist.init()", {"KERAS_BACKEND": "torch"},
                       "KERAS_BACKEND=torch: no released Keras"),
    "fewer files than workers": (
        "from tfdist.sharding import shard_files\nshard_files(['one.tfrecord'], 0, 2)", {},
        "1 input file(s) for 2 workers"),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_issues_inputs_are_one_line(name):
    code, env, says = SCRIPTS[name]
    run = subprocess.run(_script("import tfdist\n" + code), cwd=ROOT, env=clean_env(**env),
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == EXIT_CONFIG, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("tfdist: ") and says in lines[-1], run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_any_other_error_keeps_its_traceback_and_exit_1():
    run = subprocess.run(_script("""
        import tfdist
        raise KeyError("not tfdist's")
    """), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1
    assert "Traceback" in run.stderr and "KeyError" in run.stderr


def test_a_caught_error_is_the_scripts_own():
    run = subprocess.run(_script("""
        import tfdist
        try:
            raise tfdist.ConfigError("caught")
        except tfdist.ConfigError:
            print("handled")
    """), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert (run.returncode, run.stdout, run.stderr) == (0, "handled\n", "")


# A script that raises ConfigError on the ranks listed in its first argument.
_RAISES = textwrap.dedent("""
    import sys, tfdist
    rank = tfdist.detect().rank
    if str(rank) in sys.argv[1].split(","):
        raise tfdist.ConfigError(f"a setting rank {rank} refuses. Fix: another")
    import time
    time.sleep(60)  # a rank that found nothing: the launcher ends it
""")


@pytest.mark.parametrize(("ranks", "lines"), [
    ("0,1", ["[0] tfdist: a setting rank 0 refuses. Fix: another"]),  # every rank: once
    ("1", ["[1] tfdist: a setting rank 1 refuses. Fix: another"]),  # the rank that found it
])
def test_under_tfdist_launch_the_line_comes_once_and_is_not_retried(tmp_path, ranks, lines):
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", "--max-restarts",
                          "2", str(script), ranks], cwd=ROOT,
                         env=clean_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True,
                         timeout=120, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == EXIT_CONFIG, output
    assert [line for line in run.stdout.splitlines() if "refuses" in line] == lines, output
    assert "Traceback" not in output and "restarting all workers" not in output, output
    assert "not restarting (--max-restarts 2): a worker exited 78" in run.stderr, output
    assert time.monotonic() - began < 60  # the sleeping rank was ended, not waited for


# --- checked before the framework trips ------------------------------------------------------

def test_a_port_of_port_base_held_by_another_process_is_one_line_before_any_worker(tmp_path):
    import socket

    script = tmp_path / "never.py"
    script.write_text("open(__file__ + '.started', 'w').close()\n")
    from tfdist.launch import busy_ports

    with socket.socket() as held:  # another process's server on the second worker's port
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        if busy_ports([port - 1]):  # the first worker's port must be free for the message below
            pytest.skip(f"port {port - 1} is in use here too")
        run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", "--port-base",
                              str(port - 1), str(script)], cwd=ROOT, env=clean_env(),
                             capture_output=True, text=True, timeout=60, check=False)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert f"port {port} of the workers' {port - 1}..{port} is in use by another process" in \
        run.stderr and len(run.stderr.splitlines()) == 1, output
    assert not (tmp_path / "never.py.started").exists()  # no worker started


@pytest.mark.multiprocess
def test_a_tensorflow_custom_loop_under_keras_on_jax_is_one_line():
    require("jax")
    run = subprocess.run(_script("""
        import tfdist
        dist = tfdist.init()
        assert not dist.strategy and getattr(dist.strategy, "extended", None) is None
        dist.strategy.experimental_distribute_dataset(None)
    """), cwd=ROOT, env=clean_env(KERAS_BACKEND="jax"), capture_output=True, text=True,
        timeout=120, check=False)
    assert run.returncode == EXIT_CONFIG, run.stderr
    assert run.stderr.splitlines()[-1] == (
        "tfdist: dist.strategy.experimental_distribute_dataset: KERAS_BACKEND=jax trains with "
        "JAX, and a TensorFlow strategy (strategy.run, experimental_distribute_dataset, a "
        "tf.GradientTape loop) does not exist there. Fix: run a TensorFlow custom loop with "
        "KERAS_BACKEND=tensorflow (or unset), or train with model.fit on JAX"), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.multiprocess
def test_fit_on_empty_arrays_warns_and_ends_on_two_workers_as_in_one_process(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import tfdist
        with tfdist.strategy_scope() as dist:
            import keras
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        rows = np.zeros((0, 4), "float32"), np.zeros((0,), "float32")
        print("history", model.fit(*rows, batch_size=8, epochs=2, verbose=0).history)
    """))
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", str(script)],
                         cwd=ROOT, env=clean_env(PYTHONUNBUFFERED="1"), capture_output=True,
                         text=True, timeout=120, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert sorted(line for line in run.stdout.splitlines() if "history" in line) == [
        "[0] history {}", "[1] history {}"], output[-3000:]
    assert "Your input ran out of data" in output  # Keras's own warning, as in one process
