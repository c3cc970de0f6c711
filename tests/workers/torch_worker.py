"""One rank of the PyTorch multi-process tests: trains a small model and saves its weights.

    python torch_worker.py OUT_DIR {dist,control,crash,stall}

``dist`` trains through DDP, each rank starting from DIFFERENT random weights (seed 100 + rank):
DDP must broadcast rank 0's and then average every gradient. ``control`` runs the same steps on
the same shards from the SAME initial weights, but without DDP: only the missing averaging can
make the ranks' weights differ, so it shows that the ``dist`` test would catch its absence.
``crash`` and ``stall`` make rank 1 fail (raise) or hang (sleep) after two steps, while rank 0
goes on training: rank 0 must end with an error instead of waiting forever.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

import tfdist.torch

EPOCHS, GLOBAL_BATCH = 3, 32


def main(out_dir: str, mode: str) -> None:
    with tfdist.torch.distributed() as dist:
        torch.manual_seed(100 + dist.rank if mode == "dist" else 100)
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        if mode != "control":
            model = dist.wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = dist.loader(_data(), batch_size=GLOBAL_BATCH, seed=7)
        losses, first_batches = [], []
        for _ in range(EPOCHS):
            total, steps = 0.0, 0
            for x, y in loader:
                if steps == 0:  # the sampler must reshuffle every epoch by itself
                    first_batches.append(y[:8].tolist())
                _fail_on_rank_1(dist, mode, steps)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
            losses.append(dist.average(total / steps))
        weights = {f"w{i}": p.detach().numpy() for i, p in
                   enumerate(tfdist.torch.unwrap(model).parameters())}
        np.savez(os.path.join(out_dir, f"weights-{dist.rank}.npz"), **weights)
        result = {"rank": dist.rank, "size": dist.world_size, "local_rank": dist.local_rank,
                  "launcher": dist.environment.launcher, "backend": dist.backend,
                  "collective": dist.collective, "wrapped": type(model).__name__,
                  "device": str(dist.device), "init_method": dist.rendezvous.init_method,
                  "losses": losses, "first_batches": first_batches,
                  "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                  "affinity": len(os.sched_getaffinity(0))}
        with open(os.path.join(out_dir, f"result-{dist.rank}.json"), "w") as f:
            json.dump(result, f)


def _fail_on_rank_1(dist: tfdist.torch.TorchDistributed, mode: str, step: int) -> None:
    if dist.rank != 1 or step != 2:
        return
    if mode == "crash":
        raise ValueError("deliberate failure on rank 1")
    if mode == "stall":
        print("rank 1 stalls", flush=True)
        time.sleep(float(os.environ.get("STALL_S", "60")))


def _data() -> torch.utils.data.TensorDataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


if __name__ == "__main__":
    main(*sys.argv[1:3])
