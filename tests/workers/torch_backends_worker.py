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
        loader = dist.loader(_data(), batch_size=GLOBAL_BATCH, seed=7)
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if mode == "dist":
            model, optimizer = dist.wrap(model, optimizer)
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
        weights = {f"w{i}": p.detach().numpy() for i, p in
                   enumerate(tfdist.torch.unwrap(model).parameters())}
        np.savez(os.path.join(out_dir, f"weights-{dist.rank}.npz"), **weights)
        saved = dist.save(model, os.path.join(out_dir, "final.pt"))
        result = {"rank": dist.rank, "size": dist.world_size, "backend": dist.backend,
                  "collective": dist.collective, "launcher": dist.environment.launcher,
                  "losses": losses, "saved": saved, "steps": steps * EPOCHS,
                  "summed": dist.sum_over_ranks([dist.rank + 1.0])}
        with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
            json.dump(result, f)


def _data() -> torch.utils.data.TensorDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


if __name__ == "__main__":
    main(*sys.argv[1:3])
