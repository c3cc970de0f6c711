"""2-worker torch loop (tfdist.torch, DDP) whose input is slower than its step: the advice.

    python starved_worker.py OUT

Each sample takes 3 ms to load (no loader processes), a step on 8 samples about 1 ms to
train: the ranks wait for their input most of the step, equally. ``StepMeter.batches`` times
the waits; the chief writes ``OUT/throughput.jsonl`` and must advise once, naming no rank.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import tfdist.torch
from tfdist.throughput import StepMeter


class Slow(Dataset):
    def __len__(self) -> int:
        return 192

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.003)  # a decode that is too slow for the step
        return torch.full((8,), float(index)), index % 2


def main(out: str) -> None:
    with tfdist.torch.distributed() as dist:
        torch.manual_seed(1)
        model = dist.wrap(nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = dist.loader(Slow(), batch_size=16, seed=3)
        meter = StepMeter(dist, global_batch=16, path=os.path.join(out, "throughput.jsonl"))
        for epoch in range(3):
            for inputs, labels in meter.batches(loader):
                loss = nn.functional.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                meter.step()
            meter.epoch_end(epoch)


if __name__ == "__main__":
    main(*sys.argv[1:])
