"""Quiet by default: which lines are TensorFlow's start-up noise, when tfdist hides them, and that
hiding them loses nothing else, not even the output of a process that crashes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import clean_env

from tfdist import quiet
from tfdist.errors import ConfigError
from tfdist.keras.versions import running

ROOT = Path(__file__).resolve().parent.parent
# The user's script below runs on this Python's tf.keras: Keras 3 (weighs replicas by their
# rows under tfdist) or TensorFlow 2.15's Keras 2 (its lane of `make test`).
_KERAS3 = running()["keras"].startswith("3.")

NOISE_LINES = {
    "absl pre-init": "WARNING: All log messages before absl::InitializeLog() is called are "
                     "written to STDERR",
    "oneDNN, TF 2.21": "I0000 00:00:1795458084.587548   22181 port.cc:153] oneDNN custom "
                       "operations are on. You may see slightly different numerical results due "
                       "to floating-point round-off errors from different computation orders. To "
                       "turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "oneDNN, TF 2.15": "2024-05-01 10:00:00.123456: I tensorflow/core/util/port.cc:113] oneDNN "
                       "custom operations are on. You may see slightly different numerical "
                       "results due to floating-point round-off errors.",
    "cpu feature guard": "I0000 00:00:1795458084.636911   22181 cpu_feature_guard.cc:227] This "
                         "TensorFlow binary is optimized to use available CPU instructions in "
                         "performance-critical operations.",
    "its second line": "To enable the following instructions: AVX2 AVX512F AVX512_VNNI "
                       "AVX512_BF16 FMA, in other operations, rebuild TensorFlow with the "
                       "appropriate compiler flags.",
    "cuDNN factory": "E0000 00:00:1718000000.000000  1234 cuda_dnn.cc:8310] Unable to register "
                     "cuDNN factory: Attempting to register factory for plugin cuDNN when one has "
                     "already been registered",
    "cuBLAS factory": "2024-05-01 10:00:00.1: E external/local_xla/xla/stream_executor/cuda/"
                      "cuda_blas.cc:1515] Unable to register cuBLAS factory: Attempting to "
                      "register factory for plugin cuBLAS when one has already been registered",
    "placer": "W0000 00:00:1.2  1 computation_placer.cc:177] computation placer already "
              "registered. Please check linkage and avoid linking the same target more than once.",
    "TensorRT": "2024-05-01 10:00:00.1: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
                "TF-TRT Warning: Could not find TensorRT",
    "generator input": "W0000 00:00:1795458253.980453    8971 dataset.cc:997] Input of "
                       "GeneratorDatasetOp::Dataset will not be optimized because the dataset "
                       "does not implement the AsGraphDefInternal() method needed to apply "
                       "optimizations.",
    "iterator cancelled": "W0000 00:00:1795458262.979389   10642 local_rendezvous.cc:412] Local "
                          "rendezvous is aborting with status: CANCELLED: GetNextFromShard was "
                          "cancelled",
    "its node line": "\t [[{{node MultiDeviceIteratorGetNextFromShard}}]]",
    "end of sequence": "W0000 00:00:1.0  7 local_rendezvous.cc:412] Local rendezvous is "
                       "aborting with status: OUT_OF_RANGE: End of sequence",
    "with a carriage return": "WARNING: All log messages before absl::InitializeLog() is called "
                              "are written to STDERR\r",
}

KEPT_LINES = {
    "a TensorFlow error": "E0000 00:00:1.0  1 collective_ops.cc:1] Collective ops is aborted by: "
                          "Socket closed",
    "a failed check": "F0000 00:00:1.0  1 port.cc:153] Check failed: oneDNN init",
    "an aborting rendezvous that matters": "W0000 00:00:1.0  7 local_rendezvous.cc:412] Local "
                                           "rendezvous is aborting with status: UNAVAILABLE: "
                                           "Socket closed",
    "another node line": "\t [[{{node CollectiveReduceV2}}]]",
    "a user's oneDNN remark": "my model: oneDNN custom operations are on, fine",
    "a tfdist line": "tfdist: rank 1 (host n2) failed or stopped responding",
    "a Keras warning": "UserWarning: `shuffle=True` was passed, but will be ignored",
    "an empty line": "",
    "a missing instruction": "The TensorFlow library was compiled to use AVX instructions, but "
                             "these aren't available on your machine.",
}


@pytest.mark.parametrize("case", sorted(NOISE_LINES))
def test_start_up_noise_is_recognised(case):
    assert quiet.is_noise(NOISE_LINES[case])


# A GPU build of TensorFlow 2.22 on a node without NVIDIA devices (seen with 2.22.0rc0): noise
# there, a problem worth its line where the node has GPUs.
NOISE_WITHOUT_GPUS = {
    "no driver, TF 2.22": "I0000 00:00:1795968044.172791    9459 cudart_stub.cc:31] Could not "
                          "find cuda drivers on your machine, GPU will not be used.",
    "cuInit, TF 2.22": "E0000 00:00:1795968048.872719    9459 cuda_platform.cc:57] failed call "
                       "to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR "
                       "(303)",
}


@pytest.mark.parametrize("case", sorted(NOISE_WITHOUT_GPUS))
def test_a_gpu_builds_lines_are_noise_only_on_a_node_without_gpus(case):
    assert quiet.is_noise(NOISE_WITHOUT_GPUS[case], without_gpus=True)
    assert not quiet.is_noise(NOISE_WITHOUT_GPUS[case])
    assert quiet.Noise(without_gpus=True).drops(NOISE_WITHOUT_GPUS[case])
    assert not quiet.Noise(without_gpus=False).drops(NOISE_WITHOUT_GPUS[case])


_TRACE = ["=== Source Location Trace: === ", "external/xla/xla/stream_executor/cuda/"
          "cuda_status.cc:50", ""]
STREAMS = {
    # name: (lines in order, the lines kept, on a node without GPUs)
    "cuInit's trace goes with it": (
        [NOISE_WITHOUT_GPUS["cuInit, TF 2.22"], *_TRACE, "[]", ""], ["[]", ""]),
    "a trace after a kept error stays": (
        [KEPT_LINES["a TensorFlow error"], *_TRACE], [KEPT_LINES["a TensorFlow error"], *_TRACE]),
    "a blank line after other noise stays": (
        [NOISE_LINES["cpu feature guard"], NOISE_LINES["its second line"], ""], [""]),
    "the trace ends at its blank line": (
        [NOISE_WITHOUT_GPUS["cuInit, TF 2.22"], *_TRACE, "a.cc:1"], ["a.cc:1"]),
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_the_noise_of_a_stream(case):
    lines, kept = STREAMS[case]
    noise = quiet.Noise(without_gpus=True)
    assert [line for line in lines if not noise.drops(line)] == kept


@pytest.mark.parametrize("case", sorted(KEPT_LINES))
def test_everything_else_is_kept(case):
    assert not quiet.is_noise(KEPT_LINES[case])


WANTED = {
    # name: (environment, quiet?)
    "default": ({}, True),
    "the user's own TF_CPP_MIN_LOG_LEVEL": ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False),
    "TFDIST_VERBOSE=1": ({"TFDIST_VERBOSE": "1"}, False),
    "TFDIST_VERBOSE=yes": ({"TFDIST_VERBOSE": "yes"}, False),
    "TFDIST_VERBOSE=0 beats the level": ({"TFDIST_VERBOSE": "0", "TF_CPP_MIN_LOG_LEVEL": "0"},
                                         True),
    "empty TFDIST_VERBOSE is unset": ({"TFDIST_VERBOSE": ""}, True),
}


@pytest.mark.parametrize("case", sorted(WANTED))
def test_when_tfdist_quiets(case):
    env, expected = WANTED[case]
    assert quiet.wanted(env) is expected


QUIET_ENV = {
    # name: (environment, what quiet_env adds or keeps)
    "default": ({}, {"TF_CPP_MIN_LOG_LEVEL": "1", "TFDIST_VERBOSE": "0"}),
    "verbose: untouched": ({"TFDIST_VERBOSE": "1"}, {"TFDIST_VERBOSE": "1"}),
    "the user's level: untouched": ({"TF_CPP_MIN_LOG_LEVEL": "3"}, {"TF_CPP_MIN_LOG_LEVEL": "3"}),
    "quiet asked, the user's level kept": (
        {"TFDIST_VERBOSE": "0", "TF_CPP_MIN_LOG_LEVEL": "2"},
        {"TFDIST_VERBOSE": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}),
}


@pytest.mark.parametrize("case", sorted(QUIET_ENV))
def test_the_environment_workers_get(case):
    env, expected = QUIET_ENV[case]
    assert quiet.quiet_env({"PATH": "/bin", **env}) == {"PATH": "/bin", **expected}
    assert quiet.wanted(quiet.quiet_env(env)) is quiet.wanted(env)  # children stay as decided


def test_a_wrong_verbose_value_names_the_variable():
    with pytest.raises(ConfigError, match="TFDIST_VERBOSE"):
        quiet.wanted({"TFDIST_VERBOSE": "loud"})


# --- real processes --------------------------------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    return clean_env("TF_CPP", PYTHONUNBUFFERED="1", **extra)


_INIT = textwrap.dedent("""
    import sys, warnings
    import tfdist
    dist = tfdist.init()
    import tensorflow as tf
    print("sum", int(tf.constant(1) + 1), flush=True)
    print("a line of mine on stderr", file=sys.stderr, flush=True)
""")


@pytest.mark.multiprocess
def test_init_hides_tensorflows_start_up_lines_and_keeps_the_rest():
    quiet_run = subprocess.run([sys.executable, "-c", _INIT], env=_env(), cwd=ROOT,
                               capture_output=True, text=True, timeout=120, check=True)
    loud_run = subprocess.run([sys.executable, "-c", _INIT], env=_env(TFDIST_VERBOSE="1"),
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    for run in (quiet_run, loud_run):
        assert "sum 2" in run.stdout
        assert "a line of mine on stderr" in run.stderr
    # The control: TensorFlow does print its start-up lines here, and only tfdist hides them
    # (this node's: a GPU build's on a node without GPUs too).
    loud, still = quiet.Noise(), quiet.Noise()
    assert any(loud.drops(line) for line in loud_run.stderr.splitlines()), loud_run.stderr
    assert not [line for line in quiet_run.stderr.splitlines() if still.drops(line)], (
        quiet_run.stderr)


@pytest.mark.parametrize("end", ["os._exit(3)", "os.abort()"])
def test_output_written_just_before_a_crash_still_comes_out(end):
    code = textwrap.dedent(f"""
        import os
        from tfdist import quiet
        with quiet.filtered_stderr():
            os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are"
                        b" written to STDERR\\n")
            os.write(2, b"the reason this process is about to die\\n")
            {end}
    """)
    run = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode != 0
    assert "the reason this process is about to die" in run.stderr
    assert "absl::InitializeLog" not in run.stderr


def test_other_ranks_leave_library_warnings_and_info_to_the_chief():
    code = textwrap.dedent("""
        import logging, sys, warnings
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
        from tfdist import quiet
        quiet.quiet_other_ranks(is_chief=sys.argv[1] == "chief")
        warnings.warn_explicit("keras says", UserWarning, "trainer.py", 1,
                               module="keras.src.trainers.trainer")
        warnings.warn_explicit("mine says", UserWarning, "train.py", 1, module="__main__")
        logging.getLogger("absl").info("tfds info")
        logging.getLogger("tfdist").info("tfdist info")
        logging.getLogger("tfdist").warning("tfdist warning")
    """)
    found = {}
    for role in ("chief", "other"):
        run = subprocess.run([sys.executable, "-c", code, role], env=_env(), cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True)
        found[role] = run.stdout + run.stderr
    for line in ("keras says", "mine says", "tfds info", "tfdist info", "tfdist warning"):
        assert line in found["chief"], found["chief"]
    for line in ("mine says", "tfdist warning"):
        assert line in found["other"], found["other"]
    for line in ("keras says", "tfds info", "tfdist info"):
        assert line not in found["other"], found["other"]


_USERS_SCRIPT = textwrap.dedent("""
    import logging, sys
    if sys.argv[1] == "configured":  # the script's own logging: its handler prints tfdist's lines
        logging.basicConfig(level=logging.INFO, format="mine: %(message)s")
    import numpy as np
    import tfdist
    with tfdist.strategy_scope() as dist:
        import tensorflow as tf
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.zeros((64, 4), "float32"),
                                               np.zeros((64, 1), "float32")))
    dist.shard(data.batch(33))  # does not split over 2 replicas: a line
    model.fit(dist.shard(data.batch(16)), epochs=2, verbose=0, callbacks=dist.callbacks())
""")


@pytest.mark.multiprocess
def test_tfdists_own_lines_show_in_a_users_script_once():
    # A plain script (no absl, no logging set-up): tfdist's start-up, batch and throughput lines
    # on stderr, epochs numbered as Keras numbers them; a script that configures logging gets
    # them through its own handler, once. Two CPU replicas in one process stand in for 2 GPUs.
    found = {}
    for how in ("plain", "configured"):
        run = subprocess.run([sys.executable, "-c", _USERS_SCRIPT, how], cwd=ROOT,
                             env=_env(TFDIST_BACKEND="mirrored", TFDIST_CPU_REPLICAS="2"),
                             capture_output=True, text=True, timeout=120, check=True)
        found[how] = run.stderr.splitlines()
    prefix = {"plain": "", "configured": "mine: "}
    for how, lines in found.items():
        def one(start: str, lines: list[str] = lines, how: str = how) -> str:
            hits = [line for line in lines if line.startswith(prefix[how] + start)]
            assert len(hits) == 1, (start, lines)
            return hits[0]

        one("tfdist: backend mirrored")
        one("tfdist: global batch 16 = 8 per replica x 2 replicas")
        if _KERAS3:  # fit weighs each replica's loss by its rows (16 and 17: one process's)
            assert "fit weighs each replica's loss by its rows" in one(
                "tfdist: global batch 33 = 16 or 17 per replica x 2 replicas")
        else:  # Keras 2 weighs the replicas 1:1: a warning
            assert "If it is the batch per worker" in one(
                "tfdist: global batch 33 does not split")
        one("tfdist: epoch 1: ")
        one("tfdist: epoch 2: ")
        assert not [line for line in lines if line.startswith(prefix[how] + "tfdist: epoch 0")]


_NOISY_WORKER = textwrap.dedent("""
    import os, sys
    print("TF_CPP_MIN_LOG_LEVEL=" + os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"), flush=True)
    print("WARNING: All log messages before absl::InitializeLog() is called are written to "
          "STDERR", file=sys.stderr, flush=True)
    print("worker says hello", file=sys.stderr, flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("verbose", ["", "1"])
def test_launch_hides_the_noise_on_the_terminal_and_keeps_it_in_the_logs(tmp_path, verbose):
    script = tmp_path / "noisy.py"
    script.write_text(_NOISY_WORKER)
    env = _env(**({"TFDIST_VERBOSE": verbose} if verbose else {}))
    run = subprocess.run([sys.executable, "-m", "tfdist", "launch", "-n", "2", "--log-dir",
                          str(tmp_path / "logs"), str(script)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    for rank in (0, 1):
        assert f"[{rank}] worker says hello" in run.stdout
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert "absl::InitializeLog" in log and "worker says hello" in log
    if verbose:
        assert run.stdout.count("absl::InitializeLog") == 2
        assert "TF_CPP_MIN_LOG_LEVEL=unset" in run.stdout
    else:
        assert "absl::InitializeLog" not in run.stdout
        assert run.stdout.count("TF_CPP_MIN_LOG_LEVEL=1") == 2


def test_a_process_without_stderr_still_imports():
    code = textwrap.dedent("""
        import os, sys
        os.close(2)
        from tfdist import quiet
        with quiet.filtered_stderr():
            print("inside", flush=True)
        print("after", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == ["inside", "after"]
