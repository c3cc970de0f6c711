"""2-worker DDP loop with tfdist.torch's preemption API: agree, save, exit 75, resume.

    python torch_preempt_worker.py OUT_DIR CHECKPOINT SIGNAL_RANK SIGNAL_STEP

``SIGNAL_RANK`` (-1: none) sends itself SIGUSR1 after its ``SIGNAL_STEP``-th step of the first
run (``TFDIST_RESTART_COUNT`` 0); ``PREEMPT_TEST_STEP_SLEEP=S`` makes each step S seconds longer
(for the walltime guard, which stops the run without a signal). With ``TFDIST_CHECKPOINT_EVERY``
it also saves at each agreed safety save. ``PREEMPT_TEST_IN_WRITE=SIGNAL:N:SECONDS`` (with
``TFDIST_BACKGROUND_SAVES=1``): in the first run, rank 0 (the one that writes) sends itself
SIGNAL (``USR1``, ``KILL``) inside its N-th save's write, on the writer thread, once the file is
written and before it is flushed and renamed, then goes on SECONDS later (a slow disk's
stand-in); it prints ``tfdist-test: SIGNAL in background save N on thread NAME``. Writes
``result-RANK-RUN.json``: the steps this run trained, where it resumed from and where it
stopped, and after the last epoch a digest of the weights and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tfdist.torch

EPOCHS = 3


def main(out_dir: str, checkpoint: str, signal_rank: str, signal_step: str) -> None:
    run = int(os.environ.get("TFDIST_RESTART_COUNT", "0"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = (x[:, 0] > 0).long()
    with tfdist.torch.distributed() as dist:
        torch.manual_seed(1)
        model = dist.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = dist.loader(TensorDataset(x, y), batch_size=32, seed=3)
        first_epoch, skip = 0, 0
        state = dist.load(checkpoint)  # tfdist: None on the first run
        if state is not None:
            tfdist.torch.unwrap(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first_epoch, skip = state["epoch"], state["step"]
        result = {"rank": dist.rank, "run": run, "steps": 0, "resumed": state is not None,
                  "from": [first_epoch, skip]}
        if dist.rank == 0 and run == 0 and os.environ.get("PREEMPT_TEST_IN_WRITE"):
            _hold_a_write(*os.environ["PREEMPT_TEST_IN_WRITE"].split(":"))
        sleep = float(os.environ.get("PREEMPT_TEST_STEP_SLEEP", "0"))
        target = int(signal_step) if int(signal_rank) == dist.rank and run == 0 else None
        with dist.preemption(check_seconds=0.02) as stop:  # tfdist: agree on a step
            for epoch in range(first_epoch, EPOCHS):
                loader.sampler.set_epoch(epoch)
                for step, (inputs, labels) in enumerate(loader):
                    if epoch == first_epoch and step < skip:
                        continue  # trained before the preemption
                    loss = nn.functional.cross_entropy(model(inputs), labels)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    result["steps"] += 1
                    time.sleep(sleep)
                    if result["steps"] == target:
                        os.kill(os.getpid(), signal.SIGUSR1)
                    if stop.step():
                        dist.save({"model": tfdist.torch.unwrap(model).state_dict(),
                                   "optimizer": optimizer.state_dict(),
                                   "epoch": epoch, "step": step + 1}, checkpoint)
                        result.update(epoch=epoch, step=step + 1, code=75)
                        _write(out_dir, result)
                        dist.exit_preempted()  # tfdist: requeue (Slurm), exit 75
                    if stop.save_now:  # tfdist: a safety save (TFDIST_CHECKPOINT_EVERY)
                        dist.save({"model": tfdist.torch.unwrap(model).state_dict(),
                                   "optimizer": optimizer.state_dict(),
                                   "epoch": epoch, "step": step + 1}, checkpoint)
                        stop.saved()
        result.update(epoch=EPOCHS - 1, code=0, digest=_digest(model, optimizer))
        _write(out_dir, result)


def _hold_a_write(name: str, number: str, seconds: str) -> None:
    """Sends this process ``SIG<name>`` inside its ``number``-th save's write (see above)."""
    from tfdist.torch import saves

    durable, writes = saves._durable, []

    def held(file: object) -> None:
        writes.append(file)
        if len(writes) == int(number):
            print(f"tfdist-test: {name} in background save {number} on thread "
                  f"{threading.current_thread().name}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
            time.sleep(float(seconds))
        durable(file)

    saves._durable = held


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    hasher = hashlib.blake2b(digest_size=8)
    for tensor in [*tfdist.torch.unwrap(model).state_dict().values(),
                   *(s["momentum_buffer"] for s in optimizer.state.values())]:
        hasher.update(tensor.detach().cpu().numpy().tobytes())
    return hasher.hexdigest()


def _write(out_dir: str, result: dict) -> None:
    with open(os.path.join(out_dir, f"result-{result['rank']}-{result['run']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
