"""DistributedDataParallel over tfdist's process group: ``backend="ddp"`` (the default).

``dist.wrap(model)`` moves the model to this rank's device and wraps it in DDP, which
broadcasts rank 0's parameters and buffers and averages the gradients in every backward pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tfdist.env import ClusterEnvironment
from tfdist.torch.handle import TorchDistributed, TorchSettings, count_steps, start_group

__all__ = ["DDPDistributed", "create"]


class DDPDistributed(TorchDistributed):
    """The torch handle of DDP: tfdist's process group, ``DistributedDataParallel`` in
    :meth:`wrap`."""

    backend = "ddp"

    @property
    def label(self) -> str:
        return f"torch {self.collective}"

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **options: Any) -> Any:
        """DDP broadcasts rank 0's parameters and buffers here, then averages the gradients in
        every backward pass; the optimizer comes back as it is. ``options`` go to DDP (e.g.
        ``find_unused_parameters=True``). Without ``optimizer`` the wrapped model alone comes
        back."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model.to(self.device), device_ids=device_ids,
                                          **options)
        wrapped.register_forward_pre_hook(count_steps)
        return wrapped if optimizer is None else (wrapped, optimizer)


def create(environment: ClusterEnvironment, settings: TorchSettings) -> DDPDistributed:
    """The DDP backend's handle: tfdist's process group
    (:func:`tfdist.torch.handle.start_group`)."""
    return start_group(DDPDistributed, environment, settings)
