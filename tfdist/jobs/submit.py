"""The thin, impure end of ``tfdist job``: write a rendered script, or submit it with sbatch."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tfdist.errors import ConfigError, LaunchError
from tfdist.jobs.config import JobConfig

__all__ = ["check_output_dirs", "parse_job_id", "save", "submit"]


def save(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` as an executable script (mode 0755); return the path.

    Raises:
        ConfigError: the file cannot be written.
    """
    target = Path(path)
    try:
        target.write_text(text, encoding="utf-8")
        target.chmod(0o755)
    except OSError as err:
        raise ConfigError(f"cannot write the job script to {target}: {err.strerror}") from None
    return target


def check_output_dirs(config: JobConfig, cwd: str | Path | None = None) -> None:
    """Check that the directories of ``output`` and ``task_output`` exist.

    Slurm does not create them: a job whose output directory is missing fails without writing
    a line. Patterns whose directory part holds ``%`` (``%u``) or ``${NAME}`` are not checked.

    Raises:
        ConfigError: a directory is missing, with the command that creates it.
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    for key, pattern in (("output", config.output), ("task_output", config.task_output)):
        if pattern is None:
            continue
        directory = Path(pattern).parent
        if "%" in str(directory) or "${" in str(directory):
            continue
        if not (base / directory).is_dir():
            raise ConfigError(f"{key} {pattern!r}: the directory {str(directory)!r} does not "
                              "exist, and Slurm does not create it (the job would fail without "
                              f"output); create it first: mkdir -p {directory}")


def submit(text: str, *, sbatch: str = "sbatch", args: Sequence[str] = (),
           script_path: str | Path | None = None, cwd: str | Path | None = None,
           env: Mapping[str, str] | None = None) -> str:
    """Submit a job script with ``sbatch --parsable`` and return the job id.

    Args:
        text: The script, passed on sbatch's standard input (unless ``script_path`` is given).
        sbatch: The sbatch command: a name looked up on ``PATH``, or a path.
        args: More sbatch options, placed before the script (they beat its ``#SBATCH`` lines).
        script_path: Submit this saved file instead of ``text``.
        cwd: Directory to submit from: the job's working directory (default: this process's).
        env: Environment for sbatch, which exports it to the job by default (default: this
            process's); its ``PATH`` is where ``sbatch`` is looked up.

    Returns:
        The job id, e.g. ``"12345"``.

    Raises:
        LaunchError: sbatch is not found, fails (its stderr is in the message), or prints no
            job id.
    """
    environ = os.environ if env is None else env
    executable = shutil.which(sbatch, path=environ.get("PATH"))
    if executable is None:
        raise LaunchError(f"cannot submit: {sbatch!r} is not on PATH ({environ.get('PATH')}). "
                          "Run `tfdist job` on a login node of the cluster, or --save the script "
                          "and submit it there with sbatch")
    command = [executable, "--parsable", *args]
    if script_path is not None:
        command.append(str(script_path))
    result = subprocess.run(command, input=None if script_path else text, text=True,
                            capture_output=True, cwd=cwd, env=None if env is None else dict(env),
                            check=False)
    if result.returncode != 0:
        detail = result.stderr.strip() or result.stdout.strip() or "no output"
        raise LaunchError(f"sbatch failed (exit {result.returncode}): {detail}")
    return parse_job_id(result.stdout)


def parse_job_id(output: str) -> str:
    """Return the job id in the output of ``sbatch --parsable``: ``ID`` or ``ID;CLUSTER``.

    Raises:
        LaunchError: the output holds no job id.
    """
    lines = [line for line in output.strip().splitlines() if line.strip()]
    job_id = lines[-1].split(";", 1)[0].strip() if lines else ""
    if not job_id.isdigit():
        raise LaunchError(f"sbatch --parsable printed no job id: {output.strip()!r}")
    return job_id
