"""A ``model_dir`` belongs to one run, and every rank sees it.

Two runs in one ``model_dir`` resume each other's saves and append to each other's files; a
``model_dir`` on node-local scratch (``$TMPDIR``) is a different folder on every node, and the
first save that every rank writes into fails on some of them. So before the first step, where
``dist.callbacks(model_dir=...)`` or a custom loop's ``dist.load_state`` first names the folder,
:func:`claim` runs on every rank:

1. The chief holds ``model_dir/tfdist.lock`` (JSON: host, pid and the process's start, Slurm
   job id, start time, a random token). A lock of another run that is still alive refuses this
   one; a lock whose owner is gone (a dead pid on this host, a Slurm job no longer running, a
   lease not renewed for :data:`LEASE_S` on another host) is taken over with a line saying so;
   a requeued Slurm job takes over its own quietly. :func:`verdict` decides (pure).
2. One small collective carries the chief's answer and the lock's token to every rank; each rank
   reads the lock back and checks the token; a second one (``gather_rows``) tells every rank who
   could not. A refusal, a folder the chief cannot write, or a rank that cannot see the chief's
   file stops every rank with the same one-line :class:`~tfdist.errors.StorageError` naming the
   folder, the rank and host, and the fix.

The chief renews the lock's time every :data:`LEASE_S` / 4 seconds in a thread of its own and
removes it at exit (also at a preempted exit, :func:`release_all`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tfdist import model_dir as layout
from tfdist.errors import StorageError

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["LEASE_S", "Holder", "Verdict", "claim", "held_by_another", "not_seen", "release_all",
           "verdict"]

logger = logging.getLogger("tfdist")

LEASE_S = 120.0  # a lock on another host not renewed for this long belongs to a run that is gone
SEEN_WAIT_S = 5.0  # a rank retries reading the chief's lock this long (a network file system)


@dataclass(frozen=True)
class Holder:
    """Who holds a ``model_dir``: what the lock file says.

    Attributes:
        host: the chief's host name.
        pid: the chief's process id.
        pid_start: when that process started (``/proc/PID/stat``'s start time, clock ticks
            since boot), so a reused pid is not taken for the holder; None where unknown.
        job_id: the Slurm job id, or None outside Slurm.
        started: when the run took the lock (seconds since the epoch).
        token: a random number in [1, 2**24) that identifies this holding (exact in float32).
    """

    host: str
    pid: int
    pid_start: int | None
    job_id: str | None
    started: float
    token: int

    def describe(self) -> str:
        """``pid 123 on n9, Slurm job 42, started 2026-11-28 04:06:30``."""
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}{job}, started {when}"


class Verdict(NamedTuple):
    """What a run does with a lock it finds: ``take`` (none there), ``own`` (its own job's,
    taken over quietly), ``take over`` (its owner is gone) or ``refuse``; and why."""

    action: str
    why: str


def verdict(held: Holder | None, me: Holder, *, pid_alive: bool | None,
            job_running: bool | None, age_s: float, lease_s: float = LEASE_S) -> Verdict:
    """What to do with the lock ``held`` (pure).

    Args:
        held: the lock found, or None.
        me: this run's chief.
        pid_alive: on ``held``'s host, whether its process still runs (None: another host).
        job_running: whether ``held``'s Slurm job still runs (None: no job id, or unknown).
        age_s: seconds since the lock was last renewed.
        lease_s: a lock on another host not renewed for this long is abandoned.
    """
    if held is None:
        return Verdict("take", "")
    if held.host == me.host and held.pid == me.pid:
        return Verdict("own", "this process's own")
    if held.host == me.host and pid_alive:
        return Verdict("refuse", "its process is running on this host")
    if held.job_id is not None and held.job_id == me.job_id:
        return Verdict("own", f"an earlier run of Slurm job {held.job_id}")
    if held.host == me.host:
        return Verdict("take over", "its process has ended")
    if job_running is False:
        return Verdict("take over", f"Slurm job {held.job_id} is no longer running")
    if job_running:
        return Verdict("refuse", f"Slurm job {held.job_id} is running")
    if age_s > lease_s:
        return Verdict("take over", f"its lock was not renewed for {age_s:.0f} s")
    return Verdict("refuse", f"its lock was renewed {age_s:.0f} s ago")


def not_seen(rows: Sequence[Sequence[int]], hosts: Sequence[str], model_dir: str,
             chief_host: str) -> str | None:
    """The line for the ranks that could not read the chief's lock (pure), or None.

    Args:
        rows: one row per replica, ``(rank, node index, missing)``, as :func:`claim` gathers.
        hosts: node names by node index (the launcher's), or empty.
        model_dir: the folder.
        chief_host: where rank 0 wrote it.
    """
    missing = sorted({(int(rank), int(node)) for rank, node, flag in rows if flag})
    if not missing:
        return None
    rank, node = missing[0]
    host = hosts[node] if 0 <= node < len(hosts) else f"node {node}"
    more = f" (and {len(missing) - 1} more rank(s))" if len(missing) > 1 else ""
    return (f"model_dir {model_dir} is not one folder that every rank sees: rank {rank} on "
            f"{host}{more} cannot read {layout.path(model_dir, layout.LOCK)}, which rank 0 "
            f"wrote on {chief_host}. Put model_dir on a file system every node mounts (not "
            "node-local scratch such as $TMPDIR), at the same path on every rank")


# --- the chief's lock, and the check on every rank --------------------------------------------

_claimed: dict[str, tuple[str, int]] = {}  # realpath -> (lock file, token) held by this process
_checked: set[str] = set()  # the folders claim ran for in this process (on every rank alike)
_renewer: list[threading.Thread] = []


def claim(dist: Handle, model_dir: str | os.PathLike[str]) -> None:
    """Holds ``model_dir`` for this run and checks every rank sees it; once per folder and
    process. Call it on every rank at the same point (two small collectives).

    Raises:
        StorageError: on every rank, when another live run holds the folder, the chief cannot
            write there, or a rank cannot read what the chief wrote.
    """
    folder = os.fspath(model_dir)
    key = os.path.realpath(folder)
    if key in _checked:
        return
    _checked.add(key)  # also when it fails: the error ends the run on every rank
    problem, token, chief_host = "", 0, socket.gethostname()
    if dist.is_chief:
        try:
            token = _take(folder, dist.environment)
        except StorageError as error:
            problem = str(error)
        except OSError as error:
            problem = (f"cannot write in model_dir {folder} on rank 0 ({chief_host}): "
                       f"{error.strerror or error}. Point model_dir at a folder this job can "
                       "write, on a file system every node mounts")
    failed, token_sum = dist.sum_over_ranks([1.0 if problem else 0.0, float(token)])
    if failed:
        raise StorageError(problem or f"rank 0 could not hold model_dir {folder}: its line "
                           "says why")
    token = round(token_sum)
    if dist.is_chief:
        _claimed[key] = (layout.path(folder, layout.LOCK), token)
    missing = 0 if dist.is_chief else int(not _sees(folder, token))
    environment = dist.environment
    rows = [[dist.rank, environment.node_rank, missing]] * max(1, int(dist.local_replicas))
    import numpy as np

    table = dist.gather_rows(np.asarray(rows, dtype=np.int64), timeout_s=60.0)
    line = not_seen(table.tolist(), environment.hosts, folder,
                    environment.hosts[0] if environment.hosts else chief_host)
    if line is not None:
        release_all()
        raise StorageError(line)
    if dist.is_chief:
        _start_renewing()


def held_by_another(folder: str, environment: Any) -> str | None:
    """Why a run started here now would be refused ``folder`` (a live run holds it), or None;
    reads the lock, takes nothing (``tfdist doctor --model-dir``)."""
    lock = layout.path(folder, layout.LOCK)
    held, me = _read(lock), _me(environment)
    if held is None:
        return None
    decided = verdict(
        held, me, pid_alive=_pid_alive(held) if held.host == me.host else None,
        job_running=_job_running(held.job_id) if held.job_id else None, age_s=_age(lock))
    if decided.action != "refuse":
        return None
    return f"model_dir {folder} is in use by another run ({held.describe()}; {decided.why})"


def _sees(folder: str, token: int) -> bool:
    """Whether this rank reads the chief's lock with ``token`` (retried for a moment: a
    network file system may answer from a stale cache at first)."""
    deadline = time.monotonic() + SEEN_WAIT_S
    while True:
        found = _read(layout.path(folder, layout.LOCK))
        if found is not None and found.token == token:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _me(environment: Any) -> Holder:
    return Holder(socket.gethostname(), os.getpid(), _process_start(os.getpid()),
                  environment.job_id, time.time(), random.randrange(1, 2 ** 24))


def _take(folder: str, environment: Any) -> int:
    """Takes the lock in ``folder`` for this process (the chief); its token.

    Raises:
        StorageError: another live run holds it.
        OSError: the folder cannot be written.
    """
    os.makedirs(folder, exist_ok=True)
    lock = layout.path(folder, layout.LOCK)
    me = _me(environment)
    held = _read(lock)
    decided = verdict(
        held, me,
        pid_alive=_pid_alive(held) if held is not None and held.host == me.host else None,
        job_running=_job_running(held.job_id) if held is not None and held.job_id else None,
        age_s=_age(lock))
    if held is None and os.path.exists(lock):  # written whole (a link or a rename): damaged
        decided = Verdict("take over", "its lock file cannot be read")
    if decided.action == "refuse":
        assert held is not None
        raise StorageError(
            f"model_dir {folder} is in use by another run ({held.describe()}; {decided.why}): "
            "two runs in one model_dir resume each other's saves and mix their files. Give this "
            f"run its own model_dir, or end that run first (if it is gone: rm {lock})")
    partial = f"{lock}.{me.pid}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(asdict(me), f)
    if decided.action == "take":
        try:
            os.link(partial, lock)  # fails if another run created it meanwhile
        except FileExistsError:
            os.unlink(partial)
            return _take(folder, environment)
        except OSError:  # a file system without hard links: a plain rename
            os.replace(partial, lock)
        else:
            os.unlink(partial)
    else:
        os.replace(partial, lock)
    won = _read(lock)
    if won is None or won.token != me.token:  # another run took it at the same moment
        raise StorageError(f"model_dir {folder} was taken by another run at the same moment "
                           f"({won.describe() if won else 'unknown'}): give each run its own "
                           "model_dir")
    if decided.action == "take over":
        logger.warning("tfdist: model_dir %s was held by a run that is gone (%s; %s): this "
                       "run takes it over", folder, held.describe() if held else lock,
                       decided.why)
    elif decided.action == "own" and held is not None and held.pid != me.pid:
        logger.info("tfdist: model_dir %s: taking over the lock of %s", folder, decided.why)
    return me.token


def _read(lock: str) -> Holder | None:
    try:
        with open(lock, encoding="utf-8") as f:
            found = json.load(f)
        return Holder(str(found["host"]), int(found["pid"]),
                      None if found.get("pid_start") is None else int(found["pid_start"]),
                      None if found.get("job_id") is None else str(found["job_id"]),
                      float(found["started"]), int(found["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _age(lock: str) -> float:
    try:
        return max(0.0, time.time() - os.stat(lock).st_mtime)
    except OSError:
        return 0.0


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), where /proc tells it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(held: Holder) -> bool:
    try:
        os.kill(held.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    start = _process_start(held.pid)
    return held.pid_start is None or start is None or start == held.pid_start


def _job_running(job_id: str) -> bool | None:
    """Whether Slurm job ``job_id`` still runs; None where ``squeue`` cannot tell."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        done = subprocess.run([squeue, "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = done.stdout.strip()
    if done.returncode and "Invalid job id" not in done.stderr:
        return None
    return state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED")


def _start_renewing() -> None:
    if _renewer:
        return
    thread = threading.Thread(target=_renew, name="tfdist-model-dir-lock", daemon=True)
    _renewer.append(thread)
    thread.start()
    atexit.register(release_all)


def _renew() -> None:
    while True:
        time.sleep(LEASE_S / 4)
        for lock, _ in list(_claimed.values()):
            with contextlib.suppress(OSError):
                os.utime(lock)


def release_all() -> None:
    """Removes the locks this process holds (those still its own)."""
    while _claimed:
        _, (lock, token) = _claimed.popitem()
        found = _read(lock)
        if found is not None and found.token == token:
            with contextlib.suppress(OSError):
                os.unlink(lock)
