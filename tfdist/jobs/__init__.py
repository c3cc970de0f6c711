"""Slurm job scripts for tfdist: a config in, an sbatch script out (``tfdist job``).

    from tfdist.jobs import JobConfig, render, submit

    config = JobConfig(nodes=2, gpus_per_node=4, cpus_per_task=8, venv="/project/venvs/tf",
                       script="train.py", args=("--epochs=8",))
    text = render(config)          # pure: the script as text
    job_id = submit(text)          # sbatch --parsable, returns "12345"

:func:`load_config` reads a YAML file and applies overrides (flags > file > defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfdist.jobs.config import (
    BACKEND_LAUNCHERS,
    BACKENDS,
    KEYS,
    KINDS,
    LAUNCHERS,
    RUNTIME_LAUNCHERS,
    RUNTIMES,
    JobConfig,
    load_yaml,
    merge,
)
from tfdist.jobs.render import render, rendezvous_port_expression
from tfdist.jobs.submit import (
    check_local_paths,
    check_output_dirs,
    parse_job_id,
    save,
    submission_notes,
    submit,
)

__all__ = [
    "BACKENDS",
    "BACKEND_LAUNCHERS",
    "JobConfig",
    "KEYS",
    "KINDS",
    "LAUNCHERS",
    "RUNTIMES",
    "RUNTIME_LAUNCHERS",
    "check_local_paths",
    "check_output_dirs",
    "load_config",
    "load_yaml",
    "merge",
    "parse_job_id",
    "render",
    "rendezvous_port_expression",
    "save",
    "submission_notes",
    "submit",
]


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None) -> JobConfig:
    """Build a config from a YAML file and overrides: overrides > file > defaults.

    Args:
        path: A YAML file of config keys, or None for the defaults alone.
        overrides: Keys that replace the file's (``env`` is merged variable by variable).

    Raises:
        ConfigError: the file cannot be read, a key is unknown, or a value or combination is
            impossible; the message lists what is allowed.
    """
    data = load_yaml(path) if path is not None else {}
    origin = str(path) if path is not None else "the overrides"
    return JobConfig.from_mapping(merge(data, overrides or {}), origin=origin)
