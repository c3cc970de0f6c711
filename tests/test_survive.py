"""tfdist survive's pure parts: srun's failure lines, the step's command, the decision after a
failed step (the real node loss runs on the Slurm test cluster: test_slurm_failures.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from helpers import ROOT, clean_env

from tfdist.env import ClusterEnvironment
from tfdist.errors import EXIT_CONFIG, ConfigError
from tfdist.survive import (
    decide,
    failed_task,
    failure_of,
    node_addresses,
    orphaned,
    probe,
    resumed_from,
    set_up_error,
    slurmd_port,
    step_command,
)

SRUN_LINES = {
    # srun's stderr line (Slurm 22.05, as printed on the test cluster): a failure?
    "srun: error: n9: task 0: Exited with exit code 1": True,
    "srun: error: n10: tasks 2-3: Exited with exit code 137": True,
    "srun: error: n10: task 1: Killed": True,
    "srun: error: n9: tasks 0,2: Terminated": True,
    "srun: error: Node failure on n11": True,
    "srun: error: n9: task 0: Exited with exit code 0": False,
    "srun: error: n10: task 1: Exited with exit code 75": False,  # saved and stopped: no failure
    "srun: error: n9: tasks 0-1: Exited with exit code 175": True,
    "srun: launch/slurm: _step_signal: Terminating StepId=47.0": False,
    "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.": False,
    "tfdist: rank 2 (host n11) failed or stopped responding": False,
}


@pytest.mark.parametrize("line", sorted(SRUN_LINES))
def test_srun_lines_that_end_a_step_are_recognised(line):
    assert failed_task(line + "\n") == SRUN_LINES[line]


FAILURES = {
    # srun's stderr line: how the step failed, without the node (None: no failure)
    "srun: error: n10: task 1: Killed": "task 1: Killed",
    "srun: error: n9: tasks 0-1: Exited with exit code 1": "tasks 0-1: Exited with exit code 1",
    "srun: error: n11: task 2: Segmentation fault": "task 2: Segmentation fault",
    "srun: error: Node failure on n11": "Node failure on n11",
    "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.": None,
}


@pytest.mark.parametrize("line", sorted(FAILURES))
def test_a_failure_is_described_without_its_node(line):
    assert failure_of(line + "\n") == FAILURES[line]


RESUMED = {
    # a line of the training's stderr: where the run resumed (None: it says nothing of it)
    "tfdist: resuming at step 13 of epoch 2 from runs/x/preempted": "step 13 of epoch 2",
    "tfdist: resuming at step 16 of epoch 1 (its end) from runs/x/preempted; it ran on 3 "
    "workers, now 2": "step 16 of epoch 1 (its end)",
    "W1129 10:00:00.1 1 fit.py:276] tfdist: resuming at step 2 of epoch 3 from /m/preempted":
        "step 2 of epoch 3",
    "tfdist: resuming the loop at step 40 from runs/loop/preempted": "step 40",
    "tfdist: epoch 3: 3,397 examples/s (1,698 per worker)": None,
}


@pytest.mark.parametrize("line", sorted(RESUMED))
def test_where_a_run_resumed_is_read_from_the_chiefs_line(line):
    assert resumed_from(line) == RESUMED[line]


@pytest.mark.parametrize(("line", "set_up"), [
    ("srun: error: n9: task 0: Exited with exit code 78", True),
    ("srun: error: n9: tasks 0-3: Exited with exit code 78", True),
    ("srun: error: n9: task 0: Exited with exit code 1", False),
    ("srun: error: n9: task 0: Exited with exit code 178", False),
    ("tfdist: Exited with exit code 78", False),
])
def test_a_task_that_ended_with_tfdists_own_error_is_recognised(line, set_up):
    assert set_up_error(line) is set_up


def test_a_step_ended_by_tfdists_own_error_is_neither_probed_nor_restarted(tmp_path):
    # A stand-in srun: each call noted; the training step's task "exits 78" as srun reports it.
    # A probe (srun ... true) would be a second call.
    calls = tmp_path / "calls"
    srun = tmp_path / "srun"
    srun.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> {calls}
        echo "srun: error: n1: task 0: Exited with exit code 78" >&2
        exit 78
    """))
    srun.chmod(0o755)
    code = ("from tfdist import survive\n"
            "raise SystemExit(survive.run(survive.Options(job_id='1', nodes=('n1', 'n2'), "
            "min_nodes=1, max_restarts=3, tasks_per_node=1, probe_timeout_s=5), "
            "['srun', 'python', 'train.py']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=clean_env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}"),
                         timeout=60, check=False)
    assert run.returncode == EXIT_CONFIG, run.stderr
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()  # no probe, no restart
    assert "no node is probed, nothing restarted" in run.stderr


def test_the_step_runs_on_exactly_the_nodes_given():
    srun = ["srun", "--kill-on-bad-exit=1", "python", "train.py", "--epochs=3"]
    assert step_command(srun, ["n9", "n10"], 4) == [
        "srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--nodelist=n9,n10",
        "--overlap", "--kill-on-bad-exit=1", "python", "train.py", "--epochs=3"]
    assert step_command(["/usr/bin/srun", "true"], ["n1"], 1)[:2] == ["/usr/bin/srun",
                                                                      "--nodes=1"]


@pytest.mark.parametrize("command", [[], ["python", "train.py"], ["mpirun", "srun"]])
def test_a_command_that_is_not_srun_is_refused(command):
    with pytest.raises(ConfigError, match="tfdist survive runs an srun step"):
        step_command(command, ["n9"], 1)


NODES = ("n9", "n10", "n11")
DECISIONS = {
    # name: (the nodes that answered, min nodes, restarts done, the most; action, nodes, says)
    "one lost: restart": (("n9", "n10"), 2, 0, 3, "restart", ("n9", "n10"),
                          "n11 did not answer: training goes on on n9, n10 (2 of 3 nodes; "
                          "restart 1 of 3) from the last save"),
    "the first node lost: the others": (("n10", "n11"), 1, 2, 3, "restart", ("n10", "n11"),
                                        "restart 3 of 3"),
    "too few left: requeue": (("n9",), 2, 0, 3, "requeue", ("n9",),
                              "n10, n11 did not answer; 1 of 3 nodes left, fewer than "
                              "--min-nodes 2: requeueing"),
    "restarts used up: requeue": (("n9", "n10"), 2, 3, 3, "requeue", ("n9", "n10"),
                                  "restarted 3 times already (--restarts 3): requeueing"),
    "no restarts allowed: requeue": (("n9", "n10"), 1, 0, 0, "requeue", ("n9", "n10"),
                                     "--restarts 0"),
    "every node answered: the same nodes again": (
        NODES, 2, 0, 3, "restart", NODES, "every node answered: a task failed (task 1: Killed) "
        "on a healthy node; training starts again on the same 3 node(s) (restart 1 of 3) from "
        "the last save"),
    "every node answered, restarts used up: fail": (
        NODES, 2, 3, 3, "fail", NODES, "restarted 3 times already (--restarts 3)"),
    "every node answered, a crash loop: fail": (
        NODES, 2, 1, 3, "fail", NODES, "failed the same way (task 1: Killed) from the same "
        "save as before: a crash loop of the program"),
    "a node lost after a crash loop: restart": (("n9", "n10"), 2, 1, 3, "restart",
                                                ("n9", "n10"), "n11 did not answer"),
}


@pytest.mark.parametrize("case", sorted(DECISIONS))
def test_after_a_failed_step_a_node_is_dropped_only_when_it_does_not_answer(case):
    alive, least, done, most, action, nodes, says = DECISIONS[case]
    decision = decide(NODES, alive, min_nodes=least, restarts=done, max_restarts=most,
                      failure="task 1: Killed", crash_loop="crash loop" in case)
    assert (decision.action, decision.nodes) == (action, nodes), decision
    assert says in decision.why, decision.why


SPARES = ("n12", "n13")
WITH_SPARES = {
    # name: (the nodes that answered of NODES and SPARES, min nodes; action, nodes, spares
    #        left, says)
    "one lost: a spare takes its place": (
        ("n9", "n11", "n12", "n13"), 3, "restart", ("n9", "n11", "n12"), ("n13",),
        "n10 did not answer (spare n12 in its place): training goes on on n9, n11, n12 (as "
        "many as before: the continuation is the uninterrupted run's; restart 1 of 3)"),
    "two lost: both spares": (("n9", "n12", "n13"), 3, "restart", ("n9", "n12", "n13"), (),
                              "n10, n11 did not answer (spare n12, n13 in their place)"),
    "a spare lost too: the one left": (("n9", "n11", "n13"), 3, "restart",
                                       ("n9", "n11", "n13"), (), "spare n13 in its place"),
    "no spare answers: fewer nodes": (("n9", "n11"), 2, "restart", ("n9", "n11"), (),
                                      "2 of 3 nodes"),
    "more lost than spares: below min_nodes": (
        ("n9", "n12"), 3, "requeue", ("n9", "n12"), (),
        "n10, n11 did not answer (spare n12 in their place; 1 place(s) without a spare); 2 of 3 "
        "nodes left, fewer than --min-nodes 3"),
    "a healthy node's task failed: spares kept": (NODES + SPARES, 3, "restart", NODES,
                                                  SPARES, "every node answered"),
}


@pytest.mark.parametrize("case", sorted(WITH_SPARES))
def test_a_lost_nodes_place_goes_to_a_spare_that_answers(case):
    alive, least, action, nodes, spares, says = WITH_SPARES[case]
    decision = decide(NODES, alive, min_nodes=least, restarts=0, max_restarts=3,
                      spares=SPARES)
    assert (decision.action, decision.nodes, decision.spares) == (action, nodes, spares), \
        decision
    assert says in decision.why, decision.why


def _survive(tmp_path, script: str, max_restarts: int = 3, nodes: tuple[str, ...] = ("n1", "n2"),
             spares: int = 0, every: float = 30.0
             ) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """tfdist survive on ``nodes`` (the last ``spares`` of them idle) with a stand-in srun
    (``script``, sh; $calls counts its calls and notes each): its run and the calls."""
    calls = tmp_path / "calls"
    srun = tmp_path / "srun"
    srun.write_text(f"#!/bin/sh\ncalls={calls}\necho \"$*\" >> $calls\n"
                    + textwrap.dedent(script))
    srun.chmod(0o755)
    code = ("from tfdist import survive\n"
            f"raise SystemExit(survive.run(survive.Options(job_id='1', nodes={nodes!r}, "
            f"min_nodes=1, max_restarts={max_restarts}, tasks_per_node=1, probe_timeout_s=5, "
            f"spares={spares}, return_probe_s={every}), ['srun', 'python', 'train.py']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=clean_env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}"),
                         timeout=60, check=False)
    return run, calls.read_text().splitlines()


# The stand-in: a probe (srun ... true) answers; the training step's n-th call (counted by the
# lines of $calls that run train.py) does what the test says.
_TRAINING = """\
case "$*" in *" true") exit 0 ;; esac
n=$(grep -c train.py "$calls")
"""


def test_a_task_killed_on_a_healthy_node_is_restarted_on_the_same_nodes(tmp_path):
    run, calls = _survive(tmp_path, _TRAINING + textwrap.dedent("""\
        if [ "$n" -eq 1 ]; then
            echo "tfdist: resuming at step 3 of epoch 1 from m/preempted" >&2
            echo "srun: error: n2: task 1: Killed" >&2; exit 137
        fi
        echo "tfdist: resuming at step 8 of epoch 2 from m/preempted" >&2
        exit 0
    """))
    assert run.returncode == 0, run.stderr
    training = [c for c in calls if "train.py" in c]
    assert len(training) == 2 and training[0] == training[1], calls  # the same nodes again
    assert "--nodelist=n1,n2" in training[1], training
    assert "a task failed (task 1: Killed) on a healthy node; training starts again on the " \
           "same 2 node(s) (restart 1 of 3)" in run.stderr


def test_a_step_that_fails_the_same_way_from_the_same_save_is_a_crash_loop(tmp_path):
    # Killed after the same save twice: no third start. (A failure from a later save, as in the
    # test above, is restarted again.)
    run, calls = _survive(tmp_path, _TRAINING + textwrap.dedent("""\
        echo "tfdist: resuming at step 3 of epoch 1 from m/preempted" >&2
        echo "srun: error: n2: task 1: Killed" >&2; exit 137
    """))
    assert run.returncode == 137, run.stderr
    assert len([c for c in calls if "train.py" in c]) == 2, calls
    assert run.stderr.count("a crash loop of the program") == 1, run.stderr


def _task(node_rank: int, **fields: object) -> ClusterEnvironment:
    """A task of step 5.0 of a job on n9-n11 (one task per node), on node ``node_rank``."""
    return ClusterEnvironment(**{
        "launcher": "slurm", "rank": node_rank, "world_size": 3, "node_rank": node_rank,
        "num_nodes": 3, "hosts": NODES, "job_id": "5", "step_id": "0", "batch_host": "n9",
        **fields})


ORPHANED = {
    # name: (this task, the failed peers' hosts, the host template; the lost batch node)
    "the batch node lost, seen from n10": (_task(1), ["n9"], "{host}", "n9"),
    "the batch node lost with another": (_task(2), ["n10", "n9"], "{host}", "n9"),
    "addresses by the template": (_task(1), ["n9-ib0"], "{host}-ib0", "n9"),
    "another node lost: the step loop lives": (_task(1), ["n11"], "{host}", None),
    "the task on the batch node itself": (_task(0), ["n9"], "{host}", None),
    "no failed peer named": (_task(1), [], "{host}", None),
    "not a step (the batch shell)": (_task(1, step_id=None), ["n9"], "{host}", None),
    "another launcher": (_task(1, launcher="local"), ["n9"], "{host}", None),
}


@pytest.mark.parametrize("case", sorted(ORPHANED))
def test_a_task_outlives_its_batch_script_only_when_the_batch_node_failed(case):
    task, failed, template, lost = ORPHANED[case]
    assert orphaned(task, failed, template) == lost


def test_a_spare_node_replaces_a_lost_one_at_the_same_size(tmp_path):
    # n1, n2 train, n3 waits; n2 is lost (the probe's step on it fails), so the step starts
    # again on n1 and n3: two nodes, as before.
    run, calls = _survive(tmp_path, textwrap.dedent("""\
        case "$*" in
            *"--nodelist=n2 "*" true") exit 1 ;;
            *" true") exit 0 ;;
        esac
        n=$(grep -c train.py "$calls")
        if [ "$n" -eq 1 ]; then echo "srun: error: Node failure on n2" >&2; exit 1; fi
        exit 0
    """), nodes=("n1", "n2", "n3"), spares=1)
    assert run.returncode == 0, run.stderr
    training = [c for c in calls if "train.py" in c]
    assert [("--nodelist=n1,n2" in training[0]), ("--nodelist=n1,n3" in training[1])] == [
        True, True], training
    assert all("--nodes=2" in c for c in training), training
    assert "n2 did not answer (spare n3 in its place): training goes on on n1, n3 (as many as " \
           "before" in run.stderr


def test_a_lost_node_that_answers_again_rejoins_at_the_next_save(tmp_path):
    # n2 is lost (its probe fails while the file `down` is there); the step goes on on n1,
    # which takes n2 back once it answers: the step is asked to stop at a save (SIGUSR1; the
    # stand-in exits 75 as tfdist's ranks do) and starts again on n1 and n2.
    down = tmp_path / "down"
    down.touch()
    run, calls = _survive(tmp_path, textwrap.dedent(f"""\
        case "$*" in
            *"--nodelist=n2 "*" true") [ -e {down} ] && exit 1; exit 0 ;;
            *" true") exit 0 ;;
        esac
        n=$(grep -c train.py "$calls")
        if [ "$n" -eq 1 ]; then echo "srun: error: Node failure on n2" >&2; exit 1; fi
        if [ "$n" -eq 2 ]; then
            trap 'exit 75' USR1
            rm {down}
            while :; do sleep 0.1; done
        fi
        exit 0
    """), every=0.5)
    assert run.returncode == 0, run.stderr
    training = [c for c in calls if "train.py" in c]
    assert ["--nodelist=n1,n2" in training[0], "--nodelist=n1 " in training[1],
            "--nodelist=n1,n2" in training[2]] == [True] * 3 and len(training) == 3, training
    assert "n2 answers again: the step stops at its next save" in run.stderr, run.stderr
    assert "training goes on on n1, n2 (2 of 2 nodes) from it" in run.stderr, run.stderr


def test_a_preemption_during_the_wait_for_a_lost_node_is_still_a_requeue(tmp_path):
    # The control: the step on n1 exits 75 because of a signal from outside (here: its own
    # preemption, with no node back): 75 goes to the job script, nothing is started again.
    run, calls = _survive(tmp_path, textwrap.dedent("""\
        case "$*" in
            *"--nodelist=n2 "*" true") exit 1 ;;
            *" true") exit 0 ;;
        esac
        n=$(grep -c train.py "$calls")
        if [ "$n" -eq 1 ]; then echo "srun: error: Node failure on n2" >&2; exit 1; fi
        echo "srun: error: n1: task 0: Exited with exit code 75" >&2
        exit 75
    """), every=0.5)
    assert run.returncode == 75, run.stderr
    assert len([c for c in calls if "train.py" in c]) == 2, calls
    assert run.stderr.count("tfdist survive: the training step") == 1, run.stderr  # no probe


# scontrol show node -o (Slurm 22.05, as the test cluster prints it; the lines shortened)
SHOW_NODE = (
    "NodeName=n9 Arch=x86_64 CoresPerSocket=1 CPUAlloc=1 CPUTot=4 NodeAddr=10.77.9.9 "
    "NodeHostName=n9 Version=22.05.8 OS=Linux 6.1.0-30-amd64 #1 SMP State=MIXED Partitions=t\n"
    "NodeName=n11 Arch=x86_64 CPUTot=4 NodeAddr=n11-ib NodeHostName=n11 State=DOWN+NOT_RESPONDING "
    "Reason=Not responding [root@2026-11-29T23:01:02]\n"
    "NodeName=n10 CPUTot=4 State=IDLE\n")


def test_each_nodes_address_and_slurmds_port_are_read_from_scontrol():
    assert node_addresses(SHOW_NODE) == {"n9": "10.77.9.9", "n11": "n11-ib", "n10": "n10"}
    assert node_addresses("") == {}
    assert slurmd_port("SlurmctldPort           = 6817\nSlurmdPort              = 7003\n"
                       "SlurmdPidFile           = /run/slurmd.pid\n") == 7003
    assert slurmd_port("SlurmctldPort = 6817\n") == 6818  # Slurm's default


@contextmanager
def _ports() -> Iterator[tuple[tuple[str, int], tuple[str, int]]]:
    """Two local addresses: one that answers TCP connections, one that answers none (a
    listening socket whose backlog is full: the closest honest stand-in for a cut node on one
    machine)."""
    live, silent = socket.socket(), socket.socket()
    fillers = []
    try:
        for sock in (live, silent):
            sock.bind(("127.0.0.1", 0))
        live.listen(64)
        silent.listen(0)
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(silent.getsockname())
            fillers.append(filler)
        yield live.getsockname(), silent.getsockname()
    finally:
        for sock in (live, silent, *fillers):
            sock.close()


def test_a_node_whose_slurmd_answers_no_connection_is_lost_before_srun_says_so(tmp_path):
    # The stand-in srun's probe step on n2 hangs, as srun waits MessageTimeout for a cut node.
    # n2's slurmd address answers no connection: lost after SILENT_S, not after the probe's
    # 60 s. The control: the same hung step with an address that answers waits for srun (here
    # its 4 s timeout): a live slurmd is never dropped on the port's word alone.
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\ncase "$*" in *"--nodelist=n2 "*) exec sleep 120 ;; esac\n')
    srun.chmod(0o755)
    environ = clean_env(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with _ports() as (live, silent):
        started = time.monotonic()
        assert probe("1", ["n1", "n2"], 60, environ, {"n1": live, "n2": silent}) == ["n1"]
        quick = time.monotonic() - started
        started = time.monotonic()
        assert probe("1", ["n1", "n2"], 4, environ, {"n1": live, "n2": live}) == ["n1"]
        waited = time.monotonic() - started
    assert quick < 30 and waited >= 4, (quick, waited)
