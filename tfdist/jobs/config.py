"""What a job is: one frozen dataclass whose fields are the YAML keys of ``tfdist job``.

A config comes from three levels, highest first: command-line flags, the YAML file, the
defaults (:mod:`tfdist.jobs.fields`). :func:`merge` applies the order (lists given on the command
line replace the file's; ``env`` is merged name by name), :meth:`JobConfig.from_mapping` checks
keys and types, and the dataclass checks every combination when it is built
(:mod:`tfdist.jobs.checks`).

YAML is read with YAML 1.2's plain types: ``01:30:00`` stays a string instead of becoming the
sexagesimal number 5400, and ``on``/``no`` stay strings instead of booleans.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfdist.durations import as_sbatch_time, has_unit, parse_duration
from tfdist.errors import ConfigError
from tfdist.jobs.checks import validate
from tfdist.jobs.choices import (
    BACKEND_LAUNCHERS,
    BACKENDS,
    KINDS,
    LAUNCHERS,
    RUNTIME_LAUNCHERS,
    RUNTIMES,
)
from tfdist.jobs.fields import JobFields
from tfdist.jobs.options import sbatch_option
from tfdist.scaling import check_sizes, parse_sizes

__all__ = [
    "BACKENDS",
    "BACKEND_LAUNCHERS",
    "JobConfig",
    "KEYS",
    "KINDS",
    "LAUNCHERS",
    "RUNTIMES",
    "RUNTIME_LAUNCHERS",
    "load_yaml",
    "merge",
]



@dataclass(frozen=True)
class JobConfig(JobFields):
    """One Slurm job: a training run (``kind: train``), a venv build (``kind: build-venv``), or
    the training's scaling efficiency (``kind: scaling``: one srun step on each of
    ``scaling_nodes`` nodes, then ``tfdist scaling --report``).

    Every field is a YAML key and a ``tfdist job`` flag (``gpus_per_node`` is
    ``--gpus-per-node``). Building one checks every value and combination.

    Raises:
        ConfigError: an impossible value or combination; the message lists what is allowed.
    """

    def __post_init__(self) -> None:
        # The same type checks as from_mapping, for Python callers: lists become tuples, env a
        # dict of its own, numbers given for text become text.
        for spec in dataclasses.fields(self):
            value = _coerce(spec.name, getattr(self, spec.name), "JobConfig")
            object.__setattr__(self, spec.name, value)
        validate(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, origin: str = "config") -> JobConfig:
        """Build a config from YAML-style keys (``gpus_per_node: 4``), checking names and types.

        Args:
            data: Keys and values; missing keys take their defaults.
            origin: Where ``data`` came from, for error messages (a file name).

        Raises:
            ConfigError: an unknown key (with the nearest known name and the list of keys), a
                value of the wrong type, or an impossible combination.
        """
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ConfigError(_unknown_key_message(unknown[0], origin))
        return cls(**{key: _coerce(key, value, origin) for key, value in data.items()})

    def to_mapping(self) -> dict[str, Any]:
        """Return the keys that differ from the defaults, as YAML-ready plain values."""
        defaults = JobConfig.__dataclass_fields__
        result: dict[str, Any] = {}
        for name in KEYS:
            value = getattr(self, name)
            spec = defaults[name]
            default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING \
                else spec.default
            if value != default:
                result[name] = list(value) if isinstance(value, tuple) else value
        return result


KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobConfig))
_LIST_KEYS = ("sbatch_args", "modules", "binds", "launcher_args", "args", "packages")
# Given as one string, these are split into words as a shell would (`args: --epochs 3`).
_WORDS_KEYS = ("args", "launcher_args")
_INT_KEYS = ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "cores_per_node",
             "min_nodes", "node_restarts", "spare_nodes")
_BOOL_KEYS = ("gpus_per_task", "system_site_packages", "requeue", "doctor")
_SIZES_KEYS = ("scaling_nodes",)
_OPTIONAL_KEYS = tuple(f.name for f in dataclasses.fields(JobConfig) if "None" in str(f.type))


def merge(*levels: Mapping[str, Any]) -> dict[str, Any]:
    """Merge config levels, lowest first: a later level's key replaces an earlier one's.

    ``env`` is merged variable by variable, so a flag ``--env NCCL_DEBUG=INFO`` keeps the file's
    other variables. Lists (``modules``, ``binds``, ``args`` ...) are replaced whole.
    """
    merged: dict[str, Any] = {}
    for level in levels:
        for key, value in level.items():
            if key == "env" and isinstance(merged.get("env"), Mapping) and isinstance(
                    value, Mapping):
                merged["env"] = {**merged["env"], **value}
            else:
                merged[key] = value
    return merged


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file: a YAML mapping of keys to values (an empty file is ``{}``).

    Raises:
        ConfigError: the file cannot be read, is not YAML, or is not a mapping.
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.load(text, Loader=_loader())
    except OSError as err:
        raise ConfigError(f"cannot read the job config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of keys to values (nodes: 2, ...), "
                          f"not a {type(data).__name__}; allowed keys: {', '.join(KEYS)}")
    return data


def _loader() -> type:
    """A SafeLoader that resolves YAML 1.2's plain types only: null, true/false, decimal ints.

    Everything else stays a string: ``time: 01:30:00`` is not the sexagesimal 5400, ``1e3`` is
    not a float, and ``partition: on`` is not a boolean.
    """
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    kept = ("tag:yaml.org,2002:null",)
    Loader.yaml_implicit_resolvers = {
        first: [(tag, regex) for tag, regex in resolvers if tag in kept]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                 re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


def _unknown_key_message(key: str, origin: str) -> str:
    near = difflib.get_close_matches(key, KEYS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else "."
    return f"unknown key {key!r} in {origin}{hint} Allowed keys: {', '.join(KEYS)}"


def _coerce(key: str, value: Any, origin: str) -> Any:
    """Check one value's type; numbers are accepted where text is expected (``time: 30``)."""
    where = f"{key} (in {origin})"
    if key in _INT_KEYS:
        if value is None and key in _OPTIONAL_KEYS:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be a whole number, got {value!r}")
        return value
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if key in _SIZES_KEYS:
        return _sizes(where, value)
    if key in _LIST_KEYS:
        if key in _WORDS_KEYS and isinstance(value, str):
            value = _words(where, value)  # `args: --epochs 3` means two words, as in a shell
        items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) \
            else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        texts = tuple(_text(f"{key}[{i}] (in {origin})", item) for i, item in enumerate(items))
        # `--qos high` as one item, as on a command line, is sbatch's `--qos=high`.
        return tuple(map(sbatch_option, texts)) if key == "sbatch_args" else texts
    if key == "env":
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping of variable names to values "
                              f"(env: {{NCCL_DEBUG: INFO}}), got {value!r}")
        return {str(name): _text(f"env.{name} (in {origin})", item)
                for name, item in value.items()}
    if value is None and key in _OPTIONAL_KEYS:
        return None
    if key == "time":
        return _sbatch_time(where, _text(where, value))
    if key == "signal":
        return _signal_lead(where, _text(where, value))
    return _text(where, value)


def _sbatch_time(where: str, text: str) -> str:
    """``time`` in the durations' one dialect too (``90min``, ``2h``, ``1d``), as sbatch writes
    it; sbatch's own forms (a bare number is minutes, ``HH:MM:SS``, ``D-HH``) as given."""
    if not has_unit(text):
        return text
    try:
        return as_sbatch_time(parse_duration(text))
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


def _signal_lead(where: str, text: str) -> str:
    """``signal``'s lead time in the durations' dialect too (``USR1@2min``): in seconds, as
    sbatch --signal takes it."""
    name, at, lead = text.partition("@")
    if not at or not has_unit(lead):
        return text
    try:
        return f"{name}@{round(parse_duration(lead))}"
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from None


_SIZES_EXAMPLE = "[1, 2, 4] (flag: --scaling-nodes 1,2,4)"


def _sizes(where: str, value: Any) -> tuple[int, ...]:
    """Node counts: a list of whole numbers, one number, or text like the flag's (``1,2,4``)."""
    if isinstance(value, str):
        return parse_sizes(value, where, _SIZES_EXAMPLE)
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, (list, tuple)) or not all(
            isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise ConfigError(f"{where} must be a list of node counts, e.g. {_SIZES_EXAMPLE}, got "
                          f"{value!r}")
    return check_sizes(items, where, _SIZES_EXAMPLE) if items else ()


def _words(where: str, text: str) -> list[str]:
    """``text`` split into words as a shell splits them (quotes keep spaces)."""
    try:
        return shlex.split(text)
    except ValueError as error:
        raise ConfigError(f"{where} {text!r}: {error} (close the quote, or give a list of "
                          "words)") from None


def _text(where: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be text, got {value!r}; quote it in YAML")
