"""What does the torch shim's ``dist.save`` of a big state cost training? Synchronous against
background writes.

    .venv/bin/python benchmarks/torch_saves.py [--rounds 3] [--mb 1100] [--steps 30] [--every 5]

A DDP model of wide Linear layers whose weights plus Adam's two slots come to about ``--mb`` MB
trains ``--steps`` steps on 2 workers (gloo on this machine's processors) under
`tfdist launch`, saving ``{"model": ..., "optimizer": ...}`` with ``dist.save`` every
``--every`` steps, in three variants alternating each round (the machine's noise hits all
alike): ``none`` (no saves: the baseline), ``sync`` (``dist.save(..., background=False)``: the
chief writes, fsyncs and renames while every rank waits at the next step's all-reduce) and
``background`` (``background=True``: the chief copies the tensors into host memory and its
writer thread writes the file).

Per run, the chief's time inside each ``dist.save`` (what the step waits for) and the run's
wall time. Prints each round, then the medians with their spread: the time blocked per save
both ways (each run's first save apart: a background one allocates the host copy there) and
their ratio background/sync (the target: under 0.05), the run's extra time per save over
``none``'s in the same round, and a synchronous save's bandwidth against the disk's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import disk_mb_per_s, spread

_spread = functools.partial(spread, fmt=".3f")  # median (min..max), in seconds

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("none", "sync", "background")
WIDTH = 2048  # each layer WIDTH x WIDTH: 4.2 M weights, 50 MB with Adam's two slots


def worker(out: str, variant: str, layers: int, steps: int, every: int) -> None:
    """One rank's loop: ``steps`` steps, a save every ``every``; the chief writes its times."""
    import torch
    from torch import nn

    import tfdist.torch

    with tfdist.torch.distributed() as dist, tempfile.TemporaryDirectory(
            prefix="tfdist-torch-saves-", dir=ROOT) as folder:
        torch.manual_seed(0)
        model = dist.wrap(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
        x = torch.randn(8, WIDTH)
        blocked, started = [], 0.0
        for step in range(steps):
            if step == 1:
                started = time.monotonic()  # after the first step (its set-up)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if variant != "none" and (step + 1) % every == 0:
                began = time.monotonic()
                dist.save({"model": tfdist.torch.unwrap(model).state_dict(),
                           "optimizer": optimizer.state_dict()},
                          os.path.join(folder, "state.pt"), background=variant == "background")
                blocked.append(time.monotonic() - began)
        dist.wait_saves()
        seconds = time.monotonic() - started
        if dist.is_chief:
            size = os.path.getsize(os.path.join(folder, "state.pt")) if blocked else 0
            Path(out).write_text(json.dumps({"seconds": seconds, "blocked": blocked,
                                             "bytes": size}))


def run_once(variant: str, layers: int, steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tfdist-torch-saves-", dir=ROOT) as folder:
        out = os.path.join(folder, "result.json")
        env = {**os.environ}
        env.pop("TFDIST_BACKGROUND_SAVES", None)
        done = subprocess.run(
            [sys.executable, "-m", "tfdist", "launch", "-n", "2", __file__, "--worker", out,
             variant, str(layers), str(steps), str(every)],
            cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"the {variant} run failed:\n{done.stdout[-3000:]}"
                             f"{done.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=1100, help="weights + Adam's state, in MB")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="steps between two saves")
    args = parser.parse_args()
    layers = max(1, round(args.mb * 1e6 / (WIDTH * WIDTH * 4 * 3)))
    blocked: dict[str, list[float]] = {"sync": [], "background": []}
    first: dict[str, list[float]] = {"sync": [], "background": []}  # each run's first save
    stalls: dict[str, list[float]] = {"sync": [], "background": []}
    size = 0
    for round_ in range(1, args.rounds + 1):
        seconds: dict[str, float] = {}
        for variant in VARIANTS:
            found = run_once(variant, layers, args.steps, args.every)
            seconds[variant] = found["seconds"]
            if variant != "none":
                first[variant].append(found["blocked"][0])
                blocked[variant] += found["blocked"][1:]
                stalls[variant].append((found["seconds"] - seconds["none"])
                                       / len(found["blocked"]))
                size = found["bytes"]
            print(f"round {round_} {variant:10} {found['seconds']:7.2f} s for "
                  f"{args.steps - 1} steps, {len(found['blocked'])} saves, blocked "
                  f"{' '.join(f'{b:.3f}' for b in found['blocked'])} s", flush=True)
    print(f"state: {size / 1e6:.0f} MB (weights and Adam's slots, {layers} layers of {WIDTH}x"
          f"{WIDTH}), 2 workers (gloo), a save every {args.every} steps")
    for variant, values in blocked.items():
        print(f"training blocked per save {variant:10} {_spread(values)} s (the chief's "
              "dist.save: the write, or the copy to host memory; each run's first apart)")
    for variant, values in first.items():
        print(f"the first save of a run  {variant:10} {_spread(values)} s (background: the host "
              "copy's fresh memory, once a run)")
    print(f"blocked ratio background/sync: "
          f"{statistics.median(blocked['background']) / statistics.median(blocked['sync']):.3f}"
          " (target: under 0.05)")
    for variant, values in stalls.items():
        print(f"stall per save {variant:10} {_spread(values)} s (the run's time over none's)")
    ratios = [b / s for b, s in zip(stalls["background"], stalls["sync"], strict=True) if s > 0]
    if ratios:
        print(f"stall ratio background/sync: {_spread(ratios)}")
    took = statistics.median(blocked["sync"])
    print(f"a synchronous save: {took:.2f} s for {size / 1e6:.0f} MB ({size / 1e6 / took:.0f} "
          f"MB/s); the disk alone: {disk_mb_per_s(size):.0f} MB/s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
