"""The thin, impure end of ``tfdist job``: write a rendered script, or submit it with sbatch.

Before sbatch runs, what can be checked from the submitting machine is: the output directories
(:func:`check_output_dirs`) and the script, venv and image the job reads (:func:`local_paths`,
:func:`check_local_paths`). After it, :func:`submission_notes` says where the logs will be and
how to follow the job, with Slurm's filename patterns filled in (:func:`expand_pattern`).
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from tfdist.errors import ConfigError, LaunchError
from tfdist.jobs.config import JobConfig

__all__ = ["LocalPath", "check_local_paths", "check_output_dirs", "expand_pattern",
           "job_workdir", "local_paths", "parse_job_id", "save", "script_copy_path", "submit",
           "submission_notes"]


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
    a line. Relative patterns are under the job's working directory (:func:`job_workdir`).
    Patterns whose directory part holds ``%`` (``%u``) or ``${NAME}`` are not checked.

    Raises:
        ConfigError: a directory is missing, with the command that creates it.
    """
    base = job_workdir(config, cwd)
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


def job_workdir(config: JobConfig, cwd: str | Path | None = None) -> Path:
    """The directory the job starts in: where sbatch runs (``cwd``, default this process's), or
    the ``--chdir`` in ``sbatch_args`` (relative to it). Relative paths in the job are under it."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    for option in config.sbatch_args:
        if option.startswith("--chdir="):
            base = base / option.partition("=")[2]
        elif option.startswith("-D") and len(option) > 2:
            base = base / option[2:]
    return base


class LocalPath(NamedTuple):
    """A file the job reads when it starts, which must exist before it is submitted."""

    key: str  # the config key: script, venv or image
    path: str  # as the job names it: absolute, or relative to its working directory
    fix: str  # what sets it, for the error message


def local_paths(config: JobConfig) -> list[LocalPath]:
    """The files ``config``'s job reads that the submitting machine can check (pure).

    - ``script``, with runtime venv, unless it is an option such as ``-m MODULE``. In a
      container the script is read inside the image, from the container's working directory.
    - the venv's ``bin/activate``, with runtime venv (kind build-venv creates the venv).
    - ``image``: for apptainer unless it is a URI (``docker://...``, ``library://...``); for
      enroot only a path that starts with ``/`` or ``.``, as pyxis tells a squashfs file from a
      registry image (``nvcr.io#nvidia/pytorch:24.01-py3``).

    A path may name variables (``${HOME}/venvs/x``): :func:`check_local_paths` expands them as
    the job will (sbatch passes the submitting shell's environment on).
    """
    if config.kind == "build-venv":
        return []
    paths = []
    if config.runtime == "venv":
        if config.script and not config.script.startswith("-"):
            paths.append(LocalPath("script", config.script, "fix SCRIPT (script: in the config), "
                                   "or submit from the directory that holds it"))
        if config.venv:
            paths.append(LocalPath("venv", config.venv.rstrip("/") + "/bin/activate",
                                   "fix --venv (venv: in the config) to a venv's directory, or "
                                   "build one with --kind build-venv"))
    elif config.image and _local_image(config.runtime, config.image):
        paths.append(LocalPath("image", config.image, "fix --image (image: in the config)"))
    return paths


def _local_image(runtime: str, image: str) -> bool:
    if runtime == "enroot":
        return image.startswith(("/", "."))
    return "://" not in image


def check_local_paths(config: JobConfig, cwd: str | Path | None = None,
                      environ: Mapping[str, str] | None = None) -> list[str]:
    """Check that the files of :func:`local_paths` exist, relative ones in :func:`job_workdir`,
    variables in them expanded from ``environ`` (default: this process's) as the job's shell
    will: sbatch passes the submitting shell's environment on.

    Returns:
        A line for each path that names a variable unset here (``$SLURM_TMPDIR``: set only in
        the job), which is not checked: said, not skipped in silence.

    Raises:
        ConfigError: a file is missing, with the flag that sets it.
    """
    base = job_workdir(config, cwd)
    environ = os.environ if environ is None else environ
    unchecked = []
    for entry in local_paths(config):
        path = _expanded(entry.path, environ)
        if "$" in path:
            unset = sorted(set(re.findall(r"\$\{?(\w+)", path)))
            unchecked.append(f"tfdist: {entry.key} {entry.path!r} names "
                             f"{', '.join('$' + name for name in unset)}, unset here (set in the "
                             "job only?): not checked before submitting")
            continue
        target = base / path
        if target.exists():
            continue
        where = "" if Path(path).is_absolute() else f" ({target}: in the job's directory)"
        tilde = (" The job's shell does not expand '~' in it: write ${HOME}/... instead."
                 if entry.path.startswith("~") else "")
        shown = entry.path if path == entry.path else f"{entry.path} = {path}"
        raise ConfigError(f"{entry.key}: {shown!r}{where} does not exist, and the job would "
                          f"fail when it starts; {entry.fix}.{tilde} If it exists on the "
                          "compute nodes only, --save the script and submit that with sbatch")
    return unchecked


def _expanded(path: str, environ: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` in ``path`` replaced from ``environ`` where set (pure)."""
    def value(found: re.Match[str]) -> str:
        name = found.group(1) or found.group(2)
        return environ.get(name, found.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, path)


# Slurm's filename patterns (sbatch --output, srun --output): the fields known at submission
# are filled in, the others become a glob. %A is the job id sbatch printed; for a job array %j
# is each array task's own id.
_FIELD = re.compile(r"%(%|(\d*)([AabJjNnstux]))")
_GLOBS = {"a": "the array task id", "b": "the array task id modulo 10",
          "J": "each array task's job id (and step id)", "j": "each array task's job id",
          "N": "the node's name", "n": "the node's index", "s": "the step id", "t": "the task id",
          "u": "the user name"}


def expand_pattern(pattern: str, job_id: str, job_name: str, *, array: bool = False,
                   step: bool = False, user: str | None = None) -> tuple[str, tuple[str, ...]]:
    """Fill in a Slurm filename pattern as far as it is known when the job is submitted.

    Args:
        pattern: e.g. ``logs/%x-%j-%t.out``.
        job_id: The id sbatch printed.
        job_name: The job's name (``%x``).
        array: A job array: ``%j`` is each array task's own id, unknown yet.
        step: The pattern of srun's ``--output`` (``%J`` is job id and step) rather than the
            batch shell's.
        user: The user name (``%u``), when known.

    Returns:
        The path, with ``*`` for each field that is not known yet (the task, node, step or
        array task), and what each ``*`` stands for (``"%t: the task id"``), in order.
        A pattern with a backslash is not expanded, as Slurm does.
    """
    if "\\" in pattern:
        return pattern.replace("\\", ""), ()
    globs: list[str] = []
    own_id = None if array else job_id
    known = {"A": job_id, "j": own_id, "J": own_id, "x": job_name, "u": user}

    def fill(match: re.Match[str]) -> str:
        if match.group(1) == "%":
            return "%"
        width, letter = match.group(2), match.group(3)
        value = known.get(letter)
        if value is None:
            globs.append(f"%{letter}: {_GLOBS[letter]}")
            return "*"
        if width and value.isdigit():
            value = value.zfill(min(int(width), 10))
        if letter == "J" and step:  # job id.step id
            globs.append("%J: the step id after the job id")
            value += ".*"
        return value

    return _FIELD.sub(fill, pattern), tuple(globs)


def _log_path(pattern: str, job_id: str, config: JobConfig, workdir: str | Path, *,
              step: bool = False, user: str | None = None) -> tuple[str, tuple[str, ...]]:
    path, globs = expand_pattern(pattern, job_id, config.job_name, array=config.array is not None,
                                 step=step, user=user)
    if "${" in path:  # srun's --output in the script body: the job's shell expands ${NAME} first
        return path, globs
    return str(Path(workdir) / path), globs


def script_copy_path(config: JobConfig, job_id: str, *, workdir: str | Path,
                     user: str | None = None) -> str:
    """Where ``--submit`` keeps a copy of the submitted script: ``JOBNAME-JOBID.sbatch`` next to
    the batch shell's output file, or in ``workdir`` where that directory is not one path
    (``%N/out``) or is ``/dev`` (``--output=/dev/null``)."""
    directory, globs = _log_path(posixpath.dirname(config.output) or ".", job_id, config,
                                 workdir, user=user)
    if globs or directory == "/dev":
        directory = str(workdir)
    return str(Path(directory) / f"{config.job_name}-{job_id}.sbatch")


def submission_notes(config: JobConfig, job_id: str, *, workdir: str | Path,
                     user: str | None = None, copy: str | None = None) -> str:
    """What to tell the user after sbatch accepted the job (pure): its id, where each log will
    be (absolute paths, ``*`` explained), the script's copy, and the commands to follow it.

    Args:
        config: The submitted job.
        job_id: The id sbatch printed.
        workdir: The job's working directory (:func:`job_workdir`).
        user: The user name, for ``%u``.
        copy: The copy of the submitted script, if one was kept.
    """
    output, globs = _log_path(config.output, job_id, config, workdir, user=user)
    rows = [("output", _explained(output, globs))]
    if config.task_output is not None:
        tasks, task_globs = _log_path(config.task_output, job_id, config, workdir, step=True,
                                      user=user)
        rows.append(("task output", _explained(tasks, task_globs)))
    if copy is not None:
        rows.append(("script", f"{copy}  (a copy of what was submitted)"))
    rows += [("follow it", f"squeue -j {job_id}"),
             ("", f"tail -F {_glob_word(output)}  # the file appears when the job starts")]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"tfdist: submitted job {job_id} ({config.job_name})"]
    lines += [f"  {(name + ':') if name else '':<{width}}{text}" for name, text in rows]
    return "\n".join(lines)


def _explained(path: str, globs: tuple[str, ...]) -> str:
    notes = [f"* stands for {'; '.join(globs)}"] if globs else []
    if "${" in path:
        notes.append("the job's shell expands ${NAME}")
    return f"{path}  ({', '.join(notes)})" if notes else path


def _glob_word(path: str) -> str:
    """``path`` as one shell word whose ``*`` stay globs."""
    return "*".join(shlex.quote(part) if part else "" for part in path.split("*"))
