"""Bad input a user gives tfdist's commands: each ends with a non-zero exit status and one
`tfdist...` line that names the fix, never a Python traceback (issue 29's table)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, clean_env

EXAMPLE = ROOT / "examples" / "keras_train.py"

CASES = {
    # name: (tfdist's arguments, extra variables, what the line must say)
    "env, a signal that is none": (["env"], {"TFDIST_PREEMPT_SIGNAL": "FOO"},
                                   "TFDIST_PREEMPT_SIGNAL='FOO' is not a signal: use a name such "
                                   "as USR2"),
    "settings, a signal that is none": (["settings"], {"TFDIST_PREEMPT_SIGNAL": "FOO"},
                                        "TFDIST_PREEMPT_SIGNAL='FOO' is not a signal"),
    "doctor, a signal that is none": (["doctor", "--dry-run"], {"TFDIST_PREEMPT_SIGNAL": "FOO"},
                                      "TFDIST_PREEMPT_SIGNAL='FOO' is not a signal"),
    "env, a signal no process can catch": (["env"], {"TFDIST_PREEMPT_SIGNAL": "KILL"},
                                           "names SIGKILL, which cannot be caught: use USR1"),
    "env, hosts that do not resolve": (
        ["env"], {"TF_CONFIG": '{"cluster":{"worker":["a:1","b:2"]},'
                               '"task":{"type":"worker","index":0}}'},
        "cannot resolve a"),
    "job --mem without a unit": (["job", "--nodes", "1", "--mem", "64", "t.py"], {},
                                 "mem '64' has no unit, and Slurm would read 64 megabytes: "
                                 "write 64G"),
    "job --mem with a unit Slurm lacks": (["job", "--nodes", "1", "--mem", "64X", "t.py"], {},
                                          "mem '64X' is not a memory size"),
    "job, an sbatch option that is none": (
        ["job", "--nodes", "1", "--sbatch-arg=--exclusiv", "t.py"], {},
        "sbatch has no option --exclusiv; did you mean --exclusive?"),
    "survive inside an srun step": (
        ["survive", "--min-nodes", "1", "--tasks-per-node", "1", "--", "srun", "python", "t.py"],
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
         "SLURM_JOB_NODELIST": "n[1-2]"},
        "tfdist survive runs in the job's batch script and starts the srun steps itself; here "
        "it runs inside step 7.0, task 1"),
    "job --node-restarts without --min-nodes": (
        ["job", "--nodes", "2", "--node-restarts", "2", "t.py"], {},
        "node_restarts 2 counts the restarts on the nodes left after one is lost, which "
        "min_nodes turns on"),
    "launch --grace-period, no duration": (["launch", "-n", "1", "--grace-period", "soon", "x"],
                                           {}, "'soon' is no positive duration"),
    "a mistyped command": (["lauch", "train.py"], {},
                           "'lauch' is no tfdist command; did you mean `tfdist launch`? the "
                           "commands: launch, env, doctor"),
    "scaling --out, a file": (["scaling", "-n", "1", "--out", "/etc/passwd", str(EXAMPLE)], {},
                              "--out /etc/passwd: cannot make the folder of the runs there "
                              "(Not a directory); choose a folder you can write to"),
    "scaling --out, under /proc": (["scaling", "-n", "1", "--out", "/proc/nope", str(EXAMPLE)],
                                   {}, "--out /proc/nope: cannot make the folder of the runs"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_one_clear_line_and_a_failing_exit_status(case, tmp_path):
    args, extra, says = CASES[case]
    run = subprocess.run([sys.executable, "-m", "tfdist", *args], cwd=tmp_path,
                         env=clean_env(**extra, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=60, check=False)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in run.stderr.splitlines() if says in line]
    assert len(lines) == 1 and lines[0].startswith("tfdist"), output


@pytest.mark.parametrize(("args", "expected"), [
    # A script's own option that is a prefix of tfdist's (--m of --module/--max-restarts,
    # --gpus of --gpus-per-node) goes to the script: tfdist matches no abbreviation.
    (["launch", "-n", "1", "--dry-run", "t.py", "--m", "0.9"], "t.py --m 0.9"),
    (["job", "--nodes", "1", "--gpus-per-node", "1", "t.py", "--gpus", "4"], "t.py --gpus 4"),
    # a config's args as one string are words, as in a shell
    (["job", "job.yaml"], "t.py --epochs 3 --name 'a b'"),
])
def test_script_options_that_look_like_tfdist_prefixes_go_to_the_script(args, expected, tmp_path):
    (tmp_path / "t.py").write_text("print('t')\n")
    (tmp_path / "job.yaml").write_text('nodes: 1\nscript: t.py\nargs: --epochs 3 --name "a b"\n')
    run = subprocess.run([sys.executable, "-m", "tfdist", *args], cwd=tmp_path,
                         env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert expected in run.stdout, run.stdout
