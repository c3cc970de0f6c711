"""A 2-rank torch DDP loop long enough to kill or stop one rank in the middle
(tests/test_failures.py).

Prints ``long-torch: pid PID training`` once it has run 20 steps.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import tfdist.torch


def main() -> None:
    with tfdist.torch.distributed() as dist:
        torch.manual_seed(0)
        model = dist.wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                              torch.nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.normal(size=(4096, 8)).astype("float32"))
        y = torch.from_numpy((x[:, 0] > 0).numpy().astype("int64"))
        loader = dist.loader(torch.utils.data.TensorDataset(x, y), batch_size=32)
        steps = 0
        for _ in range(200):
            for features, labels in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(features), labels).backward()
                optimizer.step()
                steps += 1
                time.sleep(0.01)
                if steps == 20:
                    print(f"long-torch: pid {os.getpid()} training", flush=True)


if __name__ == "__main__":
    main()
