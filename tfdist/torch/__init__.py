"""PyTorch DDP with tfdist's launch detection: one tool and one set of job scripts for both.

    import tfdist.torch

    with tfdist.torch.distributed() as dist:   # torchrun, srun, tfdist launch or one process
        model = dist.wrap(Net())               # DDP on this rank's GPU (NCCL), or CPU (gloo);
                                               # one process: Net() itself, on its device
        loader = dist.loader(train_set, batch_size=256)  # GLOBAL batch; epochs reshuffle
        optimizer = torch.optim.Adam(model.parameters(), lr=dist.scale_lr(1e-3))
        for epoch in range(epochs):
            for x, y in loader:
                ...
        dist.save(model, "final.pt")           # the chief only, atomically

``import tfdist`` loads no torch; importing this package does.
"""

from __future__ import annotations

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:
    raise ModuleNotFoundError(
        f"tfdist.torch needs PyTorch, which is not installed in this Python ({sys.executable}): "
        "install it with `pip install 'tfdist[torch]'` (on a machine without GPUs pin a CPU "
        "build, e.g. torch==2.13.0 from PyTorch's CPU index), or load your site's PyTorch "
        "module", name="torch")

from tfdist.torch.handle import TorchDistributed, unwrap
from tfdist.torch.rendezvous import Rendezvous
from tfdist.torch.sampler import EpochSampler
from tfdist.torch.start import current, distributed, init, shutdown

__all__ = [
    "EpochSampler",
    "Rendezvous",
    "TorchDistributed",
    "current",
    "distributed",
    "init",
    "shutdown",
    "unwrap",
]
