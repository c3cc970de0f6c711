"""The README's commands run as written: every `tfdist job` and `tfdist launch` line of its bash
blocks whose script is in this repository (not a placeholder such as train.py), except those
that submit to Slurm (tests/test_slurm_jobs.py submits) or need Horovod's environment
(tests/test_horovod.py launches it). The install recipes are run by tests/test_install.py.
Two promises of the text are held to what it shows: the log files step 5 names are those the
job of step 3 writes, and the hand-written job script passes --cpus-per-task on to srun."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EXAMPLE_NEEDS, clean_env, require

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^( *)```bash\n(.*?)^\1```", re.S | re.M)


def commands(markdown: str) -> list[str]:
    """The command lines of the bash blocks of ``markdown``: continuations joined, indentation
    and trailing comments removed (pure)."""
    found = []
    for _, body in BLOCK.findall(markdown):
        body = re.sub(r"\\\n\s*", " ", body)
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(shlex.join(words))
    return found


COMMANDS = {
    # name: (markdown, expected command lines)
    "indented, continued, commented": (
        "1. step\n\n   ```bash\n   tfdist job --nodes 2 \\\n       train.py --x='${A}'  # note\n"
        "   ```\n",
        ["tfdist job --nodes 2 train.py '--x=${A}'"]),
    "two blocks, python ignored": (
        "```bash\na b\n```\n\n```python\nprint(1)\n```\n```bash\nc\n```\n", ["a b", "c"]),
}


@pytest.mark.parametrize("case", sorted(COMMANDS))
def test_commands_of_a_markdown_text(case):
    markdown, expected = COMMANDS[case]
    assert commands(markdown) == expected


def _runnable(command: str) -> bool:
    words = shlex.split(command)
    if words[:2] not in (["tfdist", "job"], ["tfdist", "launch"]):
        return False
    if "--submit" in words or "horovod" in words:
        return False
    scripts = [w for w in words if w.endswith((".py", ".yaml"))]
    return all((ROOT / w).exists() for w in scripts)


README_COMMANDS = [c for c in commands((ROOT / "README.md").read_text()) if _runnable(c)]


def test_the_five_steps_are_among_them():
    assert "tfdist launch -n 2 examples/keras_train.py --epochs=1" in README_COMMANDS
    assert any(c.startswith("tfdist job --nodes 2 --gpus-per-node 4 --time 02:00:00")
               for c in README_COMMANDS), README_COMMANDS
    assert len(README_COMMANDS) >= 4, README_COMMANDS


def _section(heading: str) -> str:
    """The README's text under ``heading`` (a ``## `` heading), up to the next one (pure)."""
    return (ROOT / "README.md").read_text().split(f"\n{heading}\n")[1].split("\n## ")[0]


def test_step_5_names_the_log_files_that_step_3_renders():
    steps = _section("## From one GPU to Slurm in five steps")
    command = next(c for c in README_COMMANDS
                   if c.startswith("tfdist job --nodes 2 --gpus-per-node 4 --time 02:00:00"))
    run = subprocess.run([sys.executable, "-m", "tfdist", *shlex.split(command)[1:]], cwd=ROOT,
                         env=clean_env(), capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    script = run.stdout
    # %x is the job's name, %j its id, %t the task (the rank): the names step 5 gives.
    assert "#SBATCH --job-name=tfdist\n" in script and "#SBATCH --output=%x-%j.out\n" in script
    training = script[:script.index("python examples/keras_train.py")]
    training = training[training.rindex("srun "):]  # the step that starts the training
    assert "--output=%x-%j-%t.out" in training, training
    step_5 = steps.split("\n5. ")[1]
    assert "`tfdist-JOBID.out`" in step_5 and "`tfdist-JOBID-RANK.out`" in step_5, step_5


def test_the_hand_written_job_script_gives_srun_the_cpus_per_task():
    # From Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch; it reads
    # SRUN_CPUS_PER_TASK, which the script must export before its srun.
    script = next(body for _, body in BLOCK.findall(_section("## On Slurm"))
                  if body.startswith("#!/bin/bash"))
    assert re.search(r"^#SBATCH --cpus-per-task=\d+", script, re.M), script
    export = re.search(r"^export SRUN_CPUS_PER_TASK=\$SLURM_CPUS_PER_TASK\b", script, re.M)
    assert export and export.start() < script.index("\nsrun "), script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the repository's examples/ and jobscripts/, so that commands which write
    (`--save run.sbatch`) leave the checkout alone."""
    folder = tmp_path_factory.mktemp("readme")
    for name in ("examples", "jobscripts"):
        (folder / name).symlink_to(ROOT / name)
    return folder


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", README_COMMANDS)
def test_the_readme_command_runs(command, workdir):
    words = shlex.split(command)
    if words[1] == "launch":  # it runs this Python's tfdist, and the examples it names
        require(*(m for w in words if w.startswith("examples/")
                  for m in EXAMPLE_NEEDS.get(w.removeprefix("examples/"), ())))
    env = clean_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TFDS_DATA_DIR"] = str(workdir / "data")  # the example's digits, written locally
    run = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if words[1] == "job":
        script = (workdir / words[words.index("--save") + 1]).read_text() \
            if "--save" in words else run.stdout
        assert script.startswith("#!/bin/bash") and "#SBATCH --nodes=" in script, script
        assert "srun" in script
    elif "doctor" in words:
        assert "tfdist doctor: ready: 2 rank(s)" in run.stdout, run.stdout[-3000:]
    elif "env" in words:  # each rank lists the patches of its launch, MWMS on two workers
        for rank in (0, 1):
            assert re.search(rf"^\[{rank}\] patches: \d+ change\(s\)", run.stdout, re.M) and \
                f"[{rank}]   keras3-symbolic-build: " in run.stdout, run.stdout[-3000:]
    else:  # a launch trains: every rank ends with the same weights
        digests = re.findall(r"^\[(\d)\] tfdist: rank \d of 2: final weights (\w+)$",
                             run.stdout, re.M)
        assert len(digests) == 2 and len({d for _, d in digests}) == 1, run.stdout[-3000:]
