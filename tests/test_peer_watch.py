"""The watch of a peer's host (tfdist.peer_watch): which rank each rank watches, when its
host is overdue, and a real watch of a port that stops answering (the cut node itself runs
on the Slurm test cluster: tests/test_slurm_failures.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, clean_env

from tfdist.env import ClusterEnvironment
from tfdist.failures import failed_ranks
from tfdist.peer_watch import overdue, silent_host_message, watched

THREE_NODES = ("n9:2222", "n10:2222", "n11:2222")
WATCHED = {
    # name: (this rank, the workers' addresses; the rank watched, its host and port)
    "rank 0 watches rank 1": (0, THREE_NODES, (1, "n10", 2222)),
    "the last rank watches rank 0": (2, THREE_NODES, (0, "n9", 2222)),
    "two ranks on one host: no watch": (0, ("n9:2222", "n9:2223"), None),
    "a ring across hosts, neighbours on one": (1, ("n9:1", "n9:2", "n10:1", "n10:2"),
                                              (2, "n10", 1)),
    "one process": (0, ("n9:2222",), None),
    "no addresses": (0, (), None),
}


@pytest.mark.parametrize("case", sorted(WATCHED))
def test_each_rank_watches_the_next_ones_host_when_it_is_another(case):
    rank, addresses, expected = WATCHED[case]
    environment = ClusterEnvironment("slurm", rank=rank, world_size=max(len(addresses), 1),
                                     worker_addresses=addresses)
    assert watched(environment) == expected


def test_a_host_is_overdue_after_the_limit_and_named_by_rank():
    assert not overdue(100.0, 109.9, 10.0) and overdue(100.0, 110.0, 10.0)
    assert failed_ranks(silent_host_message(2, "n11:2222", 10), THREE_NODES) == [2]


def test_a_port_that_stops_answering_ends_the_watching_process_with_the_line(tmp_path):
    # The closest honest stand-in for a cut network on one machine: a listening socket whose
    # backlog is full answers no more connections (they time out), as a silent host does. The
    # watching process names rank 1 and exits 1 within the limit; a refused port (a process
    # that ended) would not count.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):  # fill the backlog: later connections get no answer
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    code = ("import time\n"
            "from tfdist import peer_watch\n"
            "from tfdist.env import ClusterEnvironment\n"
            "env = ClusterEnvironment('slurm', rank=0, world_size=2, worker_addresses=("
            f"'localhost:1', '127.0.0.1:{port}'))\n"
            "peer_watch.start(env, 3.0)\n"
            "time.sleep(30)\n")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=clean_env(), timeout=60, check=False)
    took = time.monotonic() - started
    listener.close()
    for filler in fillers:
        filler.close()
    assert run.returncode == 1, run.stderr
    assert f"rank 1 sent no heartbeat: its host stopped answering (no TCP connection to " \
           f"127.0.0.1:{port}" in run.stderr
    assert "tfdist: rank 1 (host 127.0.0.1) failed or stopped responding" in run.stderr
    assert took < 20, took


def test_a_port_that_refuses_is_a_peer_that_ended_not_a_lost_host():
    # The control: nothing listens (a peer that finished first closed its port): the kernel
    # refuses at once, which is an answer; the watch never ends the process.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    code = ("import time\n"
            "from tfdist import peer_watch\n"
            "from tfdist.env import ClusterEnvironment\n"
            "env = ClusterEnvironment('slurm', rank=0, world_size=2, worker_addresses=("
            f"'localhost:1', '127.0.0.1:{port}'))\n"
            "peer_watch.start(env, 1.5)\n"
            "time.sleep(4)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=clean_env(), timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert "stopped answering" not in run.stderr
