"""``tfdist job`` and ``tfdist.jobs``: golden scripts, precedence, errors, quoting, submission.

Golden files: every rendered script is compared with a stored one (tests/golden/jobs/ and
jobscripts/). After an intended change, regenerate them and review the diff:

    TFDIST_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_jobs.py

The quoting tests run the rendered scripts through bash with stub launchers on PATH (srun,
mpirun, horovodrun, scontrol, module, sbatch) that record their argv and environment as JSON.
"""

from __future__ import annotations

import difflib
import getpass
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tfdist import cli
from tfdist.env.slurm import port_base
from tfdist.errors import ConfigError
from tfdist.jobs import (
    BACKEND_LAUNCHERS,
    RUNTIME_LAUNCHERS,
    JobConfig,
    load_config,
    load_yaml,
    parse_job_id,
    render,
)
from tfdist.jobs.cli import job_options, join_option_values, misplaced_options
from tfdist.jobs.options import sbatch_option
from tfdist.jobs.submit import (
    check_local_paths,
    expand_pattern,
    job_workdir,
    local_paths,
    script_copy_path,
    submission_notes,
)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "jobs"
JOBSCRIPTS = ROOT / "jobscripts"
UPDATE = os.environ.get("TFDIST_UPDATE_GOLDEN") == "1"

# --------------------------------------------------------------------------------------------
# Golden files


def check_golden(path: Path, text: str) -> None:
    """Compare ``text`` with the stored file, or rewrite it with TFDIST_UPDATE_GOLDEN=1."""
    if UPDATE:
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755)
        return
    stored = path.read_text(encoding="utf-8") if path.exists() else ""
    if stored != text:
        diff = "".join(difflib.unified_diff(stored.splitlines(True), text.splitlines(True),
                                            f"{path} (stored)", "rendered now"))
        pytest.fail(f"the rendered script differs from {path.relative_to(ROOT)}. If the change "
                    "is intended, regenerate with `TFDIST_UPDATE_GOLDEN=1 .venv/bin/python -m "
                    f"pytest tests/test_jobs.py` and review the diff:\n{diff}")


_COMMON: dict[str, Any] = dict(nodes=2, gpus_per_node=4, cpus_per_task=8, partition="gpu",
                               account="proj42", time="01:00:00", script="train.py",
                               args=("--epochs=3", "--model_dir=runs/${SLURM_JOB_ID}"))
# (launcher, runtime) pairs in MATRIX must cover every allowed pair: see test_matrix_is_complete.
MATRIX: dict[str, dict[str, Any]] = {
    "srun-venv": dict(_COMMON, modules=("GCC/13.2.0", "Python/3.11.5"), venv="/sw/venvs/tf",
                      task_output="%x-%j-%t.out", env={"NCCL_DEBUG": "WARN"}),
    "srun-apptainer": dict(_COMMON, runtime="apptainer", image="/images/tf.sif",
                           binds=("/scratch:/scratch", "/data:/data:ro"), python="python3"),
    "srun-enroot": dict(_COMMON, runtime="enroot", image="/images/tf.sqsh",
                        binds=("/scratch:/scratch",), gpu_type="h100",
                        launcher_args=("--container-workdir=/scratch",)),
    # Preemptible: a walltime warning to the tasks, requeue, the batch shell's fallback.
    "srun-preemptible-array": dict(_COMMON, venv="/sw/venvs/tf", signal="USR1@120",
                                   requeue=True, mem="64G", array="0-3%2"),
    "srun-spare-nodes": dict(_COMMON, venv="/sw/venvs/tf", requeue=True, spare_nodes=1,
                             min_nodes=1, node_restarts=2),
    "horovod-srun-gpus-per-task": dict(_COMMON, backend="horovod", gpus_per_task=True,
                                       venv="/sw/venvs/hvd"),
    "mpirun-venv": dict(_COMMON, backend="horovod", launcher="mpirun", venv="/sw/venvs/hvd",
                        modules=("OpenMPI/4.1.6",), env={"OMPI_MCA_btl": "self,tcp"}),
    "mpirun-apptainer": dict(_COMMON, backend="horovod", launcher="mpirun", runtime="apptainer",
                             image="/images/hvd.sif"),
    "horovodrun-venv": dict(_COMMON, backend="horovod", launcher="horovodrun",
                            launcher_args=("--gloo",), venv="/sw/venvs/hvd"),
    # PyTorch behind Horovod (horovod.torch) and DeepSpeed: TFDIST_BACKEND names the engine.
    "torch-horovod-srun": dict(_COMMON, backend="torch-horovod", venv="/sw/venvs/hvd"),
    "torch-horovod-horovodrun": dict(_COMMON, backend="torch-horovod", launcher="horovodrun",
                                     launcher_args=("--gloo",), venv="/sw/venvs/hvd"),
    "torch-deepspeed-torchrun": dict(_COMMON, backend="torch-deepspeed", venv="/sw/venvs/ds",
                                     env={"TFDIST_DEEPSPEED_CONFIG": "/project/ds_zero2.json"}),
    "torch-deepspeed-srun": dict(_COMMON, backend="torch-deepspeed", launcher="srun",
                                 runtime="apptainer", image="/images/ds.sif"),
    "torchrun-venv": dict(_COMMON, backend="torch", venv="/sw/venvs/torch",
                          task_output="%x-%j-%t.out"),
    "torchrun-python": dict(_COMMON, backend="torch", python="/opt/py/bin/python3",
                            launcher_args=("--max-restarts=1",)),
    "torchrun-apptainer": dict(_COMMON, backend="torch", runtime="apptainer",
                               image="/images/torch.sif", binds=("/scratch",)),
    "torchrun-enroot": dict(_COMMON, backend="torch", runtime="enroot", image="/images/pt.sqsh"),
    "torch-srun-cpu": dict(_COMMON, backend="torch", launcher="srun", gpus_per_node=0,
                           tasks_per_node=2, python="/opt/py/bin/python3"),
    "cpu-minimal": dict(nodes=3, gpus_per_node=0, tasks_per_node=2, cpu_bind=None,
                        python="/work/main/.venv/bin/python", output="/tmp/jobs/%x-%j.out",
                        script="examples/keras_train.py"),
    "two-gpus-per-task": dict(_COMMON, tasks_per_node=2, sbatch_args=("--exclusive",
                                                                        "--qos=high")),
    # The training on 1, 2, 4 and 6 nodes (the default sizes), then the report.
    "scaling-gpu": dict(_COMMON, kind="scaling", nodes=6, venv="/sw/venvs/tf",
                        task_output="%x-%j-%s-%t.out"),
    "scaling-cpu-apptainer": dict(kind="scaling", nodes=3, scaling_nodes=(1, 3), gpus_per_node=0,
                                  tasks_per_node=2, runtime="apptainer", image="/images/tf.sif",
                                  binds=("/scratch:/scratch",), output="/scratch/logs/%x-%j.out",
                                  doctor=False, script="examples/keras_train.py",
                                  args=("--epochs=3",)),
    "build-venv": dict(kind="build-venv", gpus_per_node=1, gpu_type="a100", time="00:30:00",
                       modules=("Python/3.11.5",), venv="${HOME}/venvs/tf", python="python3",
                       packages=("tensorflow[and-cuda]==2.21.0", ".[examples]"),
                       system_site_packages=True, env={"PIP_NO_CACHE_DIR": "1"}),
}


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_golden_scripts(name: str) -> None:
    text = render(JobConfig(**MATRIX[name]))
    check_golden(GOLDEN / f"{name}.sbatch", text)


def test_matrix_is_complete() -> None:
    allowed = {(launcher, runtime) for launchers in BACKEND_LAUNCHERS.values()
               for launcher in launchers for runtime, ok in RUNTIME_LAUNCHERS.items()
               if launcher in ok}
    covered = {(JobConfig(**kw).effective_launcher, JobConfig(**kw).runtime)
               for kw in MATRIX.values() if kw.get("kind") != "build-venv"}
    assert allowed == covered


def test_no_stale_golden_files() -> None:
    stored = {path.stem for path in GOLDEN.glob("*.sbatch")}
    assert stored == set(MATRIX), "delete golden files that no test renders"


def _jobscript_configs() -> list[Path]:
    return sorted((JOBSCRIPTS / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", _jobscript_configs(), ids=lambda path: path.stem)
def test_jobscripts_are_rendered_from_their_configs(config: Path) -> None:
    source = config.relative_to(ROOT).as_posix()
    check_golden(JOBSCRIPTS / f"{config.stem}.sbatch", render(load_config(config), source=source))


def test_every_jobscript_has_a_config() -> None:
    scripts = {path.stem for path in JOBSCRIPTS.glob("*.sbatch")}
    assert scripts == {path.stem for path in _jobscript_configs()}
    kinds = {(c.kind, c.backend, c.effective_launcher, c.runtime)
             for c in map(load_config, _jobscript_configs())}
    assert {("train", "mwms", "srun", "venv"), ("train", "horovod", "srun", "venv"),
            ("train", "horovod", "mpirun", "venv"), ("train", "horovod", "horovodrun", "venv"),
            ("train", "torch", "torchrun", "venv"), ("train", "mwms", "srun", "apptainer"),
            ("train", "mwms", "srun", "enroot")} <= kinds
    assert "build-venv" in {kind for kind, *_ in kinds}


def test_rendered_scripts_pass_bash_n_and_shellcheck(tmp_path: Path) -> None:
    paths = []
    for name, kwargs in sorted(MATRIX.items()):
        paths.append(tmp_path / f"{name}.sbatch")
        paths[-1].write_text(render(JobConfig(**kwargs)))
    paths.append(tmp_path / "hostile.sbatch")
    paths[-1].write_text(render(_hostile_config("srun", "apptainer", tmp_path)))
    for path in paths:
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make system); bash -n passed")
    result = subprocess.run(["shellcheck", "--severity=style", *map(str, paths)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_comments_fit_100_columns() -> None:
    # Comments hold no user values: the renderer's own text stays readable in a terminal.
    for kwargs in MATRIX.values():
        for line in render(JobConfig(**kwargs)).splitlines():
            if line.startswith("#") and not line.startswith(("#SBATCH", "#!")):
                assert len(line) <= 100, line


# --------------------------------------------------------------------------------------------
# Rendering details


def test_directives_follow_the_config() -> None:
    text = render(JobConfig(**MATRIX["srun-enroot"]))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --gpus-per-node=h100:4", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj42",
                 "#SBATCH --time=01:00:00", "#SBATCH --output=%x-%j.out"):
        assert line in text.splitlines()
    assert "#SBATCH --gpus-per-task=1" in render(JobConfig(**MATRIX["horovod-srun-gpus-per-task"]))
    build = render(JobConfig(**MATRIX["build-venv"]))
    assert "#SBATCH --gpus=a100:1" in build and "#SBATCH --ntasks=1" in build


def test_empty_modules_render_no_module_lines() -> None:
    text = render(JobConfig(script="t.py", python="/usr/bin/python3", modules=[]))
    assert "module" not in text
    assert "module purge\nmodule load A/1 'B;2'" in render(JobConfig(script="t.py",
                                                                      modules=["A/1", "B;2"]))


def test_cpus_per_task_is_passed_to_srun() -> None:
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in render(
        JobConfig(script="t.py", cpus_per_task=4))
    assert "SRUN_CPUS_PER_TASK" not in render(JobConfig(script="t.py"))


def test_backend_reaches_tfdist_through_tfdist_backend() -> None:
    assert "export TFDIST_BACKEND=horovod" in render(JobConfig(script="t.py", backend="horovod"))
    assert "TFDIST_BACKEND" not in render(JobConfig(script="t.py", backend="torch"))
    for backend, engine in (("torch-horovod", "horovod"), ("torch-deepspeed", "deepspeed")):
        text = render(JobConfig(script="t.py", backend=backend))
        assert f"export TFDIST_BACKEND={engine}" in text
        assert "python -m tfdist doctor --framework torch\n" in text
    # horovodrun starts Horovod itself: the doctor's step checks the nodes over srun with DDP.
    assert "tfdist doctor --framework torch --backend ddp" in render(
        JobConfig(**MATRIX["torch-horovod-horovodrun"]))
    assert "-x TFDIST_BACKEND" in render(JobConfig(script="t.py", backend="torch-horovod",
                                                   launcher="mpirun"))


def test_nccl_settings_are_commented_options() -> None:
    text = render(JobConfig(script="t.py", gpus_per_node=2))
    assert "# export NCCL_IB_GID_INDEX=3" in text and "# export NCCL_SOCKET_IFNAME=ib0" in text
    assert "\nexport NCCL" not in text
    assert "NCCL" not in render(JobConfig(script="t.py", gpus_per_node=0))


def test_torchrun_port_matches_tfdist_port_derivation() -> None:
    expression = next(line.split("=", 1)[1] for line in
                      render(JobConfig(**MATRIX["torchrun-venv"])).splitlines()
                      if line.startswith("rdzv_port="))
    ids = [1, 398, 399, 4242, 123456789, 2**31 - 1]
    script = "".join(f"SLURM_JOB_ID={job}; echo {expression}\n" for job in ids)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    ports = [int(port) for port in result.stdout.split()]
    assert ports == [port_base({"SLURM_JOB_ID": str(job)}, 1) for job in ids]
    assert all(20000 <= port <= 32767 for port in ports)


# --------------------------------------------------------------------------------------------
# Precedence: flags > config file > defaults


def _directive(text: str, name: str) -> str | None:
    prefix = f"#SBATCH --{name}="
    return next((line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)),
                None)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["job", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("nodes: 3\ntime: 01:30:00\npartition: big\nmodules: [A/1, B/2]\n"
                    "env: {KEEP: file, OVERRIDE: file}\nscript: file.py\nargs: [--from-file]\n")
    return path


def test_defaults_apply_without_config_or_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["train.py"], capsys)
    assert code == 0
    assert (_directive(out, "nodes"), _directive(out, "job-name"), _directive(out, "output"),
            _directive(out, "ntasks-per-node"), _directive(out, "gpus-per-node")) == (
        "1", "tfdist", "%x-%j.out", "1", "1")
    assert _directive(out, "partition") is None and "module" not in out


def test_config_file_beats_defaults(config_file: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli([str(config_file)], capsys)
    assert code == 0
    assert (_directive(out, "nodes"), _directive(out, "time"), _directive(out, "partition")) == (
        "3", "01:30:00", "big")  # 01:30:00 stays text, not YAML 1.1's sexagesimal 5400
    assert "python file.py --from-file" in out


def test_flags_beat_the_config_file(config_file: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli([str(config_file), "--nodes", "2", "--module", "C/3", "--env",
                         "OVERRIDE=flag", "--env", "NEW=x", "--", "flag.py", "--nodes", "9"],
                        capsys)
    assert code == 0
    assert _directive(out, "nodes") == "2" and _directive(out, "partition") == "big"
    assert "module load C/3\n" in out  # lists given as flags replace the file's
    assert "export KEEP=file\nexport OVERRIDE=flag\nexport NEW=x" in out  # env merges by name
    # SCRIPT replaces script and args; after --, ARGS pass through even when named like options
    assert "python flag.py --nodes 9" in out


def test_flags_before_the_config_file_count_too(config_file: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["--time", "45", str(config_file)], capsys)
    assert code == 0 and _directive(out, "time") == "45" and _directive(out, "nodes") == "3"


def test_load_config_overrides_beat_the_file(config_file: Path) -> None:
    config = load_config(config_file, {"nodes": 5, "env": {"OVERRIDE": "py"}})
    assert (config.nodes, config.time, config.env) == (5, "01:30:00",
                                                         {"KEEP": "file", "OVERRIDE": "py"})
    assert load_config(None, {"script": "t.py"}) == JobConfig(script="t.py")


def test_to_mapping_round_trips() -> None:
    for kwargs in MATRIX.values():
        config = JobConfig(**kwargs)
        assert JobConfig.from_mapping(config.to_mapping()) == config


# --------------------------------------------------------------------------------------------
# Errors name what is allowed

ERRORS: list[tuple[dict[str, Any], list[str]]] = [
    ({"backend": "tensorflow"}, ["backend 'tensorflow' is not one of: mwms, horovod, jax, torch"]),
    ({"launcher": "slurm"}, ["one of: srun, mpirun, horovodrun, torchrun"]),
    ({"runtime": "docker"}, ["one of: venv, apptainer, enroot"]),
    ({"kind": "venv"}, ["one of: train, build-venv"]),
    ({"launcher": "mpirun"}, ["cannot start backend mwms", "allowed with backend mwms: srun"]),
    ({"backend": "torch", "launcher": "mpirun"}, ["allowed with backend torch: torchrun, srun"]),
    ({"backend": "horovod", "launcher": "mpirun", "runtime": "enroot", "image": "i"},
     ["allowed with runtime enroot: srun, torchrun"]),
    ({"backend": "horovod", "launcher": "horovodrun", "runtime": "apptainer", "image": "i"},
     ["allowed with runtime apptainer: srun, mpirun, torchrun"]),
    ({"gpus_per_node": 4, "tasks_per_node": 8, "gpus_per_task": True},
     ["tasks_per_node must be 4 (allowed: 4, or unset)"]),
    ({"gpus_per_node": 4, "tasks_per_node": 3}, ["allowed: 1, 2, 4"]),
    ({"gpus_per_node": 4, "tasks_per_node": 8}, ["allowed: 1, 2, 4"]),
    ({"backend": "horovod", "gpus_per_node": 4, "tasks_per_node": 1},
     ["Horovod drives one GPU per process, so 3 GPU(s) per node would stay idle",
      "set tasks_per_node to 4 (or leave it out), or use backend mwms"]),
    ({"backend": "torch", "launcher": "srun", "gpus_per_node": 4, "tasks_per_node": 2},
     ["DistributedDataParallel drives one GPU per process, so 2 GPU(s) per node"]),
    ({"gpus_per_node": 0, "gpus_per_task": True}, ["gpus_per_node", "at least 1"]),
    ({"backend": "torch", "tasks_per_node": 4}, ["allowed: tasks_per_node 1"]),
    ({"backend": "torch", "gpus_per_node": 0}, ["gpus_per_node must be at least 1"]),
    ({"backend": "torch", "gpus_per_task": True}, ["remove gpus_per_task"]),
    ({"runtime": "apptainer"}, ["runtime apptainer needs image"]),
    ({"image": "x.sif"}, ["image needs runtime apptainer or enroot"]),
    ({"binds": ["/a:/a"]}, ["need runtime apptainer or enroot"]),
    ({"runtime": "apptainer", "image": "i", "venv": "/v"}, ["set python to an interpreter"]),
    ({"runtime": "enroot", "image": "i", "binds": ["/a"]}, ["is not SRC:DST[:OPTIONS]"]),
    ({"runtime": "apptainer", "image": "i", "binds": ["/a,/b"]}, ["cannot contain them"]),
    ({"venv": "/v", "python": "/p"}, ["set one: venv", "or python"]),
    ({"nodes": 0}, ["nodes must be at least 1, got 0"]),
    ({"cpus_per_task": 0}, ["cpus_per_task must be at least 1"]),
    ({"node_restarts": 2}, ["node_restarts 2 counts the restarts", "add min_nodes"]),
    ({"spare_nodes": -1}, ["spare_nodes must be at least 0, got -1"]),
    ({"spare_nodes": 1, "backend": "horovod", "launcher": "mpirun", "venv": "/v"},
     ["spare_nodes restarts the training's srun step", "launcher mpirun", "remove spare_nodes"]),
    ({"time": "1h30"}, ["HOURS:MINUTES:SECONDS", "01:30:00", "or a duration such as 90min"]),
    ({"gpus_per_node": 0, "gpu_type": "a100"}, ["gpu_type 'a100' needs gpus_per_node"]),
    ({"job_name": "my job"}, ["contains ' '", "printable ASCII without spaces"]),
    ({"job_name": "x\n#SBATCH --account=other"}, ["contains '\\n'"]),
    ({"partition": "a#b"}, ["contains '#'"]),
    ({"output": "$HOME/out"}, ["%u (user)"]),
    ({"account": 'p"x'}, ["contains '\"'"]),
    ({"sbatch_args": ["--time=5"]}, ["use time instead"]),
    ({"sbatch_args": ["qos=high"]}, ["write options as --name=value"]),
    ({"env": {"1BAD": "x"}}, ["is not a variable name"]),
    ({"env": {"TFDIST_BACKEND": "horovod"}}, ["set backend instead"]),
    ({"env": {"A": "nul\0byte"}}, ["NUL byte"]),
    ({"modules": ["TensorFlow/2.15", ""]}, ["modules[1] is empty", "module load ''"]),
    ({"backend": "horovod", "launcher": "mpirun", "task_output": "%t.out"},
     ["use launcher srun or torchrun"]),
    ({"packages": ["x"]}, ["packages applies to kind build-venv only"]),
    ({"script": None}, ["needs the training script"]),
    ({"kind": "build-venv", "packages": ["x"]}, ["needs venv:"]),
    ({"kind": "build-venv", "venv": "/v"}, ["needs packages:"]),
    ({"kind": "build-venv", "venv": "/v", "packages": ["x"], "nodes": 2}, ["one node"]),
    ({"kind": "build-venv", "venv": "/v", "packages": ["x"], "launcher": "srun"},
     ["launcher applies to kinds train and scaling only, not to kind build-venv"]),
    ({"scaling_nodes": [1, 2]}, ["scaling_nodes applies to kind scaling only, not to kind train"]),
    ({"kind": "scaling", "nodes": 2, "scaling_nodes": [1, 4]},
     ["scaling_nodes 4 is more than the job's nodes 2", "allowed: 1 to 2"]),
    ({"kind": "scaling", "nodes": 2, "scaling_nodes": "1,x"},
     ["'x' is not a whole number", "e.g. [1, 2, 4] (flag: --scaling-nodes 1,2,4)"]),
    ({"kind": "scaling", "nodes": 4, "scaling_nodes": [2, 2]}, ["size 2 is given twice"]),
    ({"kind": "scaling", "nodes": 2, "scaling_nodes": [0]}, ["at least 1, got 0"]),
    ({"kind": "scaling", "nodes": 2, "scaling_nodes": {"a": 1}}, ["must be a list of node counts"]),
    ({"kind": "scaling"}, ["kind scaling with nodes 1 and scaling_nodes [1] measures one "
                           "size only", "e.g. --nodes 4 measures 1, 2 and 4"]),
    ({"kind": "scaling", "nodes": 4, "scaling_nodes": [2]}, ["measures one size only"]),
    ({"kind": "scaling", "nodes": 2, "backend": "torch"}, ["use backend mwms or horovod"]),
    ({"kind": "scaling", "nodes": 2, "backend": "horovod", "launcher": "mpirun"},
     ["needs launcher srun, not mpirun"]),
    ({"kind": "scaling", "nodes": 2, "task_output": "%x-%j-%t.out"}, ["add %s (the step)"]),
    ({"kind": "scaling", "nodes": 2, "requeue": True}, ["remove requeue"]),
    ({"kind": "scaling", "script": None}, ["kind scaling needs the training script"]),
]


@pytest.mark.parametrize(("overrides", "expected"), ERRORS,
                         ids=[str(i) for i in range(len(ERRORS))])
def test_impossible_configs_are_errors_naming_what_is_allowed(
        overrides: dict[str, Any], expected: list[str]) -> None:
    data = {**({} if overrides.get("kind") == "build-venv" else {"script": "t.py"}), **overrides}
    with pytest.raises(ConfigError) as info:
        JobConfig.from_mapping(data)
    for fragment in expected:
        assert fragment in str(info.value)


def test_unknown_keys_suggest_the_nearest_and_list_all(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("gpu_per_node: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "unknown key 'gpu_per_node'" in message and str(path) in message
    assert "did you mean 'gpus_per_node'?" in message
    assert "Allowed keys: kind, job_name, nodes, gpus_per_node" in message


@pytest.mark.parametrize(("yaml_text", "fragment"), [
    ("nodes: two\n", "nodes (in CFG) must be a whole number, got 'two'"),
    ("nodes: true\n", "must be a whole number"),
    ("gpus_per_task: yes\n", "must be true or false, got 'yes'"),  # YAML 1.2: 'yes' is text
    ("modules: {a: 1}\n", "must be a list of strings"),
    ("env: [A=1]\n", "must be a mapping of variable names"),
    ("env: {A: true}\n", "quote it in YAML"),
    ("- nodes: 2\n", "must be a mapping of keys to values"),
    ("nodes: [\n", "is not valid YAML"),
])
def test_yaml_types_are_checked(tmp_path: Path, yaml_text: str, fragment: str) -> None:
    path = tmp_path / "CFG"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"script": "t.py"})
    assert fragment.replace("CFG", str(path)) in str(info.value)


def test_yaml_numbers_are_accepted_as_text(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("time: 90\npartition: 7\nargs: [--epochs, 8]\nenv: {NCCL_IB_GID_INDEX: 3}\n"
                    "script: t.py\n")
    config = load_config(path)
    assert (config.time, config.partition, config.args, config.env) == (
        "90", "7", ("--epochs", "8"), {"NCCL_IB_GID_INDEX": "3"})


def test_horovod_srun_with_gloo_forced_asks_for_no_pmix() -> None:
    mpi = render(JobConfig(backend="horovod", script="t.py"))
    gloo = render(JobConfig(backend="horovod", script="t.py",
                            env={"TFDIST_HOROVOD_CONTROLLER": "gloo"}))
    assert "srun --kill-on-bad-exit=1 --cpu-bind=cores --mpi=pmix" in mpi
    assert "--mpi=pmix" not in gloo and "Gloo rendezvous started by tfdist" in gloo


def test_double_dash_lets_the_script_start_with_a_dash(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["--gpus-per-node", "0", "--", "-m", "tfdist", "env", "--json"], capsys)
    assert code == 0
    assert out.rstrip().endswith("python -m tfdist env --json"), out


# --------------------------------------------------------------------------------------------
# Options of `tfdist job` after SCRIPT are an error, not the script's arguments

JOB_OPTIONS = job_options(cli.build_parser().parse_args(["job", "t.py"]).job_parser)

MISPLACED: list[tuple[list[str], list[str]]] = [
    (["--nodes", "4", "--time", "01:00:00"], ["--nodes", "--time"]),
    (["--nodes=4", "--epochs=3"], ["--nodes"]),
    (["--epochs=3", "--lr", "0.1", "-n", "4"], []),  # the script's own options pass
    (["--no-doctor", "--gpus-per-node", "2"], ["--no-doctor", "--gpus-per-node"]),
    (["--time", "1", "--nodes", "2", "--time=3"], ["--time", "--nodes"]),  # each once
    (["--node", "4", "--nodesx", "--nodes-", "nodes"], []),  # exact names only
    (["--sbatch-arg=--qos=high"], ["--sbatch-arg"]),  # as join_option_values leaves it
    (["--help"], ["--help"]),
    ([], []),
]


@pytest.mark.parametrize(("words", "found"), MISPLACED, ids=[str(i) for i in range(len(MISPLACED))])
def test_misplaced_options_are_tfdist_job_options_among_the_script_arguments(
        words: list[str], found: list[str]) -> None:
    assert misplaced_options(words, JOB_OPTIONS) == found


def test_job_options_are_the_long_options_of_tfdist_job() -> None:
    assert {"--nodes", "--time", "--doctor", "--no-doctor", "--submit", "--sbatch-arg",
            "--help"} <= set(JOB_OPTIONS)
    assert not [name for name in JOB_OPTIONS if not name.startswith("--")]


AFTER_SCRIPT: list[tuple[list[str], str]] = [
    # (argv, the launch line's program, or the error's fragments joined by "|")
    (["t.py", "--nodes", "4", "--time", "01:00:00"],
     "error: --nodes, --time after SCRIPT t.py|would not apply them|Move --nodes, --time before "
     "SCRIPT|put -- before SCRIPT|tfdist job [options] -- t.py --nodes ..."),
    (["--gpus-per-node", "0", "t.py", "--epochs=3", "--no-doctor"],
     "error: --no-doctor after SCRIPT t.py|would not apply it|if it is t.py's own"),
    (["--nodes", "4", "--", "t.py", "--nodes", "4"], "python t.py --nodes 4"),
    (["t.py", "--epochs=3", "--lr", "0.1"], "python t.py --epochs=3 --lr 0.1"),
    (["--", "-m", "tfdist", "env", "--time"], "python -m tfdist env --time"),
    (["t.py", "--", "--nodes"], "error: --nodes after SCRIPT t.py"),  # -- comes before SCRIPT
]


@pytest.mark.parametrize(("argv", "expected"), AFTER_SCRIPT,
                         ids=[str(i) for i in range(len(AFTER_SCRIPT))])
def test_options_after_script_are_an_error_unless_double_dash_comes_first(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(argv, capsys)
    if expected.startswith("error: "):
        assert (code, out) == (2, "")
        for fragment in expected.removeprefix("error: ").split("|"):
            assert fragment in err
    else:
        assert (code, err) == (0, "")
        assert out.rstrip().endswith(expected), out


def test_options_after_script_with_a_config_file(config_file: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli([str(config_file), "t.py", "--partition", "x"], capsys)
    assert code == 2 and "--partition after SCRIPT t.py" in err
    code, out, _ = _cli([str(config_file), "--", "t.py", "--partition", "x"], capsys)
    assert code == 0 and _directive(out, "partition") == "big"
    assert "python t.py --partition x" in out


# --------------------------------------------------------------------------------------------
# --sbatch-arg and --launcher-arg take values that start with a dash

JOINED: list[tuple[list[str], list[str] | str]] = [
    (["--sbatch-arg", "--exclusive", "t.py"], ["--sbatch-arg=--exclusive", "t.py"]),
    (["--sbatch-arg", "--qos", "high", "t.py"], ["--sbatch-arg=--qos=high", "t.py"]),
    (["--sbatch-arg", "-q", "high", "t.py"], ["--sbatch-arg=--qos=high", "t.py"]),
    (["--sbatch-arg", "--qos=high", "t.py"], ["--sbatch-arg=--qos=high", "t.py"]),
    (["--sbatch-arg", "-t30"], ["--sbatch-arg=-t30"]),  # a short option with its value
    (["--sbatch-arg", "--qos high", "t.py"], ["--sbatch-arg=--qos high", "t.py"]),
    (["--sbatch-arg", "--hold", "--nodes", "2"], ["--sbatch-arg=--hold", "--nodes", "2"]),
    (["--sbatch-arg", "--exclusive", "user"], ["--sbatch-arg=--exclusive", "user"]),  # optional
    (["--sbatch-arg", "--qos"], ["--sbatch-arg=--qos"]),  # no value: the config check refuses
    (["--sbatch-arg=--qos=high", "--sbatch-arg", "x"], ["--sbatch-arg=--qos=high",
                                                        "--sbatch-arg", "x"]),
    (["--sbatch-arg", "--new-option", "--nodes", "2"], ["--sbatch-arg=--new-option", "--nodes",
                                                        "2"]),
    (["--sbatch-arg", "--new-option", "v", "t.py"],
     "cannot tell whether 'v' is the value of --new-option or SCRIPT|--sbatch-arg=--new-option=v"
     "|--sbatch-arg=--new-option for an option without one"),
    (["--launcher-arg", "--exact", "t.py"], ["--launcher-arg=--exact", "t.py"]),  # a known flag
    (["--launcher-arg", "--exact", "--", "t.py"], ["--launcher-arg=--exact", "--", "t.py"]),
    (["--launcher-arg", "--mpi=pmix", "t.py"], ["--launcher-arg=--mpi=pmix", "t.py"]),
    (["--launcher-arg", "-np", "4", "t.py"],
     "cannot tell whether '4' is the value of -np or SCRIPT|--launcher-arg=-np --launcher-arg=4"),
    (["--launcher-arg", "--nice"], ["--launcher-arg=--nice"]),
    (["--launcher-arg", "--mpi", "pmix", "t.py"],
     "--launcher-arg=--mpi=pmix for a value|--launcher-arg=--mpi for an option without one"),
    (["--nodes", "2", "--", "t.py", "--sbatch-arg", "--qos", "high"],
     ["--nodes", "2", "--", "t.py", "--sbatch-arg", "--qos", "high"]),  # after --: unchanged
    (["--sbatch-arg", "--", "t.py"], ["--sbatch-arg", "--", "t.py"]),  # argparse: no value
]


@pytest.mark.parametrize(("words", "expected"), JOINED, ids=[str(i) for i in range(len(JOINED))])
def test_join_option_values(words: list[str], expected: list[str] | str) -> None:
    if isinstance(expected, list):
        assert join_option_values(words) == expected
        return
    with pytest.raises(ConfigError) as info:
        join_option_values(words)
    for fragment in expected.split("|"):
        assert fragment in str(info.value)


@pytest.mark.parametrize(("item", "normalized"), [
    ("--qos high", "--qos=high"), ("-q high", "--qos=high"), ("-w  n[1-2]", "--nodelist=n[1-2]"),
    ("--new-option v", "--new-option=v"),  # an unknown long option with one value
    ("--qos=high", "--qos=high"), ("--exclusive", "--exclusive"), ("-t30", "-t30"),
    ("--exclusive user", "--exclusive user"),  # takes no separate value: the check refuses it
    ("--qos high low", "--qos high low"), ("--qos --x", "--qos --x"), ("-z v", "-z v"),
    ("--a=1 b", "--a=1 b"),
])
def test_sbatch_option_joins_an_option_and_its_value(item: str, normalized: str) -> None:
    assert sbatch_option(item) == normalized


@pytest.mark.parametrize(("argv", "lines"), [
    (["--sbatch-arg", "--qos", "high", "t.py"], ["#SBATCH --qos=high"]),
    (["--sbatch-arg", "--qos high", "t.py"], ["#SBATCH --qos=high"]),
    (["--sbatch-arg=--qos=high", "t.py"], ["#SBATCH --qos=high"]),
    (["--sbatch-arg", "-q", "high", "--sbatch-arg", "--exclusive", "t.py"],
     ["#SBATCH --qos=high", "#SBATCH --exclusive"]),
    (["--launcher-arg", "--exact", "--launcher-arg", "--mpi=pmix", "t.py"],
     ["srun --kill-on-bad-exit=1 --cpu-bind=cores \\", "    --exact --mpi=pmix \\"]),
])
def test_sbatch_and_launcher_args_render_in_every_spelling(
        argv: list[str], lines: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["--no-doctor", *argv], capsys)
    assert (code, err) == (0, "")
    text = out.splitlines()
    assert all(line in text for line in lines), out


@pytest.mark.parametrize(("sbatch_args", "fragment"), [
    (["--qos"], "'--qos' needs a value, and sbatch would refuse the job; write --qos=VALUE"),
    (["-q"], "write --qos=VALUE"),
    (["-t30"], "sets what key time sets"),  # a short option with its value attached
    (["-N 2"], "sets what key nodes sets"),  # normalized to --nodes=2 first
    (["--exclusive user"], "contains ' '"),
])
def test_sbatch_args_without_a_value_or_with_an_own_key_are_refused(
        sbatch_args: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        JobConfig(script="t.py", sbatch_args=sbatch_args)


def test_missing_config_file_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the job config"):
        load_config(tmp_path / "absent.yaml")


def test_cli_errors_exit_2_with_the_message(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["--gpus-per-node", "4", "--tasks-per-node", "3", "t.py"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("tfdist: tasks_per_node 3 with gpus_per_node 4") and "allowed" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["job", "--backend", "tensorflow", "t.py"])
    assert info.value.code == 2
    assert "invalid choice: 'tensorflow' (choose from" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Hostile values: executed through bash with stub launchers, delivered byte for byte

HOSTILE = ["it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "a;touch PWNED", "x && y",
           "line1\nline2", "  spaced  out ", "*", "?[ab]", "$HOME", "${HOME:-x}", "~/x",
           "back\\slash", "", "--flag=$(id)", "tab\there", "ünïcode", "'; touch PWNED; '",
           "\"$(touch PWNED)\"", "!!", "#not a comment"]

STUB = """#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
if name == "scontrol":
    print("\\n".join(os.environ["STUB_HOSTS"].split(",")))
    sys.exit(0)
env = {{k: v for k, v in os.environ.items()
       if k.startswith(("H_", "TFDIST_", "SRUN_", "PYTHONUNBUFFERED", "ACTIVATED"))}}
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({{"prog": name, "argv": sys.argv[1:], "env": env}}) + "\\n")
"""


def _stubs(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "mpirun", "horovodrun", "scontrol", "module"):
        path = bin_dir / name
        path.write_text(STUB.format(python=sys.executable))
        path.chmod(0o755)
    return bin_dir


def _hostile_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv $(touch PWNED) 'q' ;\nx"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export ACTIVATED_VENV=yes\n")
    return venv


def _hostile_config(launcher: str, runtime: str, tmp_path: Path) -> JobConfig:
    backend = {"srun": "mwms", "mpirun": "horovod", "horovodrun": "horovod",
               "torchrun": "torch"}[launcher]
    kwargs: dict[str, Any] = dict(
        nodes=2, gpus_per_node=2, cpus_per_task=3, backend=backend, launcher=launcher,
        runtime=runtime, modules=["mod $(touch PWNED)", "a;b", "it's"],
        env={f"H_{i}": value for i, value in enumerate(HOSTILE)},
        launcher_args=["--opt=$(touch PWNED)", "two words"], cpu_bind="cores\ntouch PWNED",
        script="/path with space/$(touch PWNED)/train's.py", args=HOSTILE)
    if launcher in ("srun", "torchrun"):
        kwargs["task_output"] = "out $(touch PWNED);'%t'.out"
    if runtime == "venv":
        kwargs["venv"] = str(_hostile_venv(tmp_path))
    else:
        kwargs.update(image="/images/tf $(touch PWNED) 'x'.sif", python="/opt/py 'x'/python",
                      binds=["/data $(touch PWNED)/a;b:/in 'q'", "/scratch:/scratch:ro"])
    return JobConfig(**kwargs)


def _run_script(text: str, tmp_path: Path, extra_env: dict[str, str] | None = None
                ) -> list[dict[str, Any]]:
    bin_dir = _stubs(tmp_path)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    log = tmp_path / "stub.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "STUB_LOG": str(log), "STUB_HOSTS": "n9,n10", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "n[9-10]", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "3",
           **(extra_env or {})}
    result = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not [p for p in tmp_path.rglob("*PWNED*") if p.name == "PWNED"], "a value ran"
    return [json.loads(line) for line in log.read_text().splitlines()]


def _launch_call(calls: list[dict[str, Any]]) -> dict[str, Any]:
    (launch,) = [call for call in calls
                 if call["prog"] not in ("module", "scontrol") and not _is_doctor(call)]
    return launch


def _is_doctor(call: dict[str, Any]) -> bool:
    return "doctor" in call["argv"] and call["argv"][call["argv"].index("doctor") - 1] == "tfdist"


def _apptainer_argv(c: JobConfig) -> list[str]:
    if c.runtime != "apptainer":
        return []
    return ["apptainer", "exec", "--nv", *(part for bind in c.binds for part in ("-B", bind)),
            c.image or ""]


def _expected_doctor_argv(config: JobConfig) -> list[str]:
    c, launcher = config, config.effective_launcher
    container = _apptainer_argv(c)
    bind = [f"--cpu-bind={c.cpu_bind}"] if c.cpu_bind else []
    own = list(c.launcher_args) if launcher == "srun" else []
    flags = {"torch": ["--framework", "torch"]}.get(
        c.backend, ["--backend", "mwms"] if c.backend == "horovod" and launcher != "srun" else [])
    return ["--kill-on-bad-exit=1", *bind, *own, *container, c.python or "python", "-m",
            "tfdist", "doctor", *flags]


def _expected_argv(config: JobConfig) -> list[str]:
    c, launcher = config, config.effective_launcher
    task_output = [f"--output={c.task_output}"] if c.task_output else []
    container = _apptainer_argv(c)
    python = [c.python or "python"]
    program = [c.script or "", *c.args]
    bind = [f"--cpu-bind={c.cpu_bind}"] if c.cpu_bind else []
    if launcher == "srun":
        return ["--kill-on-bad-exit=1", *bind, *task_output, *c.launcher_args, *container,
                *python, *program]
    if launcher == "mpirun":
        forwarded = [part for name in ("PATH", "PYTHONUNBUFFERED", "TFDIST_BACKEND", *c.env)
                     for part in ("-x", name)]
        return ["-np", "4", "--map-by", "ppr:2:node", "--bind-to", "none", *forwarded,
                *c.launcher_args, *container, *python, *program]
    if launcher == "horovodrun":
        return ["-np", "4", "-H", "n9:2,n10:2", *c.launcher_args, *python, *program]
    port = port_base({"SLURM_JOB_ID": "4242"}, 1)
    return ["--kill-on-bad-exit=1", "--ntasks-per-node=1", *bind, *task_output, *container,
            *_per_task_torchrun(c), "--nnodes=2", "--nproc-per-node=2", "--master-addr=n9",
            f"--master-port={port}", "--rdzv-id=4242", *c.launcher_args, *program]


def _per_task_torchrun(c: JobConfig) -> list[str]:
    if c.python:
        return ["bash", "-c", 'exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" '
                '"$@"', c.python]
    return ["bash", "-c", 'exec "$0" --node-rank="$SLURM_NODEID" "$@"', "torchrun"]


@pytest.mark.parametrize(("launcher", "runtime"), [
    ("srun", "venv"), ("srun", "apptainer"), ("mpirun", "venv"), ("mpirun", "apptainer"),
    ("horovodrun", "venv"), ("torchrun", "venv"), ("torchrun", "apptainer")])
def test_hostile_values_arrive_byte_for_byte(launcher: str, runtime: str,
                                             tmp_path: Path) -> None:
    config = _hostile_config(launcher, runtime, tmp_path)
    calls = _run_script(render(config), tmp_path)
    launch = _launch_call(calls)
    (doctor,) = [call for call in calls if _is_doctor(call)]
    assert doctor["prog"] == "srun" and doctor["argv"] == _expected_doctor_argv(config)
    assert calls.index(doctor) < calls.index(launch)
    assert launch["prog"] == ("srun" if launcher == "torchrun" else launcher)
    assert launch["argv"] == _expected_argv(config)
    assert {k: v for k, v in launch["env"].items() if k.startswith("H_")} == config.env
    assert launch["env"]["TFDIST_BACKEND" if config.backend != "torch" else "PYTHONUNBUFFERED"]
    if runtime == "venv":
        assert launch["env"]["ACTIVATED_VENV"] == "yes"
    module_calls = [call["argv"] for call in calls if call["prog"] == "module"]
    assert module_calls == [["purge"], ["load", *config.modules]]


def test_scaling_job_runs_one_step_per_size_then_the_report(tmp_path: Path) -> None:
    # ${workers} in an argument is the batch shell's: each size can have its own model_dir.
    config = JobConfig(kind="scaling", nodes=3, gpus_per_node=0, tasks_per_node=2,
                       python="/opt/py/bin/python3", doctor=False, script="train.py",
                       args=("--model_dir=runs/${SLURM_JOB_ID}-n${workers}",))
    calls = _run_script(render(config), tmp_path, {
        "STUB_HOSTS": "n9,n10,n11", "SLURM_JOB_NODELIST": "n[9-11]", "SLURM_NNODES": "3"})
    steps = [call for call in calls if call["prog"] == "srun"]
    folder = (tmp_path / "work").resolve() / "scaling-4242"
    # Each size on the allocation's first nodes, in Slurm's order.
    assert [(call["argv"], call["env"]["TFDIST_THROUGHPUT_FILE"]) for call in steps[:-1]] == [
        (["--kill-on-bad-exit=1", "--cpu-bind=cores", f"--nodes={n}", f"--ntasks={2 * n}",
          "--ntasks-per-node=2", f"--nodelist={','.join(['n9', 'n10', 'n11'][:n])}",
          "/opt/py/bin/python3", "train.py", f"--model_dir=runs/4242-n{2 * n}"],
         str(folder / "runs" / f"n{2 * n}-r1.jsonl"))
        for n in (1, 2, 3)]
    assert steps[-1]["argv"] == ["--kill-on-bad-exit=1", "--cpu-bind=cores", "--nodes=1",
                                 "--ntasks=1", "--ntasks-per-node=1", "/opt/py/bin/python3",
                                 "-m", "tfdist", "scaling", "--report", str(folder)]
    assert (folder / "runs").is_dir()


@pytest.mark.parametrize("with_python", [False, True])
def test_each_torchrun_takes_its_node_rank_from_its_own_task(with_python: bool,
                                                             tmp_path: Path) -> None:
    # What srun runs on the second node: the task's shell fills in SLURM_NODEID=1, so node ranks
    # follow Slurm's order (torchrun's c10d would sort the nodes by name: n10 before n9).
    python = str(tmp_path / "py 'x'" / "python") if with_python else None
    config = JobConfig(**{**MATRIX["torchrun-venv"], "python": python, "venv": None})
    argv = _expected_argv(config)
    per_task = argv[argv.index("bash"):]
    bin_dir = _stubs(tmp_path)
    runner = Path(python) if python else bin_dir / "torchrun"
    runner.parent.mkdir(parents=True, exist_ok=True)
    runner.write_text(STUB.format(python=sys.executable))
    runner.chmod(0o755)
    log = tmp_path / "stub.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(log), "SLURM_NODEID": "1"}
    subprocess.run(per_task, env=env, check=True, timeout=30)
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    head = ["-m", "torch.distributed.run"] if python else []
    assert call["argv"][:len(head) + 2] == [*head, "--node-rank=1", "--nnodes=2"]


def test_enroot_values_arrive_byte_for_byte(tmp_path: Path) -> None:
    config = JobConfig(script="t.py", runtime="enroot", image="img $(touch PWNED)'#x",
                       binds=["/a b;$(touch PWNED):/in", "/c:/d:ro"], launcher_args=["--x=1"])
    launch = _launch_call(_run_script(render(config), tmp_path))
    assert launch["argv"] == ["--kill-on-bad-exit=1", "--cpu-bind=cores",
                              "--container-image=img $(touch PWNED)'#x",
                              "--container-mounts=/a b;$(touch PWNED):/in,/c:/d:ro", "--x=1",
                              "python", "t.py"]


def test_srun_gets_the_cpus_per_task(tmp_path: Path) -> None:
    launch = _launch_call(_run_script(render(JobConfig(script="t.py", cpus_per_task=3)),
                                      tmp_path))
    assert launch["env"]["SRUN_CPUS_PER_TASK"] == "3"


def test_braced_references_expand_in_the_job_and_nothing_else(tmp_path: Path) -> None:
    args = ["--model_dir=${SCRATCH}/run-${SLURM_JOB_ID}", "$SCRATCH", "${SCRATCH:-x}",
            "${not a name}", "$${SCRATCH}"]
    config = JobConfig(script="t.py", args=args, env={"H_DIR": "${SCRATCH}/data"})
    launch = _launch_call(_run_script(render(config), tmp_path, {"SCRATCH": "/s p*"}))
    assert launch["argv"][-5:] == ["--model_dir=/s p*/run-4242", "$SCRATCH", "${SCRATCH:-x}",
                                   "${not a name}", "$/s p*"]
    assert launch["env"]["H_DIR"] == "/s p*/data"


# --------------------------------------------------------------------------------------------
# --save and --submit


def test_print_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["--nodes", "2", "t.py", "--lr=0.1"], capsys)
    assert (code, err) == (0, "")
    assert out == render(JobConfig(nodes=2, script="t.py", args=["--lr=0.1"]))


def test_save_writes_an_executable_script(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "job.sbatch"
    code, out, err = _cli(["--save", str(target), "t.py"], capsys)
    assert (code, out) == (0, "") and f"wrote {target}" in err
    assert target.read_text() == render(JobConfig(script="t.py"))
    assert target.stat().st_mode & stat.S_IXUSR


def _sbatch_stub(tmp_path: Path, body: str) -> Path:
    bin_dir = tmp_path / "sbatch-bin"
    bin_dir.mkdir()
    stub = bin_dir / "sbatch"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'stdin': sys.stdin.read()}}, "
                    f"open({str(tmp_path / 'sbatch.json')!r}, 'w'))\n{body}\n")
    stub.chmod(0o755)
    return bin_dir


@pytest.fixture
def submit_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory ``tfdist job --submit`` runs in (the job's), holding the script t.py."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.py").write_text("print('training')\n")
    monkeypatch.chdir(work)
    return work


def test_submit_prints_the_job_id(tmp_path: Path, submit_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(_sbatch_stub(tmp_path, "print('12345')")))
    code, out, err = _cli(["--submit", "t.py"], capsys)
    assert (code, out) == (0, "12345\n")  # the id alone on stdout: JOB=$(tfdist job --submit ...)
    recorded = json.loads((tmp_path / "sbatch.json").read_text())
    assert recorded == {"argv": ["--parsable"], "stdin": render(JobConfig(script="t.py"))}
    # Without --save, a copy of what was submitted stays next to the output file.
    copy = submit_dir / "tfdist-12345.sbatch"
    assert copy.read_text() == recorded["stdin"]
    assert err == submission_notes(JobConfig(script="t.py"), "12345", workdir=submit_dir,
                                   user=getpass.getuser(), copy=str(copy)) + "\n"


def test_save_and_submit_submits_the_saved_file(tmp_path: Path, submit_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(_sbatch_stub(tmp_path, "print('777;cluster-a')")))
    target = tmp_path / "job.sbatch"
    code, out, err = _cli(["--save", str(target), "--submit", "t.py"], capsys)
    assert (code, out) == (0, "777\n")
    recorded = json.loads((tmp_path / "sbatch.json").read_text())
    assert recorded == {"argv": ["--parsable", str(target)], "stdin": ""}
    assert "tfdist: submitted job 777" in err and "a copy" not in err
    assert sorted(path.name for path in submit_dir.iterdir()) == ["t.py"]  # --save is the copy


def test_failing_sbatch_is_a_clean_error(tmp_path: Path, submit_dir: Path) -> None:
    stub = _sbatch_stub(tmp_path, "sys.stderr.write('sbatch: error: Batch job submission "
                                  "failed: Invalid partition name specified\\n'); sys.exit(1)")
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "tfdist", "job", "--partition", "nope",
                             "--submit", "t.py"], capture_output=True, text=True, env=env,
                            cwd=submit_dir, timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("tfdist: sbatch failed (exit 1): sbatch: error: Batch job "
                             "submission failed: Invalid partition name specified\n")


def test_missing_sbatch_is_a_clean_error(tmp_path: Path, submit_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, err = _cli(["--submit", "t.py"], capsys)
    assert (code, out) == (2, "")
    assert "'sbatch' is not on PATH" in err and "--save" in err


@pytest.mark.parametrize(("output", "job_id"), [("12345\n", "12345"), ("678;cl\n", "678"),
                                                ("\n42\n", "42")])
def test_parse_job_id(output: str, job_id: str) -> None:
    assert parse_job_id(output) == job_id


def test_parse_job_id_refuses_other_output() -> None:
    with pytest.raises(Exception, match="printed no job id"):
        parse_job_id("Submitted batch job\n")


def test_load_yaml_of_an_empty_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_yaml(path) == {}


def test_submit_refuses_a_missing_output_directory(tmp_path: Path, submit_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(_sbatch_stub(tmp_path, "print('1')")))
    code, out, err = _cli(["--output", "logs/%x-%j.out", "--submit", "t.py"], capsys)
    assert (code, out) == (2, "")
    assert "the directory 'logs' does not exist" in err and "mkdir -p logs" in err
    assert not (tmp_path / "sbatch.json").exists()
    (submit_dir / "logs").mkdir()
    code, out, _ = _cli(["--output", "logs/%x-%j.out", "--task-output", "%u/%t.out",
                         "--submit", "t.py"], capsys)
    assert (code, out) == (0, "1\n")
    assert (submit_dir / "logs" / "tfdist-1.sbatch").is_file()  # the copy, next to the log


# What --submit checks before sbatch: the files the job reads when it starts

LOCAL_PATHS: list[tuple[dict[str, Any], list[tuple[str, str]]]] = [
    ({"script": "train.py"}, [("script", "train.py")]),
    ({"script": "/abs/train.py", "venv": "/sw/venvs/tf/"},
     [("script", "/abs/train.py"), ("venv", "/sw/venvs/tf/bin/activate")]),
    ({"script": "-m", "args": ["pkg.train"], "venv": "venvs/tf"},
     [("venv", "venvs/tf/bin/activate")]),  # -m MODULE: no file
    # Variables: checked as the job's shell will expand them (check_local_paths).
    ({"script": "${SCRATCH}/train.py", "venv": "${HOME}/venvs/tf"},
     [("script", "${SCRATCH}/train.py"), ("venv", "${HOME}/venvs/tf/bin/activate")]),
    ({"script": "$WORK/train.py"}, [("script", "$WORK/train.py")]),
    ({"script": "~/train.py"}, [("script", "~/train.py")]),  # not expanded: checked, and missing
    ({"kind": "scaling", "nodes": 2, "script": "t.py", "venv": "/v"},
     [("script", "t.py"), ("venv", "/v/bin/activate")]),
    ({"kind": "build-venv", "venv": "/v", "packages": ["x"]}, []),  # it creates the venv
    # Containers: the script is read inside the image; a local image is checked.
    ({"script": "t.py", "runtime": "apptainer", "image": "/images/tf.sif"},
     [("image", "/images/tf.sif")]),
    ({"script": "t.py", "runtime": "apptainer", "image": "tf.sif"}, [("image", "tf.sif")]),
    ({"script": "t.py", "runtime": "apptainer", "image": "docker://tensorflow/tensorflow"}, []),
    ({"script": "t.py", "runtime": "apptainer", "image": "library://lolcow"}, []),
    ({"script": "t.py", "runtime": "apptainer", "image": "${IMAGES}/tf.sif"},
     [("image", "${IMAGES}/tf.sif")]),
    ({"script": "t.py", "runtime": "enroot", "image": "/images/tf.sqsh"},
     [("image", "/images/tf.sqsh")]),
    ({"script": "t.py", "runtime": "enroot", "image": "./tf.sqsh"}, [("image", "./tf.sqsh")]),
    ({"script": "t.py", "runtime": "enroot", "image": "nvcr.io#nvidia/pytorch:24.01-py3"}, []),
    ({"script": "t.py", "runtime": "enroot", "image": "docker://ubuntu:22.04"}, []),
    ({"script": "t.py", "runtime": "enroot", "image": "ubuntu"}, []),  # pyxis: a registry image
]


@pytest.mark.parametrize(("keys", "expected"), LOCAL_PATHS,
                         ids=[str(i) for i in range(len(LOCAL_PATHS))])
def test_local_paths_are_the_files_the_job_reads_that_can_be_checked(
        keys: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    assert [(entry.key, entry.path) for entry in local_paths(JobConfig(**keys))] == expected


@pytest.mark.parametrize(("sbatch_args", "workdir"), [
    ([], "sub"), (["--chdir=/elsewhere"], "/elsewhere"), (["--chdir=run"], "sub/run"),
    (["-D run"], "sub/run"), (["-Drun", "--qos=high"], "sub/run"),
])
def test_the_job_workdir_is_where_sbatch_runs_or_its_chdir(sbatch_args: list[str],
                                                           workdir: str) -> None:
    config = JobConfig(script="t.py", sbatch_args=sbatch_args)
    assert job_workdir(config, "sub") == Path(workdir)


MISSING: list[tuple[dict[str, Any], list[str]]] = [
    ({"script": "train.py"}, ["script: 'train.py' (WORK/train.py: in the job's directory) does "
                              "not exist", "fix SCRIPT (script: in the config)"]),
    ({"script": "t.py", "venv": "/no/venv"}, ["venv: '/no/venv/bin/activate' does not exist",
                                              "fix --venv (venv: in the config)"]),
    ({"script": "t.py", "venv": "~/venvs/tf"}, ["write ${HOME}/... instead"]),
    ({"script": "t.py", "runtime": "apptainer", "image": "tf.sif"},
     ["image: 'tf.sif' (WORK/tf.sif: in the job's directory) does not exist",
      "fix --image (image: in the config)",
      "If it exists on the compute nodes only, --save the script and submit that with sbatch"]),
    ({"script": "t.py", "sbatch_args": ["--chdir=sub"]}, ["(WORK/sub/t.py: in the job's"]),
]


@pytest.mark.parametrize(("keys", "fragments"), MISSING, ids=[str(i) for i in range(len(MISSING))])
def test_a_missing_script_venv_or_image_is_an_error_naming_the_flag(
        keys: dict[str, Any], fragments: list[str], tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("")
    with pytest.raises(ConfigError) as info:
        check_local_paths(JobConfig(**keys), tmp_path)
    for fragment in fragments:
        assert fragment.replace("WORK", str(tmp_path)) in str(info.value)


def test_a_path_with_variables_is_checked_as_the_job_expands_it(tmp_path: Path) -> None:
    # The README's form --venv '${HOME}/venvs/x' was once skipped, and the job failed on its
    # node. sbatch passes the submitting shell's environment on: expanded from it, checked.
    (tmp_path / "t.py").write_text("")
    home = {"HOME": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"venv: '\$\{HOME\}/venvs/x/bin/activate = "
                       + re.escape(str(tmp_path)) + r"/venvs/x/bin/activate' does not exist"):
        check_local_paths(JobConfig(script="t.py", venv="${HOME}/venvs/x"), tmp_path, home)
    (tmp_path / "venvs" / "x" / "bin").mkdir(parents=True)
    (tmp_path / "venvs" / "x" / "bin" / "activate").write_text("")
    assert check_local_paths(JobConfig(script="$HOME/t.py", venv="${HOME}/venvs/x"), "/",
                             home) == []
    # A variable set only in the job: not checked, and said.
    said = check_local_paths(JobConfig(script="t.py", venv="${SLURM_TMPDIR}/venv"), tmp_path,
                             home)
    assert said == ["tfdist: venv '${SLURM_TMPDIR}/venv/bin/activate' names $SLURM_TMPDIR, "
                    "unset here (set in the job only?): not checked before submitting"]


def test_existing_files_pass_the_submit_checks(tmp_path: Path) -> None:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "activate").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "t.py").write_text("")
    (tmp_path / "tf.sif").write_text("")
    check_local_paths(JobConfig(script="t.py", venv=str(tmp_path / "venv"),
                                sbatch_args=["--chdir=run"]), tmp_path)
    check_local_paths(JobConfig(script="t.py", venv="../venv", sbatch_args=["-D run"]), tmp_path)
    check_local_paths(JobConfig(script="/nowhere/t.py", runtime="apptainer", image="tf.sif"),
                      tmp_path)


def test_submit_checks_before_calling_sbatch(tmp_path: Path, submit_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(_sbatch_stub(tmp_path, "print('5')")))
    code, out, err = _cli(["--venv", "venvs/tf", "--submit", "t.py"], capsys)
    assert (code, out) == (2, "") and "venv: 'venvs/tf/bin/activate'" in err
    code, out, err = _cli(["--submit", "absent.py"], capsys)
    assert (code, out) == (2, "") and "script: 'absent.py'" in err
    assert not (tmp_path / "sbatch.json").exists()
    # ${HOME} as the job's shell will expand it (sbatch passes this environment on).
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, err = _cli(["--venv", "${HOME}/venvs/tf", "--submit", "--", "-m", "pkg"], capsys)
    assert (code, out) == (2, "") and f"= {tmp_path}/venvs/tf/bin/activate' does not" in err
    (tmp_path / "venvs" / "tf" / "bin").mkdir(parents=True)
    (tmp_path / "venvs" / "tf" / "bin" / "activate").write_text("")
    code, out, _ = _cli(["--venv", "${HOME}/venvs/tf", "--submit", "--", "-m", "pkg"], capsys)
    assert (code, out) == (0, "5\n")


# After sbatch: where the logs will be, and how to follow the job

EXPANDED: list[tuple[str, dict[str, Any], tuple[str, tuple[str, ...]]]] = [
    ("%x-%j.out", {}, ("train-4242.out", ())),
    ("logs/%x-%j-%t.out", {"step": True}, ("logs/train-4242-*.out", ("%t: the task id",))),
    ("%x-%5j-%3t.out", {}, ("train-04242-*.out", ("%t: the task id",))),
    ("%12j", {}, ("0000004242", ())),  # Slurm pads to 10 digits at most
    ("%N/%n-%s.out", {}, ("*/*-*.out", ("%N: the node's name", "%n: the node's index",
                                        "%s: the step id"))),
    ("%J.out", {}, ("4242.out", ())),  # the batch shell's: the job id
    ("%J.out", {"step": True}, ("4242.*.out", ("%J: the step id after the job id",))),
    ("/scratch/%u/%x.out", {"user": "ada"}, ("/scratch/ada/train.out", ())),
    ("/scratch/%u/%x.out", {}, ("/scratch/*/train.out", ("%u: the user name",))),
    ("%A_%a.out", {"array": True}, ("4242_*.out", ("%a: the array task id",))),
    ("%x-%j.out", {"array": True}, ("train-*.out", ("%j: each array task's job id",))),
    ("%A-%b.out", {}, ("4242-*.out", ("%b: the array task id modulo 10",))),
    ("100%%-%q.out", {}, ("100%-%q.out", ())),  # %% is %; an unknown field stays
    ("a\\%j.out", {}, ("a%j.out", ())),  # a backslash turns the expansion off
]


@pytest.mark.parametrize(("pattern", "keys", "expected"), EXPANDED,
                         ids=[str(i) for i in range(len(EXPANDED))])
def test_expand_pattern_fills_in_what_is_known_at_submission(
        pattern: str, keys: dict[str, Any], expected: tuple[str, tuple[str, ...]]) -> None:
    assert expand_pattern(pattern, "4242", "train", **keys) == expected


NOTES: list[tuple[dict[str, Any], str | None, str]] = [
    ({}, "/w/tfdist-7.sbatch", """tfdist: submitted job 7 (tfdist)
  output:    /w/tfdist-7.out
  script:    /w/tfdist-7.sbatch  (a copy of what was submitted)
  follow it: squeue -j 7
             tail -F /w/tfdist-7.out  # the file appears when the job starts"""),
    ({"job_name": "train", "output": "logs/%x-%j.out", "task_output": "logs/%x-%j-%t.out"},
     None, """tfdist: submitted job 7 (train)
  output:      /w/logs/train-7.out
  task output: /w/logs/train-7-*.out  (* stands for %t: the task id)
  follow it:   squeue -j 7
               tail -F /w/logs/train-7.out  # the file appears when the job starts"""),
    ({"task_output": "${SCRATCH}/%x/%N-%t.out"}, None, """tfdist: submitted job 7 (tfdist)
  output:      /w/tfdist-7.out
  task output: ${SCRATCH}/tfdist/*-*.out  (* stands for %N: the node's name; %t: the task id, \
the job's shell expands ${NAME})
  follow it:   squeue -j 7
               tail -F /w/tfdist-7.out  # the file appears when the job starts"""),
    ({"array": "0-3", "output": "%A_%a.out", "workdir": "/s p"}, None,
     """tfdist: submitted job 7 (tfdist)
  output:    /s p/7_*.out  (* stands for %a: the array task id)
  follow it: squeue -j 7
             tail -F '/s p/7_'*.out  # the file appears when the job starts"""),
]


@pytest.mark.parametrize(("keys", "copy", "text"), NOTES, ids=[str(i) for i in range(len(NOTES))])
def test_submission_notes_say_where_the_logs_will_be(keys: dict[str, Any], copy: str | None,
                                                      text: str) -> None:
    workdir = keys.get("workdir", "/w")
    config = JobConfig(script="t.py", **{k: v for k, v in keys.items() if k != "workdir"})
    assert submission_notes(config, "7", workdir=workdir, user="ada", copy=copy) == text


@pytest.mark.parametrize(("keys", "path"), [
    ({}, "/w/tfdist-7.sbatch"),
    ({"job_name": "train", "output": "logs/%x-%j.out"}, "/w/logs/train-7.sbatch"),
    ({"output": "/scratch/%u/out/%j.out"}, "/scratch/ada/out/tfdist-7.sbatch"),
    ({"output": "%N/%j.out"}, "/w/tfdist-7.sbatch"),  # one directory per node: the job's own
    ({"output": "/dev/null"}, "/w/tfdist-7.sbatch"),
])
def test_the_script_copy_goes_next_to_the_output_file(keys: dict[str, Any], path: str) -> None:
    config = JobConfig(script="t.py", **keys)
    assert script_copy_path(config, "7", workdir="/w", user="ada") == path


def test_a_copy_that_cannot_be_written_does_not_hide_the_submitted_job(
        tmp_path: Path, submit_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(_sbatch_stub(tmp_path, "print('9')")))
    (submit_dir / "tfdist-9.sbatch").mkdir()  # in the way of the copy
    code, out, err = _cli(["--submit", "t.py"], capsys)
    assert (code, out) == (0, "9\n")
    assert "tfdist: job 9 is submitted, but its copy was not kept" in err
    assert "tfdist: submitted job 9" in err and "a copy of what" not in err


def test_a_flag_equal_to_the_default_still_beats_the_file(
        config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli([str(config_file), "--nodes", "1"], capsys)
    assert code == 0 and _directive(out, "nodes") == "1"


def test_python_callers_get_the_same_type_checks() -> None:
    config = JobConfig(script="t.py", modules=["A/1"], args=["--epochs", 8], time=30)
    assert (config.modules, config.args, config.time) == (("A/1",), ("--epochs", "8"), "30")
    with pytest.raises(ConfigError, match=r"nodes .* must be a whole number, got '2'"):
        JobConfig(script="t.py", nodes="2")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Preemption: the walltime signal, the requeue and the batch shell's fallback

@pytest.mark.parametrize(("signal", "fragment"), [
    ("B:USR1@120", "batch shell only"), ("KILL@30", "is not SIGNAL@SECONDS"),
    ("USR1@soon", "is not SIGNAL@SECONDS")])
def test_signals_tfdist_cannot_act_on_are_refused(signal: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        JobConfig(script="t.py", signal=signal)


def test_signal_and_requeue_have_their_keys_not_sbatch_args() -> None:
    with pytest.raises(ConfigError, match="sets what key signal sets"):
        JobConfig(script="t.py", sbatch_args=("--signal=USR1@60",))


REQUEUE_STUBS = {
    # srun: every task "saved its state and exited 75"; scontrol: records its arguments.
    "srun": "#!/bin/bash\nexit \"${STUB_SRUN_CODE:-75}\"\n",
    "scontrol": "#!/bin/bash\necho \"$@\" >> \"$STUB_LOG\"\n",
}


@pytest.mark.parametrize(("extra", "code", "requeued"), [
    ({}, 75, "requeue 4242"),
    ({"SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}, 75, "requeue 4240_2"),
    ({"SLURM_RESTART_COUNT": "20"}, 75, None),  # the limit (TFDIST_MAX_REQUEUES, 20)
    ({"SLURM_RESTART_COUNT": "3", "TFDIST_MAX_REQUEUES": "3"}, 75, None),
    ({"STUB_SRUN_CODE": "1"}, 1, None),  # a failure is not a preemption
    ({"STUB_SRUN_CODE": "0"}, 0, None),
], ids=["job", "array-task", "past-the-limit", "own-limit", "failed", "finished"])
def test_the_batch_shell_requeues_a_preempted_job(tmp_path: Path, extra: dict[str, str],
                                                  code: int, requeued: str | None) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in REQUEUE_STUBS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render(JobConfig(gpus_per_node=0, script="t.py", signal="USR1@90",
                                       requeue=True, doctor=False)))
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "STUB_LOG": str(log),
           **extra}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=30, check=False)
    assert run.returncode == code, run.stderr
    assert (log.read_text().strip() if log.exists() else None) == requeued


FORWARDING_SRUN = """#!/bin/bash
# srun stand-in: "tasks" that save and exit 75 when srun passes a signal on to them.
trap 'echo "srun got USR1" >> "$STUB_LOG"; exit 75' USR1
trap 'echo "srun got TERM (would kill the tasks)" >> "$STUB_LOG"; exit 143' TERM
echo started >> "$STUB_LOG"
while :; do sleep 0.05; done
"""


@pytest.mark.parametrize("at_start", [False, True], ids=["running", "as-srun-starts"])
@pytest.mark.parametrize("sent", ["USR1", "TERM"])
def test_a_signal_to_the_batch_shell_alone_reaches_the_tasks(tmp_path: Path, sent: str,
                                                           at_start: bool) -> None:
    # As `scancel --batch --signal=...` or `--signal=B:...`: the batch shell passes it on to
    # srun as USR1 (srun answers TERM by killing its tasks), the tasks save and exit 75, and
    # the shell requeues the job. `as-srun-starts`: the signal comes while srun starts (srun's
    # stand-in sends it to the shell first thing). The rendered script sets its traps before
    # it starts srun: with them set after, a signal in that window ended the shell, seen once
    # as a failure of the `running` case on a loaded machine (the stand-in had written
    # "started" before the shell reached its traps). On an idle machine both orders pass this
    # case: the shell reaches its traps before srun's stand-in runs.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    early = f'kill -{sent} "$PPID"\n' if at_start else ""
    (bin_dir / "srun").write_text(FORWARDING_SRUN.replace("echo started", early + "echo started"))
    (bin_dir / "scontrol").write_text(REQUEUE_STUBS["scontrol"])
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render(JobConfig(gpus_per_node=0, script="t.py", signal="USR1@90",
                                       requeue=True, doctor=False)))
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "STUB_LOG": str(log)}
    shell = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not at_start and "started" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and shell.poll() is None, "srun never started"
            time.sleep(0.05)
        if not at_start:
            shell.send_signal(getattr(signal, f"SIG{sent}"))
        _, stderr = shell.communicate(timeout=20)
    finally:
        shell.kill()
    assert shell.returncode == 75, stderr
    # ("started": where srun's stand-in got that far before the signal passed on reached it)
    assert [line for line in log.read_text().splitlines() if line != "started"] == [
        "srun got USR1", "requeue 4242"], stderr


def test_the_doctor_step_runs_before_training_unless_turned_off(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = render(JobConfig(script="t.py"))
    assert text.index("python -m tfdist doctor") < text.index("python t.py")
    assert "tfdist doctor" not in render(JobConfig(script="t.py", doctor=False))
    code, out, _ = _cli(["--no-doctor", "t.py"], capsys)
    assert code == 0 and "tfdist doctor" not in out
    code, out, _ = _cli(["t.py"], capsys)
    assert code == 0 and "tfdist doctor" in out
    with pytest.raises(ConfigError, match="doctor applies to kinds train and scaling only"):
        JobConfig(kind="build-venv", venv="v", packages=("tfdist",), doctor=False)


@pytest.mark.parametrize(("keys", "expected"), [
    ({"gpus_per_node": 4, "cores_per_node": 64}, 16),          # one task per GPU
    ({"gpus_per_node": 4, "cores_per_node": 6}, 1),            # never below one
    ({"gpus_per_node": 4, "cores_per_node": 64, "cpus_per_task": 5}, 5),  # the key wins
    ({"gpus_per_node": 4, "cores_per_node": 64, "backend": "torch", "launcher": "torchrun"},
     64),                                                      # one torchrun agent per node
    ({"gpus_per_node": 4}, None),                              # unknown: Slurm's default
])
def test_cpus_per_task_shares_the_nodes_cores_among_its_tasks(keys, expected) -> None:
    assert JobConfig(script="t.py", **keys).effective_cpus_per_task == expected


@pytest.mark.parametrize(("sinfo", "expected"), [
    ("64\n", 64), ("48\n64+\n", 48), ("", None), ("n/a\n", None),
])
def test_the_fewest_cores_sinfo_reports(sinfo, expected) -> None:
    from tfdist.jobs.cli import node_cores

    assert node_cores(sinfo) == expected


def test_a_job_that_survives_lost_nodes_says_either_cause_of_its_requeue() -> None:
    # tfdist survive exits 75 when fewer than min_nodes answer, as a preempted step does.
    surviving = render(JobConfig(script="t.py", requeue=True, nodes=3, min_nodes=2,
                                 venv="/v"))
    assert "python -m tfdist survive --min-nodes 2" in surviving
    assert "export TFDIST_REQUEUE_IF_BATCH_LOST=1" in surviving  # the batch node lost: the tasks
    assert 'echo "tfdist: preempted, or too few nodes left: the line above says which; ' \
           'requeueing job ${job:-$SLURM_JOB_ID}" >&2' in surviving
    plain = render(JobConfig(script="t.py", requeue=True, nodes=3))
    assert 'echo "tfdist: preempted; requeueing job ${job:-$SLURM_JOB_ID}" >&2' in plain
    assert "TFDIST_REQUEUE_IF_BATCH_LOST" not in plain  # Slurm requeues it on a node failure


@pytest.mark.parametrize(("codes", "ends", "runs"), [
    ([143, 0], 0, 2),  # a task ended by the cleanup of an earlier run: again, then on
    ([137, 143, 0], 0, 3),
    ([143, 143, 143], 143, 3),  # three times: the job ends with it
    ([1], 1, 1),  # the doctor found a problem: no second run
])
def test_a_requeued_jobs_doctor_step_runs_again_when_a_signal_ended_a_task(
        tmp_path: Path, codes: list[int], ends: int, runs: int) -> None:
    # The rendered doctor step, run by bash with a stand-in srun that exits with each code of
    # `codes` in turn (as srun does when its tasks ended so).
    text = render(JobConfig(script="t.py", requeue=True, nodes=2))
    start = text.index("for attempt in 1 2 3; do")
    end = text.index('[ "$code" -eq 0 ] || exit "$code"') + len('[ "$code" -eq 0 ] || exit "$code"')
    count = tmp_path / "count"
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\necho x >> " + str(count) + "\n"
                    f"set -- {' '.join(map(str, codes))}\n"
                    f"shift $(($(wc -l < {count}) - 1))\nexit \"$1\"\n")
    srun.chmod(0o755)
    run = subprocess.run(["bash", "-c", "set -eo pipefail\n" + text[start:end] + "\nexit 0"],
                         env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == ends, run.stderr
    assert len(count.read_text().splitlines()) == runs
    assert run.stderr.count("a signal ended a task of the doctor's step") == sum(
        code in (137, 143) for code in codes[:runs]), run.stderr


def test_spare_nodes_are_allocated_idle_and_handed_to_tfdist_survive() -> None:
    text = render(JobConfig(script="t.py", nodes=2, spare_nodes=1, venv="/v"))
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill" in text
    assert "# 2 nodes train; 1 more wait idle" in text
    # Without min_nodes a lost node is replaced, never left out: at least the 2 that train.
    assert "python -m tfdist survive --min-nodes 2 --restarts 3 --tasks-per-node 1 --spares 1 " \
           "--" in text
