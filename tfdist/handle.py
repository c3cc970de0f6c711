"""What tfdist's own rooms call on the handle ``dist``, as two protocols (pure: imports nothing
but typing).

:class:`Agreeing` is what the guards need (the preemption watch, its saves, the exit): the place
in the job and one collective of a few numbers. Every handle has it: TensorFlow's
(:class:`tfdist.backends.base.Distributed`), Keras 3 on JAX's
(:class:`tfdist.backends.keras_jax.JaxDistributed`) and torch's
(:class:`tfdist.torch.TorchDistributed`).

:class:`Handle` adds what the Keras wing (:mod:`tfdist.keras`, :mod:`tfdist.jax.callbacks`), the
replica sync check (:mod:`tfdist.sync`), the folder's ownership (:mod:`tfdist.ownership`) and the
throughput meter (:mod:`tfdist.throughput`) call: the replicas, the backend's row, the gathers
and the saves' rules. TensorFlow's and JAX's handles have it; those rooms type ``dist`` with it,
never with a backend's class, so no room below the backends imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from tfdist.backend_facts import Backend
    from tfdist.env import ClusterEnvironment

__all__ = ["Agreeing", "Handle"]


class Agreeing(Protocol):
    """What every handle has, whatever its framework: what the guards call."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_chief(self) -> bool: ...

    @property
    def environment(self) -> ClusterEnvironment: ...

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]: ...

    def exit_barrier(self) -> None: ...


class Handle(Agreeing, Protocol):
    """TensorFlow's and JAX's handle as the Keras wing, the sync check, the ownership check and
    the throughput meter call it (:class:`tfdist.backends.base.Distributed` documents each)."""

    @property
    def backend(self) -> str: ...

    @property
    def facts(self) -> Backend: ...

    @property
    def strategy(self) -> Any: ...

    @property
    def num_replicas(self) -> int: ...

    @property
    def local_replicas(self) -> int: ...

    @property
    def save_on_every_rank(self) -> bool: ...

    @property
    def sharded_batch_size(self) -> int | None: ...

    def scope(self) -> Any: ...

    def backend_callbacks(self) -> list[Any]: ...

    def local_copies(self, variable: Any) -> list[Any]: ...

    def gather_rows(self, rows: np.ndarray, timeout_s: float) -> np.ndarray: ...

    def prepare_gather_rows(self, width: int, timeout_s: float) -> None: ...
