"""DistributedDataParallel over tfdist's process group: ``backend="ddp"`` (the default).

``dist.wrap(model)`` moves the model to this rank's device and, when the job has more than one
process, wraps it in DDP, which broadcasts rank 0's parameters and buffers and averages the
gradients in every backward pass. A job of one process has nothing to broadcast or average, and
DDP's gradient buckets would still cost it a few percent a step: there ``wrap`` returns the
model itself on the device, and ``save``, ``state_dict``, ``backward``, ``unwrap`` and the
``(model, optimizer)`` return work as they do on many processes.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from tfdist.env import ClusterEnvironment
from tfdist.torch.handle import TorchDistributed, TorchSettings, count_steps, start_group

__all__ = ["DDPDistributed", "create"]

_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__)


class DDPDistributed(TorchDistributed):
    """The torch handle of DDP: tfdist's process group, ``DistributedDataParallel`` in
    :meth:`wrap` when there is more than one process."""

    backend = "ddp"

    @property
    def label(self) -> str:
        return f"torch {self.collective}"

    @property
    def uses_ddp(self) -> bool:
        """Whether :meth:`wrap` wraps the model in ``DistributedDataParallel``: on more than one
        process."""
        return self.world_size > 1

    @property
    def wraps_with(self) -> str:
        if self.uses_ddp:
            return super().wraps_with
        return "model not wrapped (one process: no DistributedDataParallel to pay for)"

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **options: Any) -> Any:
        """Moves the model to :attr:`device`; on more than one process wraps it in DDP, which
        broadcasts rank 0's parameters and buffers here, then averages the gradients in every
        backward pass. The optimizer comes back as it is. ``options`` go to DDP (e.g.
        ``find_unused_parameters=True``); in one process they are only checked against DDP's
        arguments, so a misspelt one fails there too. Without ``optimizer`` the model alone
        comes back.

        In one process the model comes back unwrapped: its ``state_dict`` keys have no
        ``module.`` prefix, and it gets a ``no_sync()`` that does nothing (DDP's, for gradient
        accumulation) unless it has an attribute of that name already.
        """
        _DDP_OPTIONS.bind(None, model, **options)  # TypeError on an argument DDP lacks
        model = model.to(self.device)
        if self.uses_ddp:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped: torch.nn.Module = DistributedDataParallel(model, device_ids=device_ids,
                                                               **options)
        else:
            wrapped = model
            if not hasattr(model, "no_sync"):
                # An instance attribute, not a submodule: state_dict and parameters unchanged.
                model.__dict__["no_sync"] = contextlib.nullcontext
        wrapped.register_forward_pre_hook(count_steps)
        return wrapped if optimizer is None else (wrapped, optimizer)


def create(environment: ClusterEnvironment, settings: TorchSettings) -> DDPDistributed:
    """The DDP backend's handle: tfdist's process group
    (:func:`tfdist.torch.handle.start_group`)."""
    return start_group(DDPDistributed, environment, settings)
