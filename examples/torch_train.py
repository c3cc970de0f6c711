"""Train a small CNN on handwritten digits with PyTorch, on one process or many, unchanged.

    python examples/torch_train.py --epochs=8                              # one process
    tfdist launch -n 2 examples/torch_train.py --epochs=8 --scale_lr       # 2 local workers
    torchrun --standalone --nproc-per-node=2 examples/torch_train.py       # torchrun
    srun python examples/torch_train.py --model_dir=$SCRATCH/run1          # one Slurm task per GPU
    tfdist job --backend torch --nodes 2 --submit examples/torch_train.py  # torchrun per node
    tfdist launch --backend horovod -n 2 examples/torch_train.py           # Horovod (or horovodrun)
    torchrun --nproc-per-node=2 examples/torch_train.py --backend=deepspeed  # DeepSpeed's engine

The twin of examples/keras_train.py: the same data (the 8x8 digits that ship with tfdist, the same
train/test split, nothing downloaded), the same model and the same flags, with two differences. The
backend is DDP, Horovod or DeepSpeed (``--backend``; one training loop for all three), and
``--collective`` picks the process group's (``auto``: NCCL with CUDA, gloo on CPU), not MWMS's
all-reduce. ``--data_dir`` is accepted, so one command line serves both, but unused: the arrays are
read into memory from the file tfdist ships. Each change for distributed training is marked
`tfdist:`.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
from absl import app, flags
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

import tfdist.datasets
import tfdist.torch

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 10, "Passes over the training data.")
flags.DEFINE_integer("batch_size", 64, "GLOBAL batch size, split over all replicas.")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate for one replica.")
flags.DEFINE_bool("scale_lr", False, "Multiply the learning rate by the number of replicas.")
flags.DEFINE_float("warmup_epochs", 0, "Ramp the scaled learning rate up over these epochs.")
flags.DEFINE_string("model_dir", None, "The chief saves final.pt (a state_dict) here.")
flags.DEFINE_string("data_dir", None, "Unused (accepted so keras_train.py's flags work).")
flags.DEFINE_enum("dataset", "digits", tfdist.datasets.available(), "Dataset to train on.")
flags.DEFINE_enum("backend", "auto", ["auto", "ddp", "horovod", "deepspeed"],
                  "DDP, Horovod (horovod.torch) or DeepSpeed (its engine, ZeRO stage 2); auto: "
                  "Horovod under horovodrun, else DDP.")
flags.DEFINE_enum("collective", "auto", ["auto", "nccl", "gloo"],
                  "The process group's collective (DDP's and DeepSpeed's all-reduce).")
flags.DEFINE_integer("seed", 0, "Random seed for weights and shuffling.")


def build_model() -> nn.Module:
    """The Keras example's CNN: two 3x3 convolutions, max pooling, dropout, two dense layers."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(64 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def digest(state: dict[str, torch.Tensor]) -> str:
    """A short hex digest of a state_dict: equal on two ranks, bit-identical weights."""
    blake = hashlib.blake2b(digest_size=8)
    for name, tensor in state.items():
        data = tensor.detach().cpu().contiguous()
        blake.update(f"{name} {data.dtype} {tuple(data.shape)}\n".encode())
        blake.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype's bytes
    return blake.hexdigest()


def given(name: str) -> str | None:
    """A flag's value if the user set it, so TFDIST_TORCH_* variables still apply otherwise."""
    return FLAGS[name].value if FLAGS[name].present else None


def dataset(split: str) -> TensorDataset:
    """A split as float32 images in [0, 1], channels first, and int64 labels."""
    images, labels = tfdist.datasets.arrays(FLAGS.dataset, split)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return TensorDataset(x, torch.from_numpy(labels))


def train_epoch(dist: tfdist.torch.TorchDistributed, model: nn.Module, loader: DataLoader,
                optimizer: torch.optim.Optimizer, warmup: LambdaLR | None) -> tuple[float, float]:
    """One pass over this rank's share; returns the loss and accuracy averaged over all ranks."""
    model.train()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:  # tfdist: the sampler moves to the next epoch by itself
        x, y = x.to(dist.device), y.to(dist.device)
        optimizer.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        dist.backward(loss)  # tfdist: the gradients are averaged over all replicas
        optimizer.step()
        if warmup is not None:
            warmup.step()
        loss_sum += loss.item() * len(y)
        correct += int((logits.argmax(dim=1) == y).sum())
        seen += len(y)
    # tfdist: metrics averaged over all ranks, weighted by their examples.
    return dist.average(loss_sum / seen, seen), dist.average(correct / seen, seen)


def evaluate(dist: tfdist.torch.TorchDistributed, model: nn.Module, loader: DataLoader
             ) -> tuple[float, float, int]:
    """Loss and accuracy over all ranks' shares of the test set, and its size."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(dist.device), y.to(dist.device)
            logits = model(x)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == y).sum())
            seen += len(y)
    total = round(dist.average(seen) * dist.world_size)
    return dist.average(loss_sum / seen, seen), dist.average(correct / seen, seen), total


def main(argv: list[str]) -> None:
    del argv
    train()


def train() -> None:
    torch.manual_seed(FLAGS.seed)
    # tfdist: the process group first: torchrun, srun, tfdist launch or one process.
    with tfdist.torch.distributed(given("collective"), backend=given("backend")) as dist:
        # tfdist: linear scaling by the number of replicas, when asked.
        lr = dist.scale_lr(FLAGS.learning_rate) if FLAGS.scale_lr else FLAGS.learning_rate
        model = build_model()
        # tfdist: the backend takes the model and its optimizer (DDP, Horovod's optimizer,
        # DeepSpeed's engine): one training loop for all of them.
        model, optimizer = dist.wrap(model, torch.optim.Adam(model.parameters(), lr=lr))
        # tfdist: the GLOBAL batch size; each rank loads its share of the data.
        train = dist.loader(dataset("train"), FLAGS.batch_size, seed=FLAGS.seed)
        test = dist.loader(dataset("test"), FLAGS.batch_size, shuffle=False)
        warmup = None
        if FLAGS.warmup_epochs:  # tfdist: ramp up from lr / size, as the Keras callback does
            warmup = dist.warmup(optimizer, round(FLAGS.warmup_epochs * len(train)))
        dist.print(f"tfdist: {dist.world_size} worker(s), {dist.num_replicas} replica(s), "
                   f"backend {dist.backend}, collective {dist.collective}, device {dist.device}, "
                   f"learning rate {lr:g}")
        for epoch in range(FLAGS.epochs):
            start = time.perf_counter()
            loss, accuracy = train_epoch(dist, model, train, optimizer, warmup)
            seconds = time.perf_counter() - start
            # tfdist: only the chief prints.
            dist.print(f"Epoch {epoch + 1}/{FLAGS.epochs}")
            dist.print(f"{len(train)}/{len(train)} - {seconds:.0f}s - "
                       f"{seconds / len(train) * 1000:.0f}ms/step - accuracy: {accuracy:.4f} - "
                       f"loss: {loss:.4f}")
        loss, accuracy, images = evaluate(dist, model, test)
        # tfdist: every rank prints a digest of its weights: equal digests, identical weights.
        # One write with its newline, so ranks sharing an output file don't interleave lines.
        # dist.state_dict: the whole model on every rank (ZeRO stage 3 partitions it).
        print(f"tfdist: rank {dist.rank} of {dist.world_size}: final weights "
              f"{digest(dist.state_dict(model))}\n", end="", flush=True)
        dist.print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}  ({images} images)")
        if FLAGS.model_dir:  # tfdist: the chief writes the final model, atomically
            dist.save(model, os.path.join(FLAGS.model_dir, "final.pt"))


if __name__ == "__main__":
    app.run(main)
