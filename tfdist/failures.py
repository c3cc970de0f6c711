"""When a peer dies or hangs: which rank it was, said in one line next to the backend's error.

A rank that crashes, is killed or stops responding shows up on every other rank as an error of
the communication layer, far from the cause:

- MultiWorkerMirroredStrategy: "Collective ops is aborted by: ... The following tasks are
  unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1" (TensorFlow 2.15:
  "Task /job:worker/replica:0/task:1 heartbeat timeout"), or a gRPC "Connection refused" to
  the coordination service;
- Horovod: "Horovod has been shut down. This was caused by an exception on one of the ranks
  ...", which names no rank (Horovod logs gloo's "Read error [10.0.0.2]:43457: Connection reset
  by peer" or "Timed out waiting 120000ms for recv operation to complete" before it, from C++);
- torch with gloo: "Connection closed by peer [10.0.0.2]:43457", "Read error [10.0.0.2]:43457:
  Connection reset by peer", or "Timed out waiting 600000ms for recv operation to complete";
  with NCCL: "Watchdog caught collective operation timeout" (with TORCH_NCCL_DESYNC_DEBUG=1,
  "ranks [1] are the lagging ranks ...") or "remote process exited or there was a network
  error ... Connection closed by remote peer n10<57521>" (NCCL's watchdog mostly ends the
  process itself, before Python sees an error: the heartbeat below speaks first);
- tfdist's own heartbeat under torch (:mod:`tfdist.torch.heartbeat`): "rank 1 sent no heartbeat
  for 60 s".

:func:`failed_ranks` reads the ranks out of that text (pure, tested on messages taken from real
runs); a peer named only by its address (gloo and NCCL give the IP of the peer's own socket,
whose port is no rank's) is matched to the ranks on that host, and :func:`failed_host` says
which host that was. :func:`explain` turns them into the line tfdist prints after the
traceback, with the host, the step this rank stopped at, and where to look first: the failed
rank's own output, which holds the cause.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tfdist import patches

if TYPE_CHECKING:
    from tfdist.env import ClusterEnvironment
    from tfdist.patches import Where

__all__ = ["continued_line", "explain", "failed_host", "failed_hosts", "failed_ranks", "install",
           "install_failure_line", "linger", "progress", "report", "requeue_if_orphaned",
           "silent_message", "was_frozen"]

_TASK = re.compile(r"/job:worker/(?:replica:\d+/)?task:(\d+)")
_REMOTE = re.compile(r"remote target (/job:worker/(?:replica:\d+/)?task:\d+)")
# The coordination service of TensorFlow 2.15 and older: one task per line.
_TIMED_OUT_TASK = re.compile(r"Task /job:worker/(?:replica:\d+/)?task:(\d+) heartbeat timeout")
# A connection to a peer failed: TensorFlow's gRPC, gloo (torch's and Horovod's), NCCL.
_UNREACHABLE = ("Connection refused", "failed to connect", "Socket closed", "Connection reset",
                "Connection closed by", "Read error", "Write error", "Read timeout",
                "Broken pipe", "Got completion from peer")
# A peer's socket as gloo writes it, "[10.0.0.2]:43457", and as NCCL does, "n10<57521>".
_PEER = re.compile(r"\[([0-9A-Za-z.:%_-]+)\]:\d+|([0-9A-Za-z._-]+)<\d+>")
# tfdist's heartbeat (silent_message) and NCCL's desync report (TORCH_NCCL_DESYNC_DEBUG=1).
_SILENT = re.compile(r"rank (\d+) sent no heartbeat")
_LAGGING = re.compile(r"ranks \[([\d, ]+)\] are the lagging ranks")
_DESYNC = "the lagging/dead/mismatched ranks that caused the desync are:"
_DESYNC_RANKS = re.compile(r"\[([\d, ]+)\] (?:joined but didn't finish|finished) collective")
# Errors that mean some peer is gone or late, without saying which.
_UNNAMED = re.compile(r"Horovod has been shut down|Timed out waiting \d+ms for (?:recv|send) "
                      r"operation|Watchdog caught collective operation timeout|remote process "
                      r"exited or there was a network error")
_CAUSES = "(crashed, killed, out of memory, or hung)"
# The call a non-leader makes every few seconds to MWMS's coordination service (in task 0).
_LEADER_SILENT = "CoordinationService/Heartbeat"

# Where training was, kept up to date by tfdist's fit callbacks ({"epoch": E, "step": S}) and
# by tfdist.torch's DDP wrapper ({"step": S}, counted over all epochs).
progress: dict[str, int] = {}


def silent_message(rank: int, seconds: float) -> str:
    """The error tfdist's heartbeat reports for a peer that stopped beating (see the module)."""
    return (f"rank {rank} sent no heartbeat for {seconds:g} s: its process is stopped, frozen or "
            "cut off from the network")


def failed_ranks(message: str, addresses: Sequence[str] = (),
                 aliases: Mapping[str, str] | None = None) -> list[int]:
    """The ranks an error message names as failed, or [] when it names none.

    A peer named only by its host (gloo and NCCL name a peer's socket, whose port is no rank's)
    gives every rank on that host, this process's own included when it runs there:
    :func:`explain` leaves out this rank, and :func:`failed_host` says the match was by host.

    Args:
        message: the text of the backend's error.
        addresses: every rank's address (``host:port``, or ``host`` where the launcher gives
            no port), to recognise a peer named by address in a connection error.
        aliases: IP addresses as errors print them -> the host name ``addresses`` use for it.
    """
    return _named(message, addresses, aliases or {})[0]


def failed_host(message: str, addresses: Sequence[str] = (),
                aliases: Mapping[str, str] | None = None) -> str | None:
    """The host a connection error names the failed peer by, when it names no rank exactly:
    spelled as in ``addresses`` when one of them is that host, else as in the message. None
    when the message names a rank exactly, or no peer at all. Arguments as
    :func:`failed_ranks`."""
    return _named(message, addresses, aliases or {})[1]


def _named(message: str, addresses: Sequence[str],
           aliases: Mapping[str, str]) -> tuple[list[int], str | None]:
    if "unhealthy" in message:  # the coordination service: missed heartbeats
        return _unhealthy(message), None
    timed_out = _TIMED_OUT_TASK.findall(message)
    if timed_out:
        return sorted({int(task) for task in timed_out}), None
    silent = _SILENT.findall(message)
    if silent:
        return sorted({int(rank) for rank in silent}), None
    lagging = _LAGGING.findall(message) or (
        _DESYNC_RANKS.findall(message.split(_DESYNC, 1)[1]) if _DESYNC in message else [])
    if lagging:
        return sorted({int(r) for group in lagging for r in group.split(",")}), None
    if _LEADER_SILENT in message and "Deadline Exceeded" in message:
        # This rank's heartbeat to the coordination service got no answer in time: the service
        # runs in task 0 (MWMS's leader), whose host stopped answering (a dead node, a cut
        # network); its name is in the error where gRPC gives it.
        remote = _REMOTE.search(message)
        return [int(_TASK.findall(remote.group(1))[0]) if remote else 0], None
    if not any(words in message for words in _UNREACHABLE):
        return [], None
    remote = _REMOTE.search(message)  # the service's host, from a heartbeat that failed
    if remote:
        return [int(_TASK.findall(remote.group(1))[0])], None
    exact = [rank for rank, address in enumerate(addresses)
             if ":" in address and any(_mentions(message, spelling)
                                       for spelling in _spellings(address, aliases))]
    if exact:
        return exact, None
    peer = _PEER.search(message)
    if not peer:
        return [], None
    named = peer.group(1) or peer.group(2)
    spellings = {named, aliases.get(named, named)}
    ranks = [rank for rank, address in enumerate(addresses)
             if any(_same_host(_host_of(address), name) for name in spellings)]
    return ranks, (_host_of(addresses[ranks[0]]) if ranks else named)


def failed_hosts(message: str, environment: ClusterEnvironment) -> list[str]:
    """The hosts of the peers ``message`` names as failed (:func:`explain`'s), this process's
    own left out; empty when it names none or the hosts are unknown."""
    addresses = _addresses(environment)
    ranks, host = _named(message, addresses, _aliases(message, environment))
    found = [_host_of(addresses[r]) for r in ranks
             if r != environment.rank and r < len(addresses)]
    if host is not None:
        found.append(host)
    return list(dict.fromkeys(found))


def _unhealthy(message: str) -> list[int]:
    """The tasks the coordination service lists as unhealthy: the lines of task names after
    its sentence, not a task named later (the leader, task 0, relaying the error to the other
    tasks: "... from remote target /job:worker/replica:0/task:0 while calling
    /tensorflow.CoordinationService/PollForError")."""
    listed: set[int] = set()
    for line in message.split("unhealthy", 1)[1].split("\n")[1:]:
        tasks = _TASK.findall(line)
        if not tasks or _TASK.sub("", line).strip(" ,;") != "":
            break
        listed.update(int(task) for task in tasks)
    return sorted(listed)


def _host_of(address: str) -> str:
    return address.rsplit(":", 1)[0] if ":" in address else address


def _spellings(address: str, aliases: Mapping[str, str]) -> set[str]:
    """``host:port`` and ``ip:port`` for every IP that ``aliases`` gives the host."""
    host, port = address.rsplit(":", 1)
    return {address} | {f"{ip}:{port}" for ip, name in aliases.items() if name == host}


def _mentions(message: str, address: str) -> bool:
    # As a whole word: "n1:2222" is not in "n1:22220", nor "n1:2222" in "xn1:2222".
    return re.search(rf"(?<![\w.-]){re.escape(address)}(?!\d)", message) is not None


def _same_host(one: str, other: str) -> bool:
    if one == other:
        return True
    if _is_ip(one) or _is_ip(other):
        return False
    return one.split(".", 1)[0] == other.split(".", 1)[0]  # "n10" and "n10.cluster"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def explain(message: str, environment: ClusterEnvironment, where: dict[str, int] | None = None,
            aliases: Mapping[str, str] | None = None) -> str | None:
    """The line tfdist prints for an error that names failed peers, or None.

    Three forms: the failed ranks with their hosts; "a rank on host H" when the error names the
    peer by host only and several ranks other than this one run there (or none tfdist knows
    of); "another rank" when the error is about a peer but names none (Horovod's, a gloo or NCCL
    timeout), except with two ranks, where it can only be the other one.

    Args:
        message: the text of the error.
        environment: this process's launch (rank, hosts, addresses).
        where: ``{"epoch": E, "step": S}`` (0-based epoch, steps done in it), or ``{"step": S}``
            (steps done in all), when known.
        aliases: IP -> host name, as for :func:`failed_ranks`.
    """
    addresses = _addresses(environment)
    ranks, host = _named(message, addresses, aliases or {})
    me, size = environment.rank, environment.world_size
    ranks = [r for r in ranks if r != me and r < size]
    at = _at(where)
    files = environment.facts.output_per_task  # a file per task: srun --output=...%t
    if not ranks and host is None:
        if not _UNNAMED.search(message) or size < 2:
            return None
        if size != 2:
            return (f"tfdist: another rank failed or stopped responding {_CAUSES}; rank {me} "
                    f"stops here{at}. The error above names none: look first at the rank whose "
                    "output ends with an error of its own, or stops early; it holds the cause.")
        ranks = [1 - me]  # two ranks: the one this rank was waiting for is the other one
    if host is not None and len(ranks) != 1:
        among = (f" (rank {ranks[0]} or {ranks[1]})" if len(ranks) == 2 else
                 f" (one of ranks {', '.join(str(r) for r in ranks)})" if ranks else "")
        return (f"tfdist: a rank on host {host}{among} failed or stopped responding {_CAUSES}; "
                f"rank {me} stops here{at}. Look at the output of the ranks on host {host} "
                f"first: it holds the cause, and the error above only follows from it"
                + (" (under srun: the files of --output=...%t... of those tasks)" if files else "")
                + ".")
    names = ", ".join(f"rank {r} ({_host(addresses, r)})" for r in ranks)
    first = ranks[0]
    return (f"tfdist: {names} failed or stopped responding {_CAUSES}; rank {me} stops here{at}. "
            f"Look at rank {first}'s own output first: it holds the cause, and the error above "
            "only follows from it"
            + (f" (under srun: the task {first} file of --output=...%t...)" if files else "") + ".")


def _at(where: dict[str, int] | None) -> str:
    if not where or "step" not in where:
        return ""
    if "epoch" in where:
        return f" after step {where['step']} of epoch {where['epoch'] + 1}"
    return f" after step {where['step']}"


def _addresses(environment: ClusterEnvironment) -> Sequence[str]:
    """Every rank's ``host:port``, or its host: on one node without addresses (``tfdist launch
    --backend horovod``, horovodrun or torchrun on one host) every rank is on this machine."""
    if environment.worker_addresses:
        return environment.worker_addresses
    if environment.num_nodes == 1 and environment.world_size > 1:
        return ("localhost",) * environment.world_size
    return ()


def _host(addresses: Sequence[str], rank: int) -> str:
    if rank < len(addresses):
        return f"host {_host_of(addresses[rank])}"
    return "host unknown"


def _aliases(message: str, environment: ClusterEnvironment) -> dict[str, str]:
    """IP -> host name for the hosts of ``environment``'s ranks, resolved now, when
    ``message`` names a peer by IP (otherwise nothing is looked up)."""
    peer = _PEER.search(message)
    if not peer or not _is_ip(peer.group(1) or peer.group(2)):
        return {}
    found: dict[str, str] = {}
    for host in dict.fromkeys(_host_of(a) for a in _addresses(environment)):
        try:
            found.update((ip, host) for ip in socket.gethostbyname_ex(host)[2])
        except OSError:
            continue
    return found


def report(message: str, environment: ClusterEnvironment) -> str | None:
    """:func:`explain` for ``message`` with this process's aliases and :data:`progress`; or,
    when this process was itself stopped and continued just before (:func:`continued_line`),
    that: the peers it would blame only gave up on it."""
    line = explain(message, environment, progress, _aliases(message, environment))
    now = time.monotonic()
    if line is None or not was_frozen(_continued_at, _frozen_at, _last_tick, now):
        return line
    assert _continued_at is not None
    return continued_line(environment.rank, now - _continued_at) or line


def was_frozen(continued_at: float | None, frozen_at: float | None, last_tick: float | None,
               now: float) -> bool:
    """Whether this process was stopped: it got SIGCONT (``continued_at``: when Python ran the
    handler, after the C call the main thread was in) and its ticker found a gap in its own
    run around then (``frozen_at``: when it ran again), or has not run since a gap began
    (``last_tick``: it had no turn yet after the continue) (pure).

    SIGCONT alone says nothing: srun ends a step by SIGCONT, SIGTERM, SIGKILL to every task, so
    the ranks that survive a peer's SIGKILL get it too, though they never stopped."""
    if continued_at is None:
        return False
    if frozen_at is not None and -FROZEN_GAP_S <= continued_at - frozen_at \
            <= CONTINUED_RECENTLY_S:
        return True
    return last_tick is not None and now - last_tick > FROZEN_GAP_S


def continued_line(rank: int, seconds_ago: float) -> str | None:
    """The line for a rank that got SIGCONT ``seconds_ago`` (it had been stopped: SIGSTOP, a
    debugger, a frozen node), or None when that was too long ago to explain this error.

    Under srun, a step whose other tasks ended continues a stopped task (SIGCONT) before it
    kills it: for the moment in between, the stopped rank runs, finds its peers gone and would
    name them as the failed ones."""
    if seconds_ago > CONTINUED_RECENTLY_S:
        return None
    return (f"tfdist: rank {rank} was stopped (SIGSTOP, a debugger, or a frozen node) and "
            f"continued {seconds_ago:.0f} s ago; the other ranks gave up on it meanwhile, so the "
            "error above follows from this rank's own stop, not from theirs.")


CONTINUED_RECENTLY_S = 60.0
_continued_at: float | None = None  # the last SIGCONT
_frozen_at: float | None = None  # when the ticker last ran again after a gap (it was stopped)
_last_tick: float | None = None  # the ticker's last turn (None: no ticker)
# The ticker wakes every TICK_S; a wake-up FROZEN_GAP_S late means this process did not run.
TICK_S = 0.5
FROZEN_GAP_S = 5.0


def _continued(signum: int, frame: object) -> None:
    global _continued_at
    _continued_at = time.monotonic()


def _tick() -> None:
    """Notes when this process runs again after it was stopped (a daemon thread: SIGSTOP, a
    debugger, a frozen node stop it with the rest)."""
    global _frozen_at, _last_tick
    _last_tick = time.monotonic()
    while True:
        time.sleep(TICK_S)
        now = time.monotonic()
        if now - _last_tick > FROZEN_GAP_S:
            _frozen_at = now
        _last_tick = now


def install_failure_line(where: Where, dist: Any) -> None:
    """Patch ``failure-line``'s installer (:func:`tfdist.patches.install`)."""
    install(dist.environment)


def install(environment: ClusterEnvironment) -> None:
    """Adds the line to uncaught errors of this process (``sys.excepthook``), once; a later call
    (a process group created again) only replaces the environment the line describes."""
    global _environment
    first = _environment is None
    _environment = environment
    if not first:
        return
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGCONT) == signal.SIG_DFL):
        signal.signal(signal.SIGCONT, _continued)  # the process continues all the same
        if environment.world_size > 1:  # a stopped rank of many blames itself (report)
            threading.Thread(target=_tick, name="tfdist-freeze-ticker", daemon=True).start()

    def wrap(previous: Any) -> Any:
        def hook(kind: type[BaseException], value: BaseException,
                 traceback: TracebackType | None) -> None:
            if not _reported_once(value):
                previous(kind, value, traceback)
            line = report(str(value), _environment) if _environment is not None else None
            if line:
                print(line, file=sys.stderr, flush=True)
                requeue_if_orphaned(str(value))
            linger()  # the process ends with this error: its traceback and line first

        return hook

    patches.apply("failure-line", sys, "excepthook", wrap)


_environment: ClusterEnvironment | None = None  # the launch install() describes


def requeue_if_orphaned(message: str) -> None:
    """A Slurm job whose batch script's node is among the failed peers' is requeued from here
    (:func:`tfdist.survive.requeue_if_orphaned`): nothing else would."""
    if _environment is None or not _environment.facts.batch_script_steps:
        return
    from tfdist import survive

    try:
        said = survive.requeue_if_orphaned(_environment, failed_hosts(message, _environment))
    except Exception as error:  # the failure line above is what counts; say why, go on
        said = f"tfdist: rank {_environment.rank}: the lost batch node's check failed: {error}"
    if said:
        print(said, file=sys.stderr, flush=True)

# Seconds a failing rank of many waits after its last words (:func:`linger`).
LINGER_S = 0.5


def linger(environment: ClusterEnvironment | None = None) -> None:
    """Before this rank of many exits with a failure: flushes its output, then waits
    :data:`LINGER_S` so that the launcher forwards it. srun --kill-on-bad-exit (the rendered
    jobs' main step) ends the step at the first task that fails and drops what its tasks wrote
    just before, the failing task's own too: on the Slurm test cluster the last line after a
    20-line traceback came through 2 times in 8 at once, 8 in 8 after 0.2 s. ``environment``:
    the launch (default: :func:`install`'s); one process does not wait."""
    environment = environment or _environment
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if environment is not None and environment.world_size > 1:
        time.sleep(LINGER_S)


def _reported_once(value: BaseException) -> bool:
    """The replica sync check's report, raised on every rank alike, is printed once: by rank 0,
    without a traceback; the other ranks print one line (``TFDIST_VERBOSE=1``: every rank's
    traceback, as Python prints it). Returns whether it was printed here."""
    from tfdist.errors import ReplicaMismatchError, TfdistError
    from tfdist.settings import resolve

    try:
        verbose = resolve("verbose")
    except TfdistError:  # an invalid value: as verbose, Python's own printing
        verbose = True
    if not isinstance(value, ReplicaMismatchError) or verbose or _environment is None:
        return False
    if _environment.rank == 0:
        print(f"tfdist: {type(value).__name__}: {value}", file=sys.stderr, flush=True)
    else:
        print(f"tfdist: rank {_environment.rank}: the replica sync check failed; rank 0 prints "
              "the report (TFDIST_VERBOSE=1: every rank's traceback)", file=sys.stderr,
              flush=True)
    return True
