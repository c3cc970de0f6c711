"""tfdist's heartbeat (:mod:`tfdist.heartbeat`) over Horovod's Gloo rendezvous server.

Horovod's Gloo waits ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (tfdist's default 120 s) for a peer that
stopped, and then says "Horovod has been shut down" without naming it. Every Gloo launch has a
key-value server the ranks reach, its rendezvous: horovodrun's, ``tfdist launch``'s, or rank 0's
under srun (:mod:`tfdist.horovod.join`). The heartbeat keeps its counters there, in a scope of
its own, so a stopped rank is named after ``TFDIST_HEARTBEAT_TIMEOUT`` (30 s). Under MPI
(mpirun, ``srun --mpi=pmix``) there is no such server and no heartbeat: MPI waits forever.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any

from tfdist import heartbeat
from tfdist.env import ClusterEnvironment
from tfdist.settings import resolve

__all__ = ["HttpStore", "start"]

logger = logging.getLogger("tfdist")
SCOPE = "tfdist-heartbeat"


class HttpStore:
    """The store :class:`tfdist.heartbeat.Heartbeat` needs, over Horovod's HTTP key-value server
    (``PUT``/``GET /scope/key``). Each rank adds only to its own counter, so ``add`` keeps the
    count here and writes it; ``compare_set`` reads, then writes (no other rank writes the
    verdict's key at the same beat but the one that also found the same silence).

    Args:
        address, port: the server.
        timeout_s: how long one request may take.
    """

    def __init__(self, address: str, port: int, timeout_s: float) -> None:
        self.url, self.timeout = f"http://{address}:{port}/{SCOPE}/", timeout_s
        self._counts: dict[str, int] = {}

    def _request(self, key: str, data: bytes | None = None) -> bytes | None:
        method = "GET" if data is None else "PUT"
        request = urllib.request.Request(self.url + key.replace("/", "."), data=data,
                                         method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return bytes(reply.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            return int(self._request(key) or b"0")
        self._counts[key] = self._counts.get(key, 0) + amount
        self._request(key, str(self._counts[key]).encode())
        return self._counts[key]

    def check(self, keys: list[str]) -> bool:
        return all(self._request(key) is not None for key in keys)

    def get(self, key: str) -> bytes:
        found = self._request(key)
        if found is None:
            raise KeyError(key)
        return found

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        found = self._request(key)
        if found is None or found.decode() == expected:
            self._request(key, desired.encode())
            return desired.encode()
        return found


def start(environment: ClusterEnvironment, hvd: Any) -> heartbeat.Heartbeat | None:
    """Starts this rank's heartbeat when Horovod runs on Gloo with a rendezvous server (the
    launch's ``coordinator``); None otherwise (one process, MPI)."""
    if environment.world_size < 2 or not environment.coordinator or not hvd.gloo_enabled():
        return None
    address, port = environment.coordinator.rsplit(":", 1)
    limit = float(resolve("heartbeat_timeout"))
    store = HttpStore(address, int(port), timeout_s=limit)
    # Under srun rank 0's process serves the rendezvous (tfdist.horovod.join): silent, it is
    # the one stopped; elsewhere the launcher serves it.
    store_rank = 0 if environment.facts.serves_rendezvous else None
    return heartbeat.start(store, environment, int(hvd.rank()), int(hvd.size()), limit,
                           store_rank)
