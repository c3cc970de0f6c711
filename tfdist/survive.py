"""A lost node survived inside the allocation: the job script's step loop (``tfdist survive``).

A node that dies (its network cut, a kernel panic, a power supply) ends a training step: the
ranks on the other nodes name a silent peer and exit 1, and srun, with ``--kill-on-bad-exit``,
then waits for the dead node until Slurm declares it down (``SlurmdTimeout``, 300 s by default;
measured on the test cluster's 60 s: srun returned 72 s after the cut, with "Node failure").
Without ``sbatch --no-kill`` Slurm ends the job there. A job script that ``tfdist job`` renders
with ``min_nodes`` runs its training through this module instead::

    python -m tfdist survive --min-nodes 2 --tasks-per-node 4 -- srun --kill-on-bad-exit=1 \\
        --cpu-bind=cores python train.py ...

It runs srun over the job's nodes, with explicit counts and ``--overlap`` (Slurm 22.05 can leave
the dead step holding the survivors' cores and GPUs; the shell's ``SLURM_NNODES`` still counts
the dead node). When a task fails (srun's "task N: Exited with exit code C" or "Node failure"),
it asks every node in parallel with a one-task step (``srun --overlap -N1 -w NODE true``): a
node is dropped only when it does not answer, never on one rank's blame (a healthy node answered
in 0.1 s on the test cluster; srun gives up on a cut one after ``MessageTimeout``, 12 s, so a
node whose slurmd completes no TCP connection for :data:`SILENT_S` is lost sooner). With at least
``--min-nodes`` left and fewer than ``--restarts`` restarts done, the old srun is abandoned and
the next step starts on the survivors: training resumes from the last save (tfdist's exact
state: an epoch's end, or ``TFDIST_CHECKPOINT_EVERY``'s safety saves), the global batch split
over fewer workers. Below that it exits 75, and the job script requeues the job for a full
allocation.

A task that failed while every node answered (killed by the kernel's OOM killer, a crash of a
library, a bad GPU) is restarted on the same nodes from the last save, within the same
``--restarts``: the world size is unchanged, so the continuation is the uninterrupted run's.
Unless it is a crash loop: the step failed the same way (srun's first failure line, without
its node) twice from the same save (the "resuming at" line of tfdist's chief, or none), so a
third start would fail there again; srun's code is then returned, with one line saying so.
Signals to this process (the job script passes SIGTERM on as SIGUSR1) go on to srun.

:func:`failed_task`, :func:`failure_of`, :func:`resumed_from`, :func:`step_command` and
:func:`decide` are pure and table-tested.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType

from tfdist.env.base import ClusterEnvironment
from tfdist.errors import EXIT_CONFIG, ConfigError
from tfdist.preemption import EXIT_PREEMPTED as EXIT_REQUEUE  # the job script requeues on it

__all__ = ["Decision", "Options", "check_place", "decide", "failed_task", "failure_of",
           "node_addresses", "orphaned", "probe", "requeue_if_orphaned", "resumed_from", "run",
           "set_up_error", "slurmd_addresses", "slurmd_port", "step_command"]

# srun's lines when a task ends badly or a node is lost (Slurm 22.05 to 24.x):
#   srun: error: n9: task 0: Exited with exit code 1
#   srun: error: n10: tasks 2-3: Killed
#   srun: error: Node failure on n11
_FAILED = re.compile(r"^srun: error: (?:\S+: tasks? [\d,-]+: (?:Exited with exit code [1-9]|"
                     r"Killed|Terminated|Segmentation fault|Aborted)|Node failure on )")


def failed_task(line: str) -> bool:
    """Whether srun's stderr ``line`` says that a task failed or a node was lost (pure). A task
    that exited 75 did not fail: it saved at the agreed step and stopped (a preemption, the
    walltime, a stop to grow back), and srun's code says so once every task has."""
    text = line.strip()
    return bool(_FAILED.match(text)) and not text.endswith(
        f"Exited with exit code {EXIT_REQUEUE}")


# The node in srun's line, left out of a failure's description: a task that fails the same way
# on another node after a restart still fails the same way.
_NODE = re.compile(r"^srun: error: \S+: (tasks? )")
# tfdist's chief as a run resumes (tfdist.keras.fit_preemption, tfdist.preemption's loop state):
#   tfdist: resuming at step 13 of epoch 2 from runs/x/preempted
#   tfdist: resuming the loop at step 40 from runs/x/preempted
_RESUMED = re.compile(r"tfdist: resuming (?:the loop )?at (.+?) from ")


def failure_of(line: str) -> str | None:
    """How srun's stderr ``line`` says the step failed, without the node (``"task 1: Killed"``),
    or None when it is no failure line (pure)."""
    if not failed_task(line):
        return None
    text = line.strip()
    return _NODE.sub(r"\1", text).removeprefix("srun: error: ")


def resumed_from(line: str) -> str | None:
    """Where a run resumed, from the line tfdist's chief prints as it does (``"step 13 of
    epoch 2"``), or None for any other line (pure)."""
    found = _RESUMED.search(line)
    return found.group(1) if found else None


def set_up_error(line: str) -> bool:
    """Whether srun's stderr ``line`` says that a task exited with
    :data:`tfdist.errors.EXIT_CONFIG`: one of tfdist's own errors, which no restart on any
    nodes would get past (pure)."""
    return bool(_FAILED.match(line.strip())) and f"Exited with exit code {EXIT_CONFIG}" in line


def check_place(environ: Mapping[str, str]) -> None:
    """``tfdist survive`` runs in the job's batch script, which starts the steps (pure).

    Raises:
        ConfigError: it runs inside an srun step (``srun tfdist survive ...``), where each
            task would start a step of its own and probe the nodes.
    """
    from tfdist.env.slurm import step_task

    task = step_task(environ)
    if task is not None:
        raise ConfigError(f"tfdist survive runs in the job's batch script and starts the srun "
                          f"steps itself; here it runs inside {task}. Fix: call `tfdist "
                          "survive ... -- srun ...` without an srun before it")


def step_command(srun: Sequence[str], nodes: Sequence[str], tasks_per_node: int) -> list[str]:
    """``srun`` (the command the job script gives, ``srun`` and its options first) over exactly
    ``nodes``: explicit node and task counts, the node list, and ``--overlap`` (pure).

    Raises:
        ConfigError: the command does not start with srun.
    """
    if not srun or srun[0].rsplit("/", 1)[-1] != "srun":
        raise ConfigError(f"tfdist survive runs an srun step: give `-- srun [options] PROGRAM`, "
                          f"not {' '.join(srun[:1]) or 'nothing'}")
    return [srun[0], f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}",
            "--overlap", *srun[1:]]


@dataclass(frozen=True)
class Decision:
    """What follows a failed step: ``restart`` on ``nodes``, ``requeue`` the job, or ``fail``
    with srun's code (every node answered: the program failed, not a node); ``why`` is the
    line tfdist prints."""

    action: str
    nodes: tuple[str, ...]
    why: str
    spares: tuple[str, ...] = ()  # the idle nodes left for the next loss


def decide(nodes: Sequence[str], alive: Sequence[str], *, min_nodes: int, restarts: int,
           max_restarts: int, failure: str | None = None, crash_loop: bool = False,
           spares: Sequence[str] = ()) -> Decision:
    """The step loop's choice after a failed step on ``nodes`` of which ``alive`` answered a
    probe (``spares`` asked too), ``restarts`` restarts done so far (pure).

    Args:
        failure: how srun said the step failed (:func:`failure_of`), for the line.
        crash_loop: the step failed the same way from the same save before.
        spares: the job's idle nodes: a lost node's place goes to one that answered, so the
            step starts again with as many nodes as before (the continuation is the
            uninterrupted run's, bit for bit).
    """
    lost = [node for node in nodes if node not in alive]
    answering = [node for node in spares if node in alive]
    taken, kept = answering[:len(lost)], tuple(answering[len(lost):])
    left = sorted([node for node in nodes if node in alive] + taken,
                  key=[*nodes, *spares].index)  # Slurm's order, as srun ranks them
    how = f" ({failure})" if failure else ""
    if not lost:
        if crash_loop:
            return Decision("fail", tuple(nodes), f"every node answered, and the training "
                            f"failed the same way{how} from the same save as before: a crash "
                            "loop of the program, not a node's fault; not restarted again "
                            "(its ranks' output has the cause)")
        if restarts >= max_restarts:
            return Decision("fail", tuple(nodes), f"every node answered: a task failed{how} "
                            f"on a healthy node, and the step was restarted {restarts} times "
                            f"already (--restarts {max_restarts}); its ranks' output has the "
                            "cause")
        return Decision("restart", tuple(nodes), f"every node answered: a task failed{how} on "
                        f"a healthy node; training starts again on the same {len(nodes)} "
                        f"node(s) (restart {restarts + 1} of {max_restarts}) from the last save",
                        kept)
    named = f"{', '.join(lost)} did not answer"
    if taken:
        named += f" (spare {', '.join(taken)} in {'its' if len(lost) == 1 else 'their'} place" + (
            f"; {len(lost) - len(taken)} place(s) without a spare)" if len(taken) < len(lost)
            else ")")
    if len(left) < min_nodes:
        return Decision("requeue", tuple(left), f"{named}; {len(left)} of {len(nodes)} nodes "
                        f"left, fewer than --min-nodes {min_nodes}: requeueing the job for a "
                        "full allocation", kept)
    if restarts >= max_restarts:
        return Decision("requeue", tuple(left), f"{named}; the step was restarted "
                        f"{restarts} times already (--restarts {max_restarts}): requeueing "
                        "the job for a full allocation", kept)
    size = ("as many as before: the continuation is the uninterrupted run's" if len(left) ==
            len(nodes) else f"{len(left)} of {len(nodes)} nodes")
    return Decision("restart", tuple(left), f"{named}: training goes on on {', '.join(left)} "
                    f"({size}; restart {restarts + 1} of {max_restarts}) from the last save",
                    kept)


# A node whose slurmd completes no TCP connection for this long is lost, without waiting for
# srun's verdict, which takes MessageTimeout (10 s by default, 12 s on the test cluster) for a
# cut node: a live host's kernel completes a connection whatever its daemons are doing
# (tfdist.peer_watch reads the ranks' hosts so). srun's own answer decides every other case.
SILENT_S = 2.0
_TCP_EVERY_S = 0.5


def node_addresses(show_node: str) -> dict[str, str]:
    """Each node's address (its ``NodeAddr``, else its name) from ``scontrol show node -o``'s
    lines (pure)."""
    found = {}
    for line in show_node.splitlines():
        fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
        if fields.get("NodeName"):
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found


def slurmd_port(show_config: str) -> int:
    """``SlurmdPort`` from ``scontrol show config``'s lines; 6818, Slurm's default, when it is
    not there (pure)."""
    found = re.search(r"^SlurmdPort\s*=\s*(\d+)\s*$", show_config, re.M)
    return int(found.group(1)) if found else 6818


def slurmd_addresses(nodes: Sequence[str], environ: Mapping[str, str] | None = None
                     ) -> dict[str, tuple[str, int]]:
    """Where each node's slurmd listens, asked of scontrol; empty when it cannot say (then a
    probe waits for srun's verdict alone)."""
    def scontrol(*args: str) -> str:
        return subprocess.run(["scontrol", *args], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=15, check=True,
                              env=None if environ is None else dict(environ)).stdout

    try:
        addresses = node_addresses(scontrol("show", "node", "-o", ",".join(nodes)))
        port = slurmd_port(scontrol("show", "config"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {node: (addresses[node], port) for node in nodes if node in addresses}


def _connects(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=_TCP_EVERY_S):
            return True
    except OSError:  # refused (no slurmd there: no step can run) or no answer
        return False


def _end(step: subprocess.Popen[bytes]) -> None:
    """Ends a probe's srun without waiting for it: SIGTERM, so that it tells slurmctld the step
    is over, then SIGKILL 2 s later if it is still there (a daemon thread: srun took up to 2 s
    to end a step whose node does not answer)."""
    step.terminate()

    def reap() -> None:
        try:
            step.wait(timeout=2)
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait()

    threading.Thread(target=reap, name="tfdist-probe-end", daemon=True).start()


def probe(job_id: str, nodes: Sequence[str], timeout_s: float,
          environ: Mapping[str, str] | None = None,
          slurmd: Mapping[str, tuple[str, int]] | None = None) -> list[str]:
    """The nodes of ``nodes`` that run a one-task step of job ``job_id`` within
    ``timeout_s``, asked in parallel; ``environ``: srun's environment (default: this one). A
    node whose slurmd (``slurmd``: the addresses, :func:`slurmd_addresses`) completes no TCP
    connection for :data:`SILENT_S` is taken for lost before srun says so."""
    def answers(node: str) -> bool:
        command = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1",
                   f"--nodelist={node}", "--quiet", "true"]
        step = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                env=None if environ is None else dict(environ))
        address = (slurmd or {}).get(node)
        started = last = time.monotonic()
        while True:
            try:
                return step.wait(timeout=_TCP_EVERY_S) == 0
            except subprocess.TimeoutExpired:
                pass
            if address is not None and _connects(address):
                last = time.monotonic()
            now = time.monotonic()
            if now - started >= timeout_s or (address is not None and now - last >= SILENT_S):
                _end(step)
                return False

    with ThreadPoolExecutor(max_workers=len(nodes) or 1) as pool:
        found = list(pool.map(answers, nodes))
    return [node for node, ok in zip(nodes, found, strict=True) if ok]


def orphaned(environment: ClusterEnvironment, failed_hosts: Sequence[str],
             host_template: str = "{host}") -> str | None:
    """The node of the job's batch script when this task of a Slurm step outlives it: the
    failed peers' hosts (spelled as in the workers' addresses, ``host_template``) include it,
    and this task runs on another node; else None (pure)."""
    batch = environment.batch_host
    if not environment.facts.batch_script_steps or environment.step_id is None or batch is None:
        return None
    here = (environment.hosts[environment.node_rank]
            if environment.node_rank < len(environment.hosts) else None)
    spellings = {batch, host_template.format(host=batch)}
    if here is None or here == batch or not spellings & set(failed_hosts):
        return None
    return batch


# How long a task gives the batch script's node to run a one-task step: a healthy node
# answered in 0.1 s on the test cluster; a cut one is lost after SILENT_S without a connection
# to its slurmd (srun alone gave up after MessageTimeout, 12 s there).
BATCH_PROBE_S = 20.0


def requeue_if_orphaned(environment: ClusterEnvironment,
                        failed_hosts: Sequence[str]) -> str | None:
    """Requeues the job when the node of its batch script is lost (:func:`orphaned`) and does
    not answer a one-task step, where the job asked for it (``TFDIST_REQUEUE_IF_BATCH_LOST``,
    which the rendered jobs with ``min_nodes`` and ``requeue`` set); the line to print, or
    None. One task per node asks (its first local rank); a second ``scontrol requeue`` of a
    job already requeued fails harmlessly."""
    from tfdist.settings import resolve

    if not resolve("requeue_if_batch_lost") or environment.local_rank != 0:
        return None
    batch = orphaned(environment, failed_hosts, resolve("host_template"))
    if batch is None or environment.job_id is None:
        return None
    job = environment.job_id
    if environment.array_job_id and environment.array_task_id:
        job = f"{environment.array_job_id}_{environment.array_task_id}"
    # srun from inside a step: without the step's variables, which would shape the probe.
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SRUN_")) or k == "SLURM_CONF"}
    if probe(environment.job_id, [batch], BATCH_PROBE_S, clean,
             slurmd_addresses([batch], clean)):
        return None  # the batch script's node lives: its step loop decides
    here, rank = environment.hosts[environment.node_rank], environment.rank
    done = subprocess.run(["scontrol", "requeue", job], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60, check=False, env=clean)
    if done.returncode == 0:
        return (f"tfdist: rank {rank} ({here}): {batch}, the node of the job's batch script "
                f"and its step loop, does not answer: requeued job {job} so that its "
                "allocation does not idle to the time limit")
    said = (done.stderr or done.stdout).strip().splitlines()
    why = said[-1] if said else f"exit code {done.returncode}"
    return (f"tfdist: rank {rank} ({here}): {batch}, the node of the job's batch script, does "
            f"not answer, and `scontrol requeue {job}` failed ({why}): the job may idle to its "
            f"time limit; scancel {job} frees it")


@dataclass(frozen=True)
class Options:
    """``tfdist survive``'s options: the job's id and nodes, at least ``min_nodes`` nodes to go
    on with, at most ``max_restarts`` restarts, the tasks per node, how long a probe may
    take, and how many of the nodes (the last in Slurm's order) wait idle as spares."""

    job_id: str
    nodes: tuple[str, ...]
    min_nodes: int
    max_restarts: int
    tasks_per_node: int
    probe_timeout_s: float = 30.0
    spares: int = 0
    return_probe_s: float = 30.0  # how often a lost node is asked again while the step runs
    slurmd: Mapping[str, tuple[str, int]] | None = None  # slurmd_addresses: faster verdicts


class _Step:
    """One srun step: its process, whether srun said that a task failed (and how, first), and
    where the run resumed."""

    def __init__(self, command: list[str], restart: int) -> None:
        # The step loop is this: the ranks leave what follows exit 75 to it (a preemption's
        # requeue, or a stop at a save to grow back), TFDIST_STEP_LOOP.
        env = {**os.environ, "TFDIST_RESTART_COUNT": str(restart), "TFDIST_STEP_LOOP": "survive"}
        self.failed = threading.Event()
        self.set_up_error = False  # a task exited 78 (set_up_error)
        self.failure: str | None = None  # srun's first failure line (failure_of)
        self.resumed: str | None = None  # the chief's "resuming at" (resumed_from)
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env,
                                        bufsize=1)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if self.resumed is None:
                self.resumed = resumed_from(line)
            failure = failure_of(line)
            if failure is not None:
                self.set_up_error = self.set_up_error or set_up_error(line)
                self.failure = self.failure or failure
                self.failed.set()

    def wait(self) -> int | None:
        """srun's code once it ends; None as soon as srun says a task failed (srun may then
        wait minutes for a node that does not answer)."""
        while self.process.poll() is None:
            if self.failed.wait(0.5):
                return self.process.poll()
        self._copier.join(5)
        return self.process.returncode

    def abandon(self) -> None:
        """Ends this srun without waiting for the lost node (the step stays Slurm's to end)."""
        self.process.kill()
        self.process.wait()


class _Nodes:
    """The step loop's nodes, shared with the thread that asks the lost ones again: those that
    train, the idle spares, the lost, and the lost that answered again (for the next step)."""

    def __init__(self, options: Options) -> None:
        self.training = len(options.nodes) - options.spares
        self.order = list(options.nodes)  # Slurm's order, as srun ranks the tasks
        self.nodes = list(options.nodes[:self.training])
        self.spares = list(options.nodes[self.training:])
        self.lost: list[str] = []
        self.back: list[str] = []
        self.outside = threading.Event()  # a signal came from outside (a preemption)
        self.lock = threading.Lock()

    def ask_again(self, step: _Step, options: Options) -> None:
        """While ``step`` runs, asks the lost nodes again every ``return_probe_s``: one that
        answers is a spare, or, while the step runs short, is taken back: the step is asked
        to stop at its next save (SIGUSR1) (a daemon thread)."""
        while step.process.poll() is None:
            time.sleep(options.return_probe_s)
            with self.lock:
                asked = list(self.lost)
            if not asked or step.process.poll() is not None:
                continue
            answered = probe(options.job_id, asked, options.probe_timeout_s, None,
                             options.slurmd)
            with self.lock:
                for node in answered:
                    self.lost.remove(node)
                    if len(self.nodes) + len(self.back) < self.training:
                        self.back.append(node)
                    else:
                        self.spares.append(node)
                        _say(f"{node} answers again: a spare now")
                back = list(self.back)
            if back and not self.outside.is_set() and step.process.poll() is None:
                _say(f"{', '.join(back)} answers again: the step stops at its next save to "
                     "start again on more nodes")
                step.process.send_signal(signal.SIGUSR1)
                return

    def grown(self, code: int | None) -> bool:
        """After a step ended with ``code``: whether it stopped to take nodes back (then they
        train from now on)."""
        with self.lock:
            regrow = code == EXIT_REQUEUE and bool(self.back) and not self.outside.is_set()
            if regrow:
                self.nodes = sorted(self.nodes + self.back, key=self.order.index)
            self.back.clear()
        if regrow:
            _say(f"the step stopped at a save; training goes on on {', '.join(self.nodes)} "
                 f"({len(self.nodes)} of {self.training} nodes) from it")
        return regrow

    def follow(self, decision: Decision, alive: Sequence[str]) -> None:
        """Takes the nodes of a restart ``decision``; those that did not answer are lost."""
        with self.lock:
            self.lost += [n for n in [*self.nodes, *self.spares] if n not in alive]
            self.nodes, self.spares = list(decision.nodes), list(decision.spares)


def _say(line: str) -> None:
    print(f"tfdist survive: {line}", file=sys.stderr, flush=True)


def run(options: Options, srun: Sequence[str]) -> int:
    """Runs the training step, and the next on the survivors after a lost node; returns the
    code for the job script: the last srun's, or 75 to requeue.

    While a step runs, the nodes lost so far are asked again every ``return_probe_s``: one
    that answers becomes a spare, or, when the step runs on fewer nodes than planned, the step
    is asked to stop at a save (SIGUSR1: every rank saves at one agreed step and exits 75) and
    starts again on the nodes it had plus the returned one (:class:`_Nodes`)."""
    state, restarts, started = _Nodes(options), 0, 0
    current: list[_Step] = []
    before: tuple[str | None, str | None] | None = None  # the last failure, and its save

    def forward(signum: int, frame: FrameType | None) -> None:
        state.outside.set()
        if current and current[0].process.poll() is None:
            current[0].process.send_signal(signal.SIGUSR1 if signum == signal.SIGTERM
                                           else signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    while True:
        step = _Step(step_command(srun, state.nodes, options.tasks_per_node), started)
        current[:], started = [step], started + 1  # TFDIST_RESTART_COUNT: a regrowth too
        threading.Thread(target=state.ask_again, args=(step, options), daemon=True).start()
        code = step.wait()
        if state.grown(code):
            continue
        if code in (0, EXIT_REQUEUE):
            return code
        if code == EXIT_CONFIG or step.set_up_error:
            _say("the training step ended with one of tfdist's own errors (exit code 78, its "
                 "line above): no node is probed, nothing restarted")
            step.process.wait()
            return EXIT_CONFIG
        probed_at = time.monotonic()
        alive = probe(options.job_id, [*state.nodes, *state.spares], options.probe_timeout_s,
                      None, options.slurmd)
        this = (step.failure, step.resumed)
        decision = decide(state.nodes, alive, min_nodes=options.min_nodes, restarts=restarts,
                          max_restarts=options.max_restarts, failure=step.failure,
                          crash_loop=this == before, spares=state.spares)
        before = this
        _say(f"the training step on {','.join(state.nodes)} failed; {decision.why} (probed in "
             f"{time.monotonic() - probed_at:.1f} s)")
        if decision.action == "fail":
            return code if code is not None else step.process.wait()
        step.abandon()
        if decision.action == "requeue":
            return EXIT_REQUEUE
        state.follow(decision, alive)
        restarts += 1
