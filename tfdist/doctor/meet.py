"""The ranks meet at the coordinator's port over plain TCP, before any framework starts.

Rank 0 listens on its own worker port (the one TensorFlow's coordination service will use);
every other rank connects with a deadline and sends its report as one JSON line; rank 0 answers
each with the verdict. So a closed port, a firewall or a wrong address is found in seconds and
named with the rank and host that could not get through, instead of a framework waiting for
minutes. The clients close first, so rank 0's port is free again at once for the framework.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tfdist.doctor.report import Problem

__all__ = ["Meeting", "gather", "report_to"]

_RETRY_S = 0.2
_KEPT: list[int] = []  # connections to rank 0 kept open until this process exits (report_to)


@dataclass
class Meeting:
    """What rank 0 gathered: every report that arrived, and the ranks that did not."""

    reports: dict[int, dict[str, Any]]
    missing: list[int]
    problems: list[Problem]
    judged: bool = False  # whether the verdict was computed (not when the port was taken)


def gather(port: int, world_size: int, mine: dict[str, Any], timeout_s: float,
           verdict: Callable[[Meeting], dict[str, Any]], *,
           hosts: Sequence[str] = (), host: str = "") -> Meeting:
    """Rank 0: serves ``port`` until every rank has reported or ``timeout_s`` passed, then sends
    each the verdict computed from the :class:`Meeting`.

    Args:
        hosts: every rank's host as the launch names it, for the ranks that never report.
        host: this machine's name.
    """
    meeting = Meeting({0: mine}, [], [])
    try:
        server = _listen(port)
    except OSError as error:
        meeting.missing = list(range(1, world_size))
        meeting.problems.append(Problem(
            0, host or _host(hosts, 0),
            f"cannot listen on port {port}: {os.strerror(error.errno) if error.errno else error}",
            "another process holds the port (another job on this node?): set "
            "TFDIST_PORT_BASE to a free range, or wait for it to end"))
        return meeting
    clients: list[socket.socket] = []
    deadline = time.monotonic() + timeout_s
    with server:
        while len(meeting.reports) < world_size and time.monotonic() < deadline:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                client, _ = server.accept()
            except TimeoutError:
                break
            client.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                report = json.loads(_read_line(client))
            except (OSError, ValueError):
                client.close()
                continue
            meeting.reports[int(report["rank"])] = report
            clients.append(client)
        meeting.missing = [r for r in range(world_size) if r not in meeting.reports]
        meeting.problems += [Problem(
            rank, _host(hosts, rank), f"did not reach rank 0's port {port} within "
            f"{timeout_s:g} s (it did not start, crashed, or cannot connect)",
            "read that rank's own output; if it says it cannot connect, open the port range "
            "between the nodes or set TFDIST_HOST_TEMPLATE to an interface that routes")
            for rank in meeting.missing]
        answer = (json.dumps(verdict(meeting)) + "\n").encode()
        meeting.judged = True
        for client in clients:
            with contextlib.suppress(OSError):
                client.sendall(answer)
        # Each client hangs up first: at once when it goes on, at its exit when the verdict
        # ended it (report_to). Rank 0 waits for that, up to 5 s in all, then closes.
        until = time.monotonic() + 5.0
        for client in clients:
            with contextlib.suppress(OSError):
                client.settimeout(max(0.01, until - time.monotonic()))
                client.recv(1)
            client.close()
    return meeting


def report_to(address: str, mine: dict[str, Any], timeout_s: float,
              heard: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """Any other rank: connects to rank 0 within ``timeout_s``, sends the report, returns the
    verdict. ``heard`` gets the verdict first and says whether this rank ends with it; then the
    connection is closed by this process's exit, which rank 0 waits for before its own.

    Raises:
        ConnectionError: no connection within the deadline, with the last error.
        TimeoutError: connected, but no verdict came.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(_why(last))
        try:
            connection = socket.create_connection((host, int(port)), timeout=min(left, 5.0))
            break
        except OSError as error:  # refused: rank 0 is not listening yet
            last = error
            time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
    with connection:
        connection.sendall((json.dumps(mine) + "\n").encode())
        # Rank 0 answers once every rank arrived or its own deadline passed.
        connection.settimeout(timeout_s + 10.0)
        try:
            verdict = dict(json.loads(_read_line(connection)))
        except (OSError, ValueError) as error:
            raise TimeoutError(f"rank 0 accepted the report but sent no verdict ({error})") \
                from None
        if heard is not None and heard(verdict):
            # This rank ends here: the connection stays open until its process has exited (the
            # kernel closes the copy), so that rank 0 can exit after it.
            _KEPT.append(os.dup(connection.fileno()))
        return verdict


def _listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed before a whole line")
        data += chunk
    return data.decode()


def _why(error: OSError | None) -> str:
    if isinstance(error, TimeoutError):
        return "connections time out (a firewall dropping packets, or an address that does not "\
               "route here)"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (rank 0 is not listening: it did not start, or the port or " \
               "address is wrong)"
    return str(error) if error else "no attempt finished"


def _host(hosts: Sequence[str], rank: int) -> str:
    return hosts[rank] if rank < len(hosts) else "?"
