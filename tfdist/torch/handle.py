"""The handle training scripts use, and the process group it runs on.

:class:`TorchDistributed` is the interface every torch backend implements (DDP:
:mod:`tfdist.torch.ddp`, Horovod, DeepSpeed); :func:`start_group` forms tfdist's process group
for the backends that run on one (its collective: ``nccl`` or ``gloo``).
:mod:`tfdist.torch.start` creates the handle (``init``) and ends it (``shutdown``). Settings,
highest precedence first: the Python argument, then the ``TFDIST_TORCH_*`` environment
variable, then what the machine implies, then the default (:mod:`tfdist.settings`). GPUs and
threads follow the same policy as TensorFlow's backends (:mod:`tfdist.devices`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn, TypeVar, overload

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

from tfdist import backend_facts as facts
from tfdist import devices, failures
from tfdist.backend_facts import Backend
from tfdist.env import ClusterEnvironment
from tfdist.errors import LaunchError
from tfdist.replicas import ReplicaMath
from tfdist.settings import resolve
from tfdist.torch import heartbeat, saves
from tfdist.torch.rendezvous import Rendezvous, plan
from tfdist.torch.sampler import EpochSampler

__all__ = ["TorchDistributed", "TorchSettings", "close_group", "count_steps", "create_group",
           "pick_device", "process_group_collective", "start_group", "unwrap"]

logger = logging.getLogger("tfdist")



class TorchDistributed(ReplicaMath):
    """What a PyTorch training script needs to know about its place in the job.

    Create it with :func:`init` or :func:`distributed`, never directly. It reads like the
    TensorFlow handle :class:`tfdist.Distributed`: one replica is one process.

    Attributes:
        environment: how the processes were launched (:class:`tfdist.env.ClusterEnvironment`).
        rendezvous: where the process group met (:class:`tfdist.torch.rendezvous.Rendezvous`).
        backend: the backend's name (``"ddp"``, ``"horovod"``, ``"deepspeed"``).
        collective: the process group's, ``"nccl"`` or ``"gloo"``.
        device: ``cuda:<local GPU>`` when CUDA is available, else ``cpu``.
    """

    backend = "?"

    def __init__(self, environment: ClusterEnvironment, rendezvous: Rendezvous, collective: str,
                 device: torch.device) -> None:
        self.environment = environment
        self.rendezvous = rendezvous
        self.collective = collective
        self.device = device
        self.loader_batch: int | None = None  # the global batch given to loader(), if any
        self._saves: saves.BackgroundSaves | None = None  # save(background=True)'s writer

    @property
    def facts(self) -> Backend:
        """This backend's row of the backend table (:mod:`tfdist.backend_facts`)."""
        return facts.backend(self.backend, facts.TORCH)

    def prepare(self) -> None:
        """Runs once the process group exists, before the handle is handed out: a backend's
        own start (DDP needs none)."""

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This process's index, 0-based; rank 0 is the chief."""
        return self.rendezvous.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        """Number of processes training together."""
        return self.rendezvous.world_size

    @property
    def local_rank(self) -> int:
        """Index among the processes on this node (selects the GPU)."""
        return self.environment.local_rank

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        """Replicas in sync: one per process under DDP."""
        return self.world_size

    @overload
    def wrap(self, model: torch.nn.Module, optimizer: None = None, **options: Any) -> Any: ...

    @overload
    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             **options: Any) -> tuple[Any, Any]: ...

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **options: Any) -> Any:
        """Moves ``model`` to :attr:`device` and hands it to the backend; with ``optimizer``,
        returns ``(model, optimizer)`` to train with, the same code for every backend::

            model, optimizer = dist.wrap(model, torch.optim.Adam(model.parameters(), lr))
            ...
            dist.backward(loss)
            optimizer.step()

        Each backend says what it does here (DDP: :meth:`tfdist.torch.ddp.DDPDistributed.wrap`).
        """
        raise NotImplementedError(f"backend {self.backend!r} does not wrap models")

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the backend needs it (DeepSpeed's engine runs its own)."""
        loss.backward()

    def sampler(self, dataset: Dataset[Any], *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> EpochSampler[Any]:
        """This rank's share of ``dataset``, reshuffled every epoch without ``set_epoch``.

        Use the same ``seed`` on every rank, so that the shares partition the data. See
        :class:`tfdist.torch.EpochSampler`.
        """
        return EpochSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                            seed=seed, drop_last=drop_last)

    def loader(self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True,
               seed: int = 0, **options: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over this rank's share, with :meth:`sampler`.

        Args:
            dataset: the whole dataset (every rank passes the same one).
            batch_size: the GLOBAL batch size, split over the replicas as in the TensorFlow
                example; see :meth:`per_replica_batch_size`.
            shuffle: reshuffle every epoch (the sampler's epoch advances by itself).
            seed: shuffling seed, the same on every rank.
            **options: more ``DataLoader`` arguments (``num_workers``, ``drop_last``, ...).

        Raises:
            ConfigError: ``batch_size`` does not divide over the replicas.
        """
        loader = DataLoader(dataset, batch_size=self.per_replica_batch_size(batch_size),
                            sampler=self.sampler(dataset, shuffle=shuffle, seed=seed), **options)
        self.loader_batch = self.loader_batch or batch_size  # the first: the training one
        return loader

    def warmup(self, optimizer: torch.optim.Optimizer, steps: int) -> LambdaLR:
        """A scheduler ramping the learning rate from ``lr / size`` to ``lr`` over ``steps``.

        Call its ``step()`` after each ``optimizer.step()``; after ``steps`` steps the rate
        stays at the optimizer's ``lr`` (as ``callbacks(warmup_epochs=...)`` does in Keras).
        """
        optimizer = getattr(optimizer, "client", optimizer)  # DeepSpeed's: the script's own
        start = 1.0 / self.world_size

        def factor(step: int) -> float:
            return start + (1.0 - start) * min(1.0, step / steps) if steps > 0 else 1.0

        return LambdaLR(optimizer, factor)

    def average(self, value: float | torch.Tensor, weight: float = 1.0) -> float:
        """The mean of a scalar metric over all ranks (a collective: every rank must call it).

        Args:
            value: this rank's metric (a number or a one-element tensor).
            weight: this rank's weight, e.g. its number of examples when the shares differ.

        Returns:
            ``sum(value * weight) / sum(weight)`` over the ranks, the same on every rank.
        """
        number = value.item() if isinstance(value, torch.Tensor) else float(value)
        total = torch.tensor([number * weight, float(weight)], dtype=torch.float64,
                             device=self.device)
        torch_dist.all_reduce(total)
        return float(total[0] / total[1])

    def sum_over_ranks(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of ``values`` over all ranks, the same on every rank (a
        collective: every rank calls it at the same point)."""
        total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        torch_dist.all_reduce(total)
        return [float(v) for v in total.tolist()]

    @property
    def wraps_with(self) -> str:
        """What :meth:`wrap` does with the model, as the start-up line says it (wrapped by the
        backend table's engine; DDP's says when one process leaves the model unwrapped)."""
        return f"model wrapped by {self.facts.engine}"

    @property
    def label(self) -> str:
        """The engine and its collective, as the doctor and the logs name them
        (``"torch deepspeed nccl"``; DDP's is ``"torch nccl"``)."""
        return f"torch {self.backend} {self.collective}"

    def probe_all_reduce(self, n: int) -> Callable[..., float]:
        """``tfdist doctor``'s all-reduce: a function that sums a float32 vector of ``n``
        copies of ``value`` over the ranks on :attr:`device` and returns the first element."""

        def reduce(value: float = 1.0) -> float:
            tensor = torch.full((n,), value, dtype=torch.float32, device=self.device)
            if self.world_size > 1:
                torch_dist.all_reduce(tensor)
            return float(tensor[0])

        return reduce

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, on every rank (a collective)."""
        if self.world_size == 1:
            return [obj]
        found: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(found, obj)
        return found

    def preemption(self, check_seconds: float | None = None, every: float | None = None) -> Any:
        """Watches for preemption signals and the walltime (:func:`tfdist.preemption.watch`;
        ``every``: seconds between safety saves, env ``TFDIST_CHECKPOINT_EVERY``)::

            state = dist.load("ckpt/state.pt")          # None on the first run
            with dist.preemption() as stop:
                for step, (x, y) in enumerate(loader):
                    ...
                    if stop.step():                      # the same answer on every rank
                        dist.save({...}, "ckpt/state.pt")
                        dist.exit_preempted()            # requeue (Slurm), exit 75
                    if stop.save_now:                    # a safety save
                        dist.save({...}, "ckpt/state.pt")
                        stop.saved()
        """
        from tfdist import preemption

        return preemption.watch(self, check_seconds, every)

    def exit_preempted(self) -> NoReturn:
        """Requeues the Slurm job from the chief, waits for every rank and exits with 75
        (:func:`tfdist.preemption.exit_preempted`): call it on every rank after saving."""
        from tfdist import preemption

        self.wait_saves()  # the final state is on the disk before the exit
        preemption.exit_preempted(self)  # distributed()'s exit then destroys the group

    def load(self, path: str | os.PathLike[str]) -> Any:
        """What :meth:`save` wrote at ``path``, on this rank's device; None if there is none
        (the first run)."""
        if not os.path.exists(path):
            return None
        return torch.load(path, map_location=self.device, weights_only=False)

    def exit_barrier(self) -> None:
        """Returns once every rank has reached it: a preempted rank then ends at once
        (:func:`tfdist.preemption.exit_preempted`)."""
        self.sum_over_ranks([0.0])

    def barrier(self) -> None:
        """Waits until every rank gets here (bounded by the process group's timeout)."""
        if self.collective == "nccl":
            torch_dist.barrier(device_ids=[self.device.index])
        else:
            torch_dist.barrier()

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict`` (unwrapped: it loads into a plain model), on every
        rank. Call it on every rank: under DeepSpeed's ZeRO stage 3 it gathers the parameters
        that stage partitions."""
        return unwrap(model).state_dict()

    def save(self, obj: Any, path: str | os.PathLike[str], *,
             background: bool | None = None) -> bool:
        """Saves ``obj`` with ``torch.save`` on the chief only, atomically.

        A model (DDP-wrapped or not) is saved as its unwrapped ``state_dict``, so it loads into
        a plain model. The file appears complete or not at all (a temporary file in the same
        directory, flushed to the disk, then a rename), and the previous one stays until then.
        Call it on every rank: other ranks return at once (under DeepSpeed's ZeRO stage 3, once
        the chief has the parameters they hold); call :meth:`barrier` before they read the file.

        ``background`` (default: ``TFDIST_BACKGROUND_SAVES``): the step waits only for a copy of
        the tensors in host memory; the file is written on a thread of its own, one save in
        flight (:mod:`tfdist.torch.saves`). :meth:`exit_preempted` and the end of
        ``distributed()`` wait for it, and a write that failed raises at the next save.

        Returns:
            Whether this process wrote the file (or started writing it).
        """
        if not self.is_chief:
            return False
        if isinstance(obj, torch.nn.Module):
            obj = unwrap(obj).state_dict()
        target = os.path.abspath(os.fspath(path))
        if background if background is not None else resolve("background_saves"):
            if self._saves is None:
                self._saves = saves.BackgroundSaves()
            self._saves.save(obj, target)
        else:
            self.wait_saves()  # an older state's write must not land after this one
            saves.write_atomically(obj, target)
        return True

    def wait_saves(self) -> None:
        """Waits for the background save in flight, if any (:meth:`save`); raises its error."""
        if self._saves is not None:
            self._saves.wait()

    def close(self, barrier: bool) -> None:
        """Tears the backend down (:func:`shutdown`): the process group, after a barrier when
        ``barrier``; a background save in flight is waited for first (its error raised after
        a normal finish, only logged after an error, which it must not hide)."""
        try:
            self.wait_saves()
        except Exception as error:
            if barrier:
                raise
            logger.error("tfdist: the background save in flight failed too: %s", error)
        finally:
            close_group(self, barrier)

    def print(self, *args: Any, sep: str | None = " ", end: str | None = "\n",
              file: Any = None, flush: bool = True) -> None:
        """``print`` on the chief only, flushed (worker output is often piped), in one write:
        Python's own writes the text and the line end apart, and unbuffered (``PYTHONUNBUFFERED``)
        another rank's line sharing the stream can land between them, joined to this one."""
        if self.is_chief:
            stream = file if file is not None else sys.stdout
            text = (" " if sep is None else sep).join(map(str, args))
            stream.write(text + ("\n" if end is None else end))
            if flush:
                stream.flush()

    def log(self, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Logs to the ``tfdist`` logger on the chief only."""
        if self.is_chief:
            logger.log(level, message, *args)

    def __repr__(self) -> str:
        return (f"TorchDistributed(backend={self.backend!r}, collective={self.collective!r}, "
                f"rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"device={str(self.device)!r}, launcher={self.environment.launcher!r})")


def count_steps(module: torch.nn.Module, _: Any) -> None:
    # Training steps done, for the line naming a failed peer: a forward in training mode starts
    # the next one (about a microsecond a step).
    if module.training:
        failures.progress["step"] = _steps[0]
        _steps[0] += 1


_steps = [0]  # forwards of wrapped models in training mode, in this process


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper or a DeepSpeed engine, or
    ``model`` itself."""
    if isinstance(model, DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        return model.module  # type: ignore[return-value]
    return model


def close_group(handle: TorchDistributed, barrier: bool) -> None:
    if not torch_dist.is_initialized():
        return
    if barrier:
        try:
            if handle.world_size > 1:
                handle.barrier()
            heartbeat.stop(leave=False)  # every rank stops its own after the barrier
            _drain_gloo_workers()
        finally:
            heartbeat.stop()
            torch_dist.destroy_process_group()
        return
    try:
        heartbeat.stop()
        _drain_gloo_workers()
        torch_dist.destroy_process_group()
    except Exception as error:  # the caller is already handling an error: keep it visible
        logger.warning("tfdist: destroying the process group failed: %s", error)


class TorchSettings(NamedTuple):
    """tfdist.torch's settings for one :func:`tfdist.torch.init`, resolved (the handle cache's
    key: a call with other settings must shut the first handle down)."""

    collective: str  # TFDIST_TORCH_COLLECTIVE: auto, nccl or gloo
    timeout_s: float  # TFDIST_TORCH_TIMEOUT
    backend: str  # TFDIST_BACKEND as requested: auto, ddp, horovod or deepspeed


_Handle = TypeVar("_Handle", bound="TorchDistributed")


def start_group(kind: type[_Handle], environment: ClusterEnvironment,
                settings: TorchSettings) -> _Handle:
    """Pins this process's device, forms the process group (rank 0's store, the rendezvous of
    :func:`tfdist.torch.rendezvous.plan`), names a failed or stopped peer from then on
    (:mod:`tfdist.failures`, the heartbeat), and returns a ``kind`` handle over it."""
    rendezvous = plan(environment)
    device = pick_device(environment)
    chosen = process_group_collective(settings.collective, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL creates its communicator on "the" device
    create_group(rendezvous, chosen, settings.timeout_s)
    # A peer that dies is named after the collective's error; one that stops, by the heartbeat.
    failures.install(environment)
    heartbeat.start(environment, rendezvous.rank, rendezvous.world_size, settings.timeout_s,
                    store_rank=0 if (rendezvous.init_method or "").startswith("tcp://") else None)
    handle = kind(environment, rendezvous, chosen, device)
    handle.log("tfdist: torch process group, %d process(es) over %s, device %s, %s; "
               "rendezvous: %s; launched by %s", handle.world_size, chosen, device,
               handle.wraps_with, rendezvous.reason, environment.reason)
    return handle


def pick_device(environment: ClusterEnvironment) -> torch.device:
    """This process's device: its GPU by tfdist's policy, else the CPU; sets torch's threads.

    Narrows ``CUDA_VISIBLE_DEVICES`` first, so it must run before CUDA starts."""
    # The same policy as TensorFlow's backends: narrow CUDA_VISIBLE_DEVICES to this task's GPUs
    # (physical ids kept) before CUDA starts; with nothing set, take the local rank's share.
    started = torch.cuda.is_initialized()  # then CUDA keeps the devices it saw at start
    chosen = devices.narrow_visible_gpus(environment)
    threads = devices.affinity_thread_count(None, environment.local_world_size, "OMP_NUM_THREADS")
    if threads is not None:
        torch.set_num_threads(threads)
    if chosen == "" or not torch.cuda.is_available():
        return torch.device("cpu")
    if chosen is not None:
        inherited = (environment.visible_devices or "").split(",")
        first = chosen.split(",")[0]
        _warn_idle(devices.count(chosen) or 0, environment)
        # Narrowed: the first of this task's GPUs is now device 0, unless CUDA had started.
        return torch.device("cuda", inherited.index(first) if started else 0)
    mine = devices.share(torch.cuda.device_count(), environment.local_rank,
                         environment.local_world_size)
    _warn_idle(len(mine), environment)
    return torch.device("cuda", mine.start)


def _warn_idle(given: int, environment: ClusterEnvironment) -> None:
    idle = devices.one_gpu_per_process("DistributedDataParallel", given)
    if idle and environment.local_rank == 0:
        logger.warning("tfdist: %s", idle)


def process_group_collective(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" and torch_dist.is_nccl_available() else "gloo"
    if requested == "nccl" and device.type != "cuda":
        logger.warning("tfdist: NCCL was requested but CUDA is not available here: using gloo")
        return "gloo"
    return requested


def create_group(rendezvous: Rendezvous, collective: str, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.init_method is None:
        torch_dist.init_process_group(collective, store=torch_dist.HashStore(), rank=0,
                                      world_size=1, timeout=timeout)
        return
    try:
        torch_dist.init_process_group(collective, init_method=rendezvous.init_method,
                                      rank=rendezvous.rank, world_size=rendezvous.world_size,
                                      timeout=timeout)
    except RuntimeError as error:  # torch's DistError and store timeouts are RuntimeErrors
        raise LaunchError(
            f"rank {rendezvous.rank} of {rendezvous.world_size} could not form the process group "
            f"at {rendezvous.init_method} ({rendezvous.reason}) within {timeout_s:g} s: "
            f"{str(error).rstrip('.')}. "
            "Check that every rank was started with the same world size and that rank 0's "
            "address is reachable from here (TFDIST_HOST_TEMPLATE, or MASTER_ADDR/MASTER_PORT)"
        ) from error


def _drain_gloo_workers(timeout_s: float = 2.0) -> None:
    """Gives gloo's worker threads the GIL until none of them is running, at most ``timeout_s``.

    A gloo worker drops each work it ran a moment after the caller's collective returned, and
    with it the thread-local state captured when the work was queued, which holds Python
    objects: dropping it takes the GIL. Once the script ends, that can happen during interpreter
    finalization, where the thread is unwound with ``pthread_exit`` and the rank aborts with
    "terminate called without an active exception" after all its work is done
    (pytorch/pytorch#190489). ``destroy_process_group()`` does not stop these threads: once
    ``torch._dynamo`` is loaded after the group exists (the first ``optimizer.step()`` or DDP
    loads it), the group outlives it. And if the group is freed while a worker still waits for
    the GIL (a DDP reducer dropping the last reference), the join in its destructor deadlocks.

    So before the group goes: sleep in short steps (which releases the GIL, letting a waiting
    worker finish) until no ``pt_gloo_runloop`` thread is runnable three polls in a row.
    Without ``/proc`` (not Linux) it sleeps three steps. NCCL has no such workers.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = quiet + 1 if not _runnable_threads("pt_gloo_runloop") else 0


def _runnable_threads(name: str) -> int:
    """How many of this process's threads called ``name`` are running or runnable now."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:  # the thread has ended
            continue
        # "tid (comm) state ...": comm may hold spaces and parentheses; state follows the last ")"
        comm, state = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:][:1]
        count += comm == name and state == "R"
    return count
