"""tfdist's heartbeat (:mod:`tfdist.heartbeat`) over the torch process group's own TCPStore."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from tfdist import heartbeat
from tfdist.env import ClusterEnvironment
from tfdist.settings import resolve

__all__ = ["start", "stop"]

logger = logging.getLogger("tfdist")


def start(environment: ClusterEnvironment, rank: int, size: int, timeout_s: float,
          store_rank: int | None) -> heartbeat.Heartbeat | None:
    """Starts this rank's heartbeat over the default process group's TCPStore: a peer silent
    for half the collective timeout, at most ``TFDIST_HEARTBEAT_TIMEOUT``, is named; None for
    one process, or a store that is no TCPStore."""
    if size < 2:
        return None
    limit = heartbeat.limit_for(timeout_s, resolve("heartbeat_timeout"))
    client = _store_client(limit)
    if client is None:
        return None
    return heartbeat.start(client, environment, rank, size, limit, store_rank)


def stop(leave: bool = True) -> None:
    """Stops this process's heartbeat, if any (before the process group goes); ``leave`` as
    :func:`tfdist.heartbeat.stop`."""
    heartbeat.stop(leave)


def _store_client(timeout_s: float) -> Any:
    import torch.distributed as torch_dist

    try:
        store = torch_dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore around the TCPStore
            store = store.underlying_store
        if not isinstance(store, torch_dist.TCPStore):
            return None
        client = store.clone()  # type: ignore[attr-defined]  # its own connection
        client.set_timeout(timedelta(seconds=timeout_s))
        return client
    except (AttributeError, RuntimeError, ValueError) as error:
        logger.debug("tfdist: no heartbeat between the ranks: %s", error)
        return None
