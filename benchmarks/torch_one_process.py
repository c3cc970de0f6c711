"""Does a one-process tfdist.torch run train as fast as a plain PyTorch loop?

    python benchmarks/torch_one_process.py [--rounds 5] [--warmup 20] [--steps 100]
    python benchmarks/torch_one_process.py --device cpu --image-size 32 --batch 4 --width 8 \\
        --warmup 1 --steps 2 --rounds 2          # a smoke test on any machine

ResNet-50 (written out below, torchvision's layout, so torchvision need not be installed) on one
synthetic batch of 224x224 images, batch 128, bf16 autocast, channels_last, SGD with momentum;
each variant in its own process, ``--warmup`` steps then ``--steps`` timed ones:

- ``plain``: the model on the GPU and a plain loop, the baseline;
- ``tfdist``: the same loop through ``tfdist.torch.distributed()`` in one plain process:
  ``model, optimizer = dist.wrap(model, optimizer)`` and ``dist.backward(loss)``;
- ``ddp``: hand-written ``DistributedDataParallel`` over a one-process group (nccl on a GPU,
  gloo on the CPU), what tfdist.torch did in one process before it stopped wrapping there.

The variants take turns, in a rotated order each round, so that the machine's drift hits them
alike. Prints each round's img/s and each variant's ratio to ``plain`` in the same round, then
per variant the median over the rounds with min..max. Target: ``tfdist`` at least 0.99 of
``plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import ROOT

VARIANTS = ("plain", "tfdist", "ddp")


def resnet50(width: int = 64, classes: int = 1000) -> Any:
    """ResNet-50 v1.5 (the stride in each stage's first 3x3 conv) with base width ``width``."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inputs: int, planes: int, stride: int) -> None:
            super().__init__()
            out = planes * 4
            self.body = nn.Sequential(
                nn.Conv2d(inputs, planes, 1, bias=False), nn.BatchNorm2d(planes),
                nn.ReLU(inplace=True),
                nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes),
                nn.ReLU(inplace=True),
                nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out))
            self.shortcut = (nn.Identity() if stride == 1 and inputs == out else nn.Sequential(
                nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out)))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.shortcut(x))

    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    inputs = width
    for stage, blocks in enumerate((3, 4, 6, 3)):
        planes = width * 2 ** stage
        for block in range(blocks):
            layers.append(Bottleneck(inputs, planes, 2 if block == 0 and stage > 0 else 1))
            inputs = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def worker(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Trains ``variant`` and returns its img/s over the timed steps."""
    import torch
    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model = resnet50(args.width).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    dist = None
    backward = torch.Tensor.backward
    if variant == "tfdist":
        import tfdist.torch

        dist = tfdist.torch.init()
        model, optimizer = dist.wrap(model, optimizer)
        device, backward = dist.device, dist.backward
    else:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = model.to(device)
        if variant == "ddp":
            torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                          store=torch_dist.HashStore(), rank=0, world_size=1)
            model = DistributedDataParallel(
                model, device_ids=[device.index or 0] if device.type == "cuda" else None)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator)
    x = x.to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), generator=generator).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> Any:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        backward(loss)
        optimizer.step()
        return loss

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    result = {"variant": variant, "images_per_s": args.batch * args.steps / seconds,
              "loss": float(loss), "device": str(device), "model": type(model).__name__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "",
              "torch": torch.__version__}
    if dist is not None:
        tfdist.torch.shutdown()
    elif torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    return result


def run(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One process of ``variant``; its result."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("device", "image_size", "batch", "width", "warmup", "steps")]
    done = subprocess.run([sys.executable, __file__, "--worker", variant, *flags], cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _spread(values: list[float], fmt: str) -> str:
    return (f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}.."
            f"{format(max(values), fmt)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per process")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per process")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--width", type=int, default=64, help="ResNet-50's base width")
    parser.add_argument("--device", default="cuda:0", help="cuda:0 or cpu (plain and ddp; "
                        "tfdist picks its own: the GPU where CUDA is available)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="also write every round's results to this file")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return
    variants = args.variants.split(",")
    if "cpu" in args.device:  # tfdist follows CUDA_VISIBLE_DEVICES, as plain follows --device
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    print(f"ResNet-50 (base width {args.width}), synthetic {args.image_size}x{args.image_size} "
          f"images, batch {args.batch}, bf16 autocast, channels_last, SGD with momentum; per "
          f"process {args.warmup} warm-up and {args.steps} timed steps; {args.rounds} rounds, "
          "the variants in turn", flush=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        shift = number % len(variants)
        found = {name: run(name, args) for name in variants[shift:] + variants[:shift]}
        rounds.append(found)
        if number == 0:
            first = next(iter(found.values()))
            print(f"on {first['gpu'] or first['device']}, torch {first['torch']}; "
                  + ", ".join(f"{name} trains a {found[name]['model']} on {found[name]['device']}"
                              for name in variants), flush=True)
        base = found[variants[0]]["images_per_s"]
        print(f"round {number + 1}: " + " | ".join(
            f"{name} {found[name]['images_per_s']:.0f} img/s "
            f"({found[name]['images_per_s'] / base:.3f})" for name in variants), flush=True)
    print(f"median (min..max) over {args.rounds} rounds; ratio to {variants[0]} in the same "
          "round:")
    for name in variants:
        speeds = [found[name]["images_per_s"] for found in rounds]
        ratios = [found[name]["images_per_s"] / found[variants[0]]["images_per_s"]
                  for found in rounds]
        print(f"  {name:>6}: {_spread(speeds, '.0f')} img/s, ratio {_spread(ratios, '.3f')}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "rounds": rounds}, file, indent=1)


if __name__ == "__main__":
    main()
