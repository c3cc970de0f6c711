"""Horovod's Gloo rendezvous without horovodrun: for srun steps and ``tfdist launch``.

horovodrun starts an HTTP key-value server and gives every process ``HOROVOD_*`` variables
before ``hvd.init()``. tfdist does the same: ``tfdist launch`` runs the server in the launcher,
and in an srun step rank 0 runs it on the step's derived port (see :mod:`tfdist.env.slurm`) while
the other ranks wait until it answers. The ``*_env``/``slots`` functions are pure.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tfdist.env.base import local_ranks
from tfdist.errors import LaunchError

__all__ = ["Slot", "RendezvousServer", "gloo_env", "slots", "wait_for_server"]

_READY = ("tfdist", "ready")  # scope and key rank 0 publishes once its server listens
# Gloo's own timeout (rendezvous and every collective) is 30 s by default; TensorFlow's import
# alone varies by more than that on a busy node. A dead peer still fails at once.
DEFAULT_GLOO_TIMEOUT_S = 120


@dataclass(frozen=True)
class Slot:
    """One process in Horovod's terms (the fields of horovodrun's ``SlotInfo``)."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def slots(host_of_rank: Sequence[str]) -> list[Slot]:
    """Every rank's slot, given the host of each rank in rank order.

    ``cross_rank`` numbers the hosts that have a process with the same ``local_rank``, in order
    of first appearance, as horovodrun does.
    """
    hosts = list(dict.fromkeys(host_of_rank))
    local = local_ranks(host_of_rank)
    result = []
    for rank, host in enumerate(host_of_rank):
        peers = [h for h in hosts if any(
            hh == h and lr == local[rank] for hh, lr in zip(host_of_rank, local, strict=True))]
        result.append(Slot(host, rank, local[rank], peers.index(host), len(host_of_rank),
                           host_of_rank.count(host), len(peers)))
    return result


def gloo_env(slot: Slot, address: str, port: int, iface: str | None,
             timeout_s: int = DEFAULT_GLOO_TIMEOUT_S) -> dict[str, str]:
    """The ``HOROVOD_*`` variables horovodrun's Gloo mode sets for ``slot``.

    Args:
        slot: this process.
        address: host name or IP of the rendezvous server.
        port: its port.
        iface: network interface for Gloo's connections (``HOROVOD_GLOO_IFACE``); ``None``
            lets Gloo use the address its host name resolves to.
        timeout_s: Gloo's rendezvous and collective timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``).
    """
    env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(timeout_s),
    }
    if iface:
        env["HOROVOD_GLOO_IFACE"] = iface
    return env


class RendezvousServer:
    """Horovod's HTTP rendezvous server on a given port, serving from a daemon thread.

    Args:
        port: the port to listen on (all interfaces); 0 picks a free one.
        plan: every rank's slot (sizes of Horovod's global, local and cross scopes).
        token: published under ``tfdist/ready`` so that clients can tell this server from
            another program that happens to listen on the port.

    Raises:
        LaunchError: the port is taken.
    """

    def __init__(self, port: int, plan: Sequence[Slot], token: str = "1") -> None:
        from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

        try:
            self._httpd: Any = RendezvousHTTPServer(("", port), RendezvousHandler, 0)
        except OSError as error:
            raise LaunchError(f"cannot start Horovod's rendezvous server on port {port}: "
                              f"{error}. Another job may use it: set TFDIST_PORT_BASE to a free "
                              "range") from None
        self._httpd.init(list(plan))
        with self._httpd.cache_lock:
            self._httpd.cache.setdefault(_READY[0], {})[_READY[1]] = token.encode()
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="tfdist-horovod-rendezvous")
        self._thread.start()

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def wait_for_server(address: str, port: int, token: str, timeout_s: float) -> None:
    """Waits until rank 0's server answers with ``token``.

    Horovod's client gives up after 3 tries 0.5 s apart, less than rank 0 may need to start.

    Raises:
        LaunchError: no answer within ``timeout_s``.
    """
    url = f"http://{address}:{port}/{_READY[0]}/{_READY[1]}"
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                body = reply.read().decode()
            if body == token:
                return
            last = f"answered {body!r}, not this job's {token!r}"
        except (urllib.error.URLError, OSError) as error:
            last = str(error)
        time.sleep(0.2)
    raise LaunchError(
        f"Horovod's rendezvous server of rank 0 at {address}:{port} did not come up within "
        f"{timeout_s:g} s ({last}). Rank 0 may have failed (see its output), or this address "
        "does not reach it: set TFDIST_HOST_TEMPLATE (e.g. '{host}-ib0'), or raise "
        "TFDIST_HOROVOD_START_TIMEOUT.")
