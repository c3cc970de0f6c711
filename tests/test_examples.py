"""examples/keras_train.py end to end, as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import (
    EXAMPLE_NEEDS,
    HOROVOD_PYTHON,
    ROOT,
    clean_env,
    final_weights,
    full_matrix_only,
    launch,
    needs,
    require,
    tensorboard_logs,
)

pytestmark = pytest.mark.multiprocess
EXAMPLE = str(ROOT / "examples" / "keras_train.py")
needs_data = needs(*EXAMPLE_NEEDS["keras_train.py"])


def _accuracy(output: str) -> float:
    found = re.findall(r"test accuracy (\d\.\d+)", output)
    assert found, output[-3000:]
    return float(found[-1])


@needs_data
def test_two_workers_train_the_digits_from_a_flagfile(tmp_path):
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text(f"--epochs=6\n--batch_size=64\n--scale_lr\n--model_dir={tmp_path}/m\n"
                        f"--data_dir={tmp_path}/data\n")
    run = launch([EXAMPLE, f"--flagfile={flagfile}"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "[0] tfdist: 2 worker(s), 2 replica(s), backend mwms, collective ring" in run.stdout
    assert "learning rate 0.002" in run.stdout  # --scale_lr doubled 1e-3
    assert "a rank silent for 30 s is named" in run.stdout  # TFDIST_HEARTBEAT_TIMEOUT's default
    assert _accuracy(run.stdout) > 0.9
    # Every rank prints a digest of its final weights: equal digests, identical weights.
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights
    # Only the chief reports, and only the chief's files exist.
    assert "[1] test loss" not in run.stdout and "[1] Epoch" not in run.stdout
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "checkpoint.keras", "final.keras", *tensorboard_logs(), "throughput.jsonl"]
    # The throughput meter: a line per epoch from the chief, and the same in its file
    meter = [line for line in run.stdout.splitlines() if "examples/s (" in line]
    assert len(meter) == 6 and all(line.startswith("[0] ") for line in meter), meter
    assert len((tmp_path / "m" / "throughput.jsonl").read_text().splitlines()) == 6
    # A quiet run: from the first epoch on, one tfdist line an epoch on any rank (the safety
    # saves and the sync check's pass say nothing of their own; make train is this run).
    epochs = "\n".join(run.stdout.splitlines()).split("[0] Epoch ")[1:]
    assert len(epochs) == 6, run.stdout[-3000:]
    for epoch in epochs:  # up to Keras's line of the epoch ("22/22 - 1s - ...")
        epoch = re.split(r"^\[0\] \d+/\d+ - ", epoch, maxsplit=1, flags=re.M)[0]
        # The slow-rank line when the other test process took a rank's cores (seen once in
        # CI's load): tfdist's verdict on this machine, not the example's noise.
        said = [line for line in epoch.splitlines() if "tfdist: " in line
                and "Likely cause: cpu." not in line]
        assert len(said) == 1 and "examples/s (" in said[0], said


@needs_data
@full_matrix_only("tf_keras's model_dir saves from the chief in the Keras-traps launch under "
                  "Horovod, Keras 2's under MWMS in the TensorFlow 2.15 lane's")
def test_tf_keras_with_a_model_dir_saves_from_the_chief_without_breaking_the_others(tmp_path):
    # The chief's checkpoint once ran a metric all-reduce the others never joined, and the
    # job died at the start of epoch 2; every rank now runs the save, only the chief's lands.
    run = launch([EXAMPLE, "--epochs=2", "--batch_size=64", f"--model_dir={tmp_path}/m",
                  f"--data_dir={tmp_path}/data"], env={"TF_USE_LEGACY_KERAS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "checkpoint.keras", "final.keras", *tensorboard_logs(), "throughput.jsonl"]


@needs_data
def test_one_plain_process_runs_the_same_script(tmp_path):
    run = subprocess.run([sys.executable, EXAMPLE, "--epochs=3", f"--data_dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tfdist: 1 worker(s), 1 replica(s), backend single" in run.stdout
    assert _accuracy(run.stdout) > 0.8


def test_bad_backend_flag_is_rejected_with_the_choices(tmp_path):
    run = subprocess.run([sys.executable, EXAMPLE, "--backend=horovd"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode != 0
    assert "value should be one of <auto|mwms|horovod|single>" in run.stderr


@pytest.mark.parametrize("example", ["keras_train.py", "custom_loop.py", "torch_train.py"])
def test_a_launch_that_cannot_train_stops_with_the_fix_not_a_traceback(example):
    if example.startswith("torch"):
        require("torch")  # it stops before the data: torch is all it imports
    # The batch shell of a 4-task Slurm job, outside srun: detection refuses before TensorFlow.
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "5", "SLURM_NTASKS": "4"}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--epochs=1"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    # tfdist's own error, uncaught by the script: one line, exit 78 (tfdist/uncaught.py).
    assert run.returncode == 78, run.stdout + run.stderr
    assert run.stderr.startswith("tfdist: ") and "srun" in run.stderr, run.stderr
    assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr


@needs(*EXAMPLE_NEEDS["custom_loop.py"])
def test_the_custom_loop_example_resumes_after_a_preemption(tmp_path):
    # As a user tries it on one machine: SIGUSR1 to the launcher after epoch 1; every rank
    # stops at one step and saves in --model_dir, exits 75, and --max-restarts starts the
    # workers again, which resume there and finish.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "tfdist", "launch", "--max-restarts", "1", "-n", "2",
               str(ROOT / "examples" / "custom_loop.py"), "--epochs=8", "--batch_size=64",
               f"--model_dir={tmp_path}/m", f"--data_dir={tmp_path}/data"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines, signalled = [], False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "[0] epoch 1/8" in line and not signalled:
                proc.send_signal(signal.SIGUSR1)  # as Slurm's --signal=USR1@... would
                signalled = True
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    output = "".join(lines)
    assert code == 0, output[-3000:]
    assert "was preempted and saved its state" in output, output[-3000:]
    assert re.search(r"resuming the loop at \{'epoch': \d, 'step': \d+\}", output), (
        output[-3000:])
    assert "[0] epoch 8/8" in output and _accuracy(output) > 0.8, output[-3000:]
    assert "could not be found in the restored object" not in output, output[-3000:]


HVD_PY = HOROVOD_PYTHON
BENCHMARK = [str(ROOT / "examples" / "synthetic_benchmark.py"), "--model", "MobileNet",
             "--image-size", "32", "--batch-size", "8", "--num-warmup-batches", "1",
             "--num-batches-per-iter", "2", "--num-iters", "2", "--no-cuda"]


@pytest.mark.parametrize("backend", [pytest.param("mwms", marks=full_matrix_only(
    "the benchmark runs under Horovod, its own backend, and MWMS trains the other examples")),
    "horovod"])
def test_horovods_synthetic_benchmark_runs_with_its_own_flags(backend):
    # Horovod's tensorflow2_synthetic_benchmark.py flags, a small model (MobileNet: 30 %
    # fewer processor seconds than MobileNetV2) and images for CPUs.
    if backend == "horovod":
        require("horovod", python=HVD_PY)
        env = clean_env()
        run = subprocess.run([str(HVD_PY), "-m", "tfdist", "launch", "--backend", "horovod",
                              "-n", "2", *BENCHMARK, "--fp16-allreduce"], cwd=ROOT,
                             env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True,
                             text=True, timeout=300, check=False)
    else:
        run = launch(BENCHMARK)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    for line in ("[0] Model: MobileNet", "[0] Batch size: 8", "[0] Number of CPUs: 2",
                 "[0] Iter #1: "):
        assert line in out, out[-3000:]
    assert re.search(r"\[0\] Img/sec per CPU: \d+\.\d \+-\d+\.\d", out), out[-3000:]
    assert re.search(r"\[0\] Total img/sec on 2 CPU\(s\): \d+\.\d \+-\d+\.\d", out), out[-3000:]
    assert "[1] Iter" not in out  # rank 0 reports, as in the original
    weights = final_weights([out])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights
