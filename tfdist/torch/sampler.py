"""A DistributedSampler whose epochs advance by themselves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from torch.utils.data import DistributedSampler

__all__ = ["EpochSampler"]

_T = TypeVar("_T")


class EpochSampler(DistributedSampler[_T]):
    """``DistributedSampler`` that moves on to the next epoch each time it is iterated.

    With the stock sampler, a loop that forgets ``sampler.set_epoch(epoch)`` shuffles every
    epoch the same way, silently. Here each pass (one ``for batch in loader``) uses
    :attr:`epoch` and then increments it, so the order changes every epoch on every rank alike.
    ``set_epoch(n)`` still works: it sets the epoch of the next pass (to resume at epoch ``n``),
    and a loop that calls it every epoch, as PyTorch's examples do, behaves the same.

    Like the stock sampler, each rank gets ``ceil(len(dataset) / size)`` indices: when the
    dataset does not divide, the first indices are repeated (``drop_last=False``) or the tail
    is dropped (``drop_last=True``).
    """

    def __iter__(self) -> Iterator[_T]:
        indices = super().__iter__()  # computed eagerly from self.epoch
        self.epoch += 1
        return indices
