"""DeepSpeed behind the torch handle: ``backend="deepspeed"`` (``TFDIST_BACKEND=deepspeed``).

The process group is tfdist's, as for DDP (the same rendezvous, heartbeat and teardown);
``dist.wrap(model, optimizer)`` hands both to ``deepspeed.initialize`` and returns the engine
and an optimizer whose ``step()`` is the engine's, so one training loop serves every backend::

    model, optimizer = dist.wrap(model, torch.optim.Adam(model.parameters(), lr))
    loss = ...
    dist.backward(loss)          # the engine's backward
    optimizer.step()             # the engine's step (and its zero_grad)

The config is :data:`DEFAULT_CONFIG` (ZeRO stage 2, fp32, the client's optimizer as it is),
then ``TFDIST_DEEPSPEED_CONFIG`` (a JSON file or inline JSON), then ``wrap(config=)``, each
merged into the last key by key. ``train_micro_batch_size_per_gpu`` follows the batch
:meth:`~tfdist.torch.TorchDistributed.loader` was given, when it was.

On CPU DeepSpeed runs over the process group's gloo: its CPU accelerator needs neither IPEX
nor oneCCL. tfdist sets ``DS_ACCELERATOR=cpu`` there, and marks the shared-memory op that
DeepSpeed would compile with g++ on first use (48-100 s, for ``inference_all_reduce`` only)
as unavailable; ``LOCAL_RANK``, which DeepSpeed requires, comes from the detected launch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tfdist.env import ClusterEnvironment
from tfdist.errors import ConfigError
from tfdist.settings import resolve
from tfdist.torch.handle import (
    TorchDistributed,
    TorchSettings,
    count_steps,
    start_group,
    unwrap,
)

__all__ = ["DEFAULT_CONFIG", "DeepSpeedDistributed", "EngineOptimizer", "create",
           "merge_config"]

logger = logging.getLogger("tfdist")

# What tfdist gives deepspeed.initialize unless told otherwise. The client's optimizer is used
# as it is: ZeRO refuses optimizers off its tested list without `zero_allow_untested_optimizer`,
# and DeepSpeed 0.19 clips gradients to norm 1.0 by default, which a torch optimizer does not.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
    "steps_per_print": 2**31 - 1,
}


def merge_config(base: Mapping[str, Any], *overrides: Mapping[str, Any] | None
                 ) -> dict[str, Any]:
    """``base`` with each override merged in turn, nested mappings key by key (pure)."""
    merged = copy.deepcopy(dict(base))
    for override in overrides:
        for key, value in (override or {}).items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
                merged[key] = merge_config(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
    return merged


def config_from_setting(text: str | None) -> dict[str, Any]:
    """``TFDIST_DEEPSPEED_CONFIG``: inline JSON (``{...}``) or the path of a JSON file.

    Raises:
        ConfigError: the file is missing, or either is not a JSON object.
    """
    if not text:
        return {}
    source = "TFDIST_DEEPSPEED_CONFIG"
    if not text.lstrip().startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(f"{source}={text!r}: no such file; give the path of a DeepSpeed "
                              "JSON config, or the JSON itself")
        source, text = f"{source} file {path}", path.read_text()
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{source} must be a JSON object of DeepSpeed config keys")
    return config


class EngineOptimizer:
    """The optimizer ``wrap`` returns under DeepSpeed: ``step()`` runs the engine's step, which
    also zeroes the gradients; ``client`` is the optimizer the script made (``warmup`` ramps
    its learning rate, which the engine reads)."""

    def __init__(self, engine: Any, client: torch.optim.Optimizer) -> None:
        self.engine = engine
        self.client = client

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ConfigError("DeepSpeed's engine takes no closure in step()")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.client.param_groups

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.client).__name__}, DeepSpeed engine)"


def create(environment: ClusterEnvironment, settings: TorchSettings) -> DeepSpeedDistributed:
    """The DeepSpeed backend's handle: tfdist's process group, DeepSpeed's engine in ``wrap``."""
    return start_group(DeepSpeedDistributed, environment, settings)


class DeepSpeedDistributed(TorchDistributed):
    """The torch handle with DeepSpeed's engine; the process group is tfdist's."""

    backend = "deepspeed"
    batch_from_loader = True  # whether dist.loader sets the micro batch (the config names none)

    def prepare(self) -> None:
        """Before ``import deepspeed``: its accelerator, ``LOCAL_RANK``, its logger; after: no
        op compiled for inference that training never runs (see the module docstring)."""
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        import deepspeed
        import deepspeed.ops

        if self.device.type == "cpu":
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if not resolve("verbose"):  # DeepSpeed's INFO lines, every rank's, unless asked
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            # DeepSpeed's call, not the script's: torch 2.13 deprecates the function it uses.
            warnings.filterwarnings("ignore", category=FutureWarning,
                                    message=r"`torch\.distributed\.all_gather_into_tensor`")
        self.version = deepspeed.__version__

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             **options: Any) -> Any:
        """``deepspeed.initialize`` on ``model`` and ``optimizer``; returns the engine and an
        :class:`EngineOptimizer`. ``config=`` (a dict) is merged over the defaults and
        ``TFDIST_DEEPSPEED_CONFIG``; other options go to ``deepspeed.initialize``.

        Raises:
            ConfigError: no optimizer (the engine owns the step).
        """
        if optimizer is None:
            raise ConfigError("backend deepspeed: DeepSpeed's engine runs the optimizer step, so "
                              "give it the optimizer: `model, optimizer = dist.wrap(model, "
                              "optimizer)`")
        import deepspeed

        given = options.pop("config", None)
        config = self.config(given)
        engine, _, _, _ = deepspeed.initialize(model=model.to(self.device), optimizer=optimizer,
                                               config=config, **options)
        engine.register_forward_pre_hook(count_steps)
        self.engine = engine
        # A loader made after wrap still sets the micro batch, unless the config names one.
        self.batch_from_loader = "train_micro_batch_size_per_gpu" not in merge_config(
            config_from_setting(resolve("deepspeed_config")), given)
        micro = ("from dist.loader" if self.batch_from_loader and not self.loader_batch else
                 f"{config['train_micro_batch_size_per_gpu']}")
        self.log("tfdist: DeepSpeed %s engine, ZeRO stage %s, micro batch %s per replica",
                 self.version, config.get("zero_optimization", {}).get("stage", 0), micro)
        return engine, EngineOptimizer(engine, optimizer)

    def config(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The config ``wrap`` gives DeepSpeed (see the module docstring)."""
        batch = {"train_micro_batch_size_per_gpu": self.per_replica_batch_size(
            self.loader_batch)} if self.loader_batch else {}
        return merge_config(DEFAULT_CONFIG, batch,
                            config_from_setting(resolve("deepspeed_config")), given)

    def loader(self, dataset: Any, batch_size: int, **options: Any) -> Any:
        """As :meth:`TorchDistributed.loader`; the first loader made after :meth:`wrap` sets
        the engine's micro batch, as one made before sets the config's, unless the config
        names it."""
        first = not self.loader_batch
        loader = super().loader(dataset, batch_size, **options)
        engine = getattr(self, "engine", None)
        if first and engine is not None and self.batch_from_loader:
            engine.set_train_micro_batch_size(self.per_replica_batch_size(batch_size))
        return loader

    def backward(self, loss: torch.Tensor) -> None:
        """The engine's backward (it scales the loss and reduces the gradients)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            raise ConfigError("backend deepspeed: call `model, optimizer = dist.wrap(model, "
                              "optimizer)` before dist.backward(loss)")
        engine.backward(loss)

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """As :meth:`TorchDistributed.state_dict`; under ZeRO stage 3 every rank gathers the
        whole model for the copy (every rank must call it), and holds only its partition
        again afterwards."""
        if not self._partitioned(model):
            return super().state_dict(model)
        import deepspeed

        module = unwrap(model)
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {name: tensor.detach().clone() for name, tensor in
                    module.state_dict().items()}

    def save(self, obj: Any, path: str | os.PathLike[str], *,
             background: bool | None = None) -> bool:
        """As :meth:`TorchDistributed.save`; the engine is saved as its model's state_dict.
        Under ZeRO stage 3, where each rank holds a partition of the parameters, every rank
        must call it: DeepSpeed gathers the model on the chief one layer at a time, and the
        chief writes it as from any other stage (a plain model's state_dict).

        Raises:
            ConfigError: a DeepSpeed without the consolidating call (stage 3 only).
        """
        if not self._partitioned(obj):
            return super().save(obj, path, background=background)
        gather = getattr(obj, "_zero3_consolidated_16bit_state_dict", None)
        if gather is None:
            raise ConfigError(f"DeepSpeed {self.version} cannot gather a ZeRO stage 3 model on "
                              "one rank: save with `model.save_checkpoint(DIR)` on every rank")
        state = gather()  # the parameters as they train (fp32 here): on the chief, else None
        return super().save(state, path, background=background) if self.is_chief else False

    def _partitioned(self, obj: Any) -> bool:
        """Whether ``obj`` is this handle's engine under ZeRO stage 3."""
        engine = getattr(self, "engine", None)
        return obj is engine and engine is not None and engine.zero_optimization_stage() >= 3
