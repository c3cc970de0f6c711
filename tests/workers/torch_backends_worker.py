"""One rank of the tfdist.torch backend tests: the same training loop under DDP, Horovod and
DeepSpeed (``TFDIST_BACKEND``), the loop examples/torch_train.py uses::

    model, optimizer = dist.wrap(model, optimizer)
    dist.backward(loss)
    optimizer.step()

    python torch_backends_worker.py OUT_DIR {dist,control}

``dist``: each rank starts from DIFFERENT random weights (seed 100 + rank), so the backend must
broadcast rank 0's and average every gradient for the ranks to end equal. ``control``: the same
steps on the same shards from the SAME weights with a plain optimizer and no wrap: only the
missing averaging can make the ranks differ. Writes OUT_DIR/weights-R.npz and result-R.json.
``LOADER_AFTER_WRAP=1`` makes the loader after ``wrap``, as examples/torch_train.py does.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

import tfdist.torch

EPOCHS, GLOBAL_BATCH = 2, 32


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    with tfdist.torch.distributed() as dist:
        torch.manual_seed(100 + dist.rank if mode == "dist" else 100)
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        after = os.environ.get("LOADER_AFTER_WRAP") == "1"  # the example's order
        loader = None if after else dist.loader(_data(), batch_size=GLOBAL_BATCH, seed=7)
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if mode == "dist":
            model, optimizer = dist.wrap(model, optimizer)
        loader = loader or dist.loader(_data(), batch_size=GLOBAL_BATCH, seed=7)
        losses = []
        for _ in range(EPOCHS):
            total, steps = 0.0, 0
            for x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if mode == "dist":
                    dist.backward(loss)
                else:
                    loss.backward()
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
            losses.append(dist.average(total / steps))
        state = dist.state_dict(model)  # every rank's whole model, ZeRO stage 3's gathered
        weights = {f"w{i}": tensor.numpy() for i, tensor in enumerate(state.values())}
        np.savez(os.path.join(out_dir, f"weights-{dist.rank}.npz"), **weights)
        saved = dist.save(model, os.path.join(out_dir, "final.pt"))
        result = {"rank": dist.rank, "size": dist.world_size, "backend": dist.backend,
                  "collective": dist.collective, "launcher": dist.environment.launcher,
                  "losses": losses, "saved": saved, "steps": steps * EPOCHS,
                  "summed": dist.sum_over_ranks([dist.rank + 1.0]),
                  "partition": _partition(model)}
        with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
            json.dump(result, f)


def _partition(model: torch.nn.Module) -> dict[str, int] | None:
    """Under DeepSpeed: the ZeRO stage, the engine's micro batch, the parameter values this rank
    sees in its model (none where stage 3 partitioned them) and those of its partition."""
    if not hasattr(model, "zero_optimization_stage"):
        return None
    parameters = list(tfdist.torch.unwrap(model).parameters())
    return {"stage": model.zero_optimization_stage(),
            "micro_batch": model.train_micro_batch_size_per_gpu(),
            "seen": sum(p.numel() for p in parameters),
            "partition": sum(p.ds_tensor.numel() for p in parameters if hasattr(p, "ds_tensor"))}


def _data() -> torch.utils.data.TensorDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


if __name__ == "__main__":
    main(*sys.argv[1:3])
