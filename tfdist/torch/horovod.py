"""Horovod behind the torch handle: ``backend="horovod"`` (``TFDIST_BACKEND=horovod``).

No torch process group: Horovod's own controller (Gloo or MPI) carries the collectives, and the
launch is joined as the TensorFlow backend joins it (horovodrun, mpirun, ``tfdist launch
--backend horovod``, or an srun step with tfdist's Gloo rendezvous or srun's PMIx:
:func:`tfdist.horovod.join.join`). ``dist.wrap(model, optimizer)`` broadcasts rank 0's
parameters and optimizer state and returns ``hvd.DistributedOptimizer`` over the model's named
parameters, which averages the gradients in ``step()``; the training loop is the DDP one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tfdist import failures
from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError
from tfdist.torch.handle import TorchDistributed, TorchSettings, count_steps, pick_device
from tfdist.torch.rendezvous import Rendezvous

__all__ = ["HorovodTorchDistributed", "create"]

logger = logging.getLogger("tfdist")


class HorovodTorchDistributed(TorchDistributed):
    """The torch handle over ``horovod.torch``; ``collective`` is Horovod's controller."""

    backend = "horovod"

    def __init__(self, environment: ClusterEnvironment, rendezvous: Rendezvous, collective: str,
                 device: torch.device, hvd: Any) -> None:
        super().__init__(environment, rendezvous, collective, device)
        self.hvd = hvd
        self._collectives = 0

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        def reduce(value: float = 1.0) -> float:
            tensor = torch.full((n,), value, dtype=torch.float32, device=self.device)
            return float(self.hvd.allreduce(tensor, op=self.hvd.Sum,
                                            name=f"tfdist_doctor_{n}")[0])

        return reduce

    def gather_objects(self, obj: Any) -> list[Any] | None:
        return list(self.hvd.allgather_object(obj))

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **options: Any) -> Any:
        """Moves ``model`` to :attr:`device`, broadcasts rank 0's parameters and buffers, and
        returns ``(model, hvd.DistributedOptimizer(optimizer, named_parameters=...))`` with
        rank 0's optimizer state; ``options`` go to ``DistributedOptimizer`` (e.g.
        ``compression=hvd.Compression.fp16``, ``backward_passes_per_step=2``).

        Raises:
            ConfigError: no optimizer (Horovod averages the gradients in its step).
        """
        if optimizer is None:
            raise ConfigError("backend horovod averages the gradients in the optimizer's step, "
                              "so give it the optimizer: `model, optimizer = dist.wrap(model, "
                              "optimizer)`")
        hvd = self.hvd
        model = model.to(self.device)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        distributed = hvd.DistributedOptimizer(optimizer,
                                               named_parameters=model.named_parameters(),
                                               **options)
        hvd.broadcast_optimizer_state(distributed, root_rank=0)
        model.register_forward_pre_hook(count_steps)
        return model, distributed

    def average(self, value: float | torch.Tensor, weight: float = 1.0) -> float:
        number = value.item() if isinstance(value, torch.Tensor) else float(value)
        total, weights = self.sum_over_ranks([number * weight, float(weight)])
        return total / weights

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        self._collectives += 1  # Horovod matches collectives by name: one name per call site
        total = self.hvd.allreduce(torch.tensor([float(v) for v in values], dtype=torch.float64),
                                   op=self.hvd.Sum, name=f"tfdist.sum.{self._collectives}")
        return [float(v) for v in total.tolist()]

    def barrier(self) -> None:
        self.hvd.barrier()

    def close(self, barrier: bool) -> None:
        """Waits for every rank (after a normal finish), then shuts Horovod down."""
        try:
            if barrier and self.world_size > 1:
                self.barrier()
        finally:
            self.hvd.shutdown()


def create(environment: ClusterEnvironment,
           settings: TorchSettings | None = None) -> HorovodTorchDistributed:
    """Joins the launch with ``horovod.torch`` and returns the handle (Horovod's controller
    carries the collectives: ``settings``' collective and timeout are the process group's).

    Raises:
        ConfigError: Horovod is missing or built without PyTorch.
        LaunchError: a launch Horovod cannot join.
    """
    del settings
    from tfdist.horovod import heartbeat
    from tfdist.horovod import join as joining
    from tfdist.horovod.install import import_horovod_torch

    joining.check_launcher(environment, "backend='ddp'")
    device = pick_device(environment)  # narrows CUDA_VISIBLE_DEVICES before Horovod loads CUDA
    hvd = import_horovod_torch()
    joining.join(environment, hvd)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    failures.install(environment)  # Horovod's shut-down error names no rank: the line does
    heartbeat.start(environment, hvd)  # and a stopped peer is named after 30 s
    rendezvous = Rendezvous(None, int(hvd.rank()), int(hvd.size()),
                            f"Horovod's {controller} controller")
    handle = HorovodTorchDistributed(environment, rendezvous, controller, device, hvd)
    handle.log("tfdist: Horovod for torch, %d process(es), %s controller, device %s; launched "
               "by %s", handle.world_size, controller, device, environment.reason)
    return handle
