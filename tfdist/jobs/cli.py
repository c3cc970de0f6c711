"""``tfdist job``: render an sbatch script from a YAML config and flags; print, save or submit it.

Flags beat the config file, which beats the defaults. Only flags that were given count (their
defaults are ``SUPPRESS``), so a flag never overrides the file with a default value.

Everything after SCRIPT goes to the script, so a ``tfdist job`` option there would silently not
apply: :func:`misplaced_options` finds them, and they are an error unless ``--`` comes before
SCRIPT. :func:`join_option_values` lets ``--sbatch-arg --qos high`` through argparse, which
refuses a separate value that starts with a dash.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from collections.abc import Collection, Sequence
from typing import Any

from tfdist.errors import ConfigError
from tfdist.jobs.config import BACKENDS, KEYS, KINDS, LAUNCHERS, RUNTIMES, JobConfig
from tfdist.jobs.options import LAUNCHER_FLAGS, option_name, sbatch_option, takes_value

__all__ = ["add_parser", "flag_values", "job_options", "join_option_values",
           "misplaced_options", "run"]

_Group = argparse._ArgumentGroup
_CONFIG_SUFFIXES = (".yaml", ".yml")
# Flags whose values are collected per use (--module a --module b); all others are single values.
_REPEATED = {"module": "modules", "bind": "binds", "sbatch_arg": "sbatch_args",
             "launcher_arg": "launcher_args", "package": "packages"}
# Flags whose value is often an option itself: `--sbatch-arg --qos high` is joined for argparse.
_OPTION_VALUED = ("--sbatch-arg", "--launcher-arg")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``tfdist job`` and its flag groups to the ``tfdist`` subcommands."""
    parser = commands.add_parser(
        "job", allow_abbrev=False,
        help="render a Slurm job script from a YAML config and flags; print, save or submit it",
        description="Render an sbatch script for multi-node training (or a venv build, or a "
        "scaling measurement) from CONFIG.yaml and flags; flags beat the file, which beats the "
        "defaults. YAML keys are the "
        "flag names in snake_case (--gpus-per-node is gpus_per_node). Values in the script body "
        "are shell-quoted; ${NAME} is left for the job's shell to expand. Prints the script "
        "unless --save or --submit is given. Everything after SCRIPT goes to the script, so "
        "options of `tfdist job` must come before SCRIPT: one after it is an error. Put -- "
        "before SCRIPT to pass everything after it unchanged, even options named like these "
        "(-- train.py --nodes 4), and before a SCRIPT that starts with a dash "
        "(-- -m MODULE ARGS).",
        usage="tfdist job [CONFIG.yaml] [options] [SCRIPT [ARGS ...]]",
        argument_default=argparse.SUPPRESS,
    )
    _add_resources(parser.add_argument_group("resources"))
    _add_scheduling(parser.add_argument_group("scheduling and output files"))
    _add_software(parser.add_argument_group("software"))
    _add_launch(parser.add_argument_group("launch"))
    _add_build(parser.add_argument_group("venv build"))
    _add_scaling(parser.add_argument_group("scaling efficiency (--kind scaling)"))
    _add_actions(parser.add_argument_group("what to do with the script"))
    parser.add_argument("words", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                        help="the training script and its arguments (config keys script, args)")
    parser.set_defaults(handler=run, job_parser=parser)


def _add_resources(group: _Group) -> None:
    group.add_argument("--nodes", type=int, metavar="N", help="nodes (default: 1)")
    group.add_argument("--gpus-per-node", type=int, metavar="G",
                       help="GPUs per node, 0 for CPU only (default: 1)")
    group.add_argument("--gpu-type", metavar="TYPE", help="GPU type, e.g. a100 (--gpus-per-node="
                       "TYPE:G); default: any")
    group.add_argument("--gpus-per-task", action=argparse.BooleanOptionalAction,
                       help="let Slurm bind one GPU to each task (default: no, tfdist assigns "
                       "them)")
    group.add_argument("--tasks-per-node", type=int, metavar="T",
                       help="srun tasks per node (default: one per GPU; 1 for torchrun)")
    group.add_argument("--cpus-per-task", type=int, metavar="C",
                       help="cores per task (default: the node's cores shared by its tasks)")
    group.add_argument("--cores-per-node", type=int, metavar="C",
                       help="the cores of a node, for --cpus-per-task's default (default: what "
                       "sinfo says of the partition, where sinfo is installed)")


def _add_scheduling(group: _Group) -> None:
    group.add_argument("--job-name", metavar="NAME", help="job name (default: tfdist)")
    group.add_argument("--partition", metavar="P")
    group.add_argument("--account", metavar="A")
    group.add_argument("--time", metavar="LIMIT",
                       help="time limit, e.g. 90 (minutes), 01:30:00 or 90min")
    group.add_argument("--constraint", metavar="FEATURES", help="node features, e.g. a100&ib")
    group.add_argument("--mem", metavar="SIZE", help="memory per node, e.g. 64G")
    group.add_argument("--array", metavar="INDEXES", help="a job array, e.g. 0-9 or 1,3%%2")
    group.add_argument("--signal", metavar="SIG@SECONDS",
                       help="signal the tasks this long before the time limit, e.g. USR1@120: "
                       "tfdist saves the state at one step and exits 75")
    group.add_argument("--requeue", action=argparse.BooleanOptionalAction,
                       help="let the job be requeued, and requeue it when the tasks exit 75 "
                       "(preempted) (default: no)")
    group.add_argument("--min-nodes", type=int, metavar="M",
                       help="survive a lost node: sbatch --no-kill, and the training's step "
                       "starts again on the nodes that answer, from the last save, while at "
                       "least M are left (tfdist survive; srun and a venv) (default: off)")
    group.add_argument("--node-restarts", type=int, metavar="R",
                       help="with --min-nodes: restart the training step at most R times (on "
                       "the nodes left, or on the same ones after a task crashed on a healthy "
                       "node), then requeue the job (default: 3)")
    group.add_argument("--spare-nodes", type=int, metavar="K",
                       help="K nodes more, idle: a lost node's place goes to one of them and "
                       "training goes on as large as before, the continuation an uninterrupted "
                       "run's (tfdist survive; srun and a venv) (default: 0)")
    group.add_argument("--sbatch-arg", action="append", metavar="OPTION",
                       help="one more #SBATCH option (repeat): --sbatch-arg=--qos=high, "
                       "--sbatch-arg --qos high and --sbatch-arg '--qos high' all render "
                       "--qos=high")
    group.add_argument("--output", metavar="PATTERN",
                       help="the batch shell's output file (default: %%x-%%j.out)")
    group.add_argument("--task-output", metavar="PATTERN",
                       help="one file per task, e.g. %%x-%%j-%%t.out (srun --output)")


def _add_software(group: _Group) -> None:
    group.add_argument("--module", action="append", metavar="MODULE",
                       help="module to load after `module purge` (repeat; default: none)")
    group.add_argument("--runtime", choices=RUNTIMES, help="where Python runs (default: venv)")
    group.add_argument("--venv", metavar="PATH", help="venv to activate")
    group.add_argument("--python", metavar="PATH",
                       help="Python interpreter to run (default: python from PATH)")
    group.add_argument("--image", metavar="IMAGE", help="container image (apptainer, enroot)")
    group.add_argument("--bind", action="append", metavar="SRC:DST",
                       help="bind a host path into the container (repeat)")
    group.add_argument("--env", action="append", type=_env_pair, metavar="NAME=VALUE",
                       help="export a variable in the job (repeat; merged with the config's)")


def _add_launch(group: _Group) -> None:
    group.add_argument("--backend", choices=BACKENDS, help="training backend (default: mwms)")
    group.add_argument("--launcher", choices=LAUNCHERS,
                       help="default: srun, for torch torchrun")
    group.add_argument("--launcher-arg", action="append", metavar="ARG",
                       help="one more word for the launcher (repeat), e.g. --launcher-arg "
                       "--exact; a value is --launcher-arg=--opt=VALUE, or a word of its own: "
                       "--launcher-arg=-np --launcher-arg=4")
    group.add_argument("--cpu-bind", metavar="TYPE", help="srun --cpu-bind (default: cores)")
    group.add_argument("--doctor", action=argparse.BooleanOptionalAction,
                       help="run `tfdist doctor` as a step of its own before training: every "
                       "rank's plan, versions, ports and an all-reduce, in seconds (default: yes)")


def _add_build(group: _Group) -> None:
    group.add_argument("--kind", choices=KINDS,
                       help="train (default), build-venv, or scaling: the training on 1, 2, 4 "
                       "... nodes, one srun step each, then `tfdist scaling --report`")
    group.add_argument("--package", action="append", metavar="SPEC",
                       help="what pip installs into the venv (repeat)")
    group.add_argument("--system-site-packages", action=argparse.BooleanOptionalAction,
                       help="let the venv see the modules' packages (default: no)")


def _add_scaling(group: _Group) -> None:
    group.add_argument("--scaling-nodes", metavar="SIZES",
                       help="the node counts to measure, e.g. 1,2,4 (default: the powers of two "
                       "below --nodes, and --nodes)")


def _add_actions(group: _Group) -> None:
    group.add_argument("--save", metavar="PATH", help="write the script to PATH (mode 0755)")
    group.add_argument("--submit", action="store_true",
                       help="submit with sbatch from PATH, after checking that the output "
                       "directories, the script, the venv and a local image exist; print the "
                       "job id (alone on stdout), then where its logs will be and how to follow "
                       "it. Without --save, a copy of the script is kept next to the output "
                       "file (JOBNAME-JOBID.sbatch)")


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Return the config keys the command line set: only flags that were given."""
    given = vars(args)
    values: dict[str, Any] = {}
    for dest, value in given.items():
        if dest in _REPEATED:
            values[_REPEATED[dest]] = value
        elif dest == "env":
            values["env"] = dict(value)
        elif dest in KEYS:
            values[dest] = value
    words = list(given.get("words") or [])
    if words[:1] == ["--"]:  # `tfdist job [options] -- -m module ...`: "--" ends the options
        words = words[1:]
    elif words and "job_parser" in given:
        _refuse_options_after_script(words, job_options(given["job_parser"]))
    if words:
        values["script"], values["args"] = words[0], words[1:]
    return values


def job_options(parser: argparse.ArgumentParser) -> list[str]:
    """The long options ``parser`` defines (``--nodes``, ``--no-doctor``, ``--help`` ...)."""
    return [name for action in parser._actions for name in action.option_strings
            if name.startswith("--")]


def misplaced_options(words: Sequence[str], options: Collection[str]) -> list[str]:
    """The ``options`` among ``words`` (the script's arguments), each once, in order: a word that
    is one, or starts with ``NAME=`` for one. Other words, the script's own options
    (``--epochs=3``) among them, are not."""
    found: list[str] = []
    for word in words:
        name = word.split("=", 1)[0]
        if name in options and name not in found:
            found.append(name)
    return found


def _refuse_options_after_script(words: list[str], options: Collection[str]) -> None:
    script, args = words[0], words[1:]
    misplaced = misplaced_options(args, options)
    if not misplaced:
        return
    names = ", ".join(misplaced)
    it, they = ("it", "it is") if len(misplaced) == 1 else ("them", "they are")
    raise ConfigError(
        f"{names} after SCRIPT {script}: everything after SCRIPT goes to the script, so "
        f"`tfdist job` would not apply {it} and {script} would get {it} instead. Move {names} "
        f"before SCRIPT (tfdist job {misplaced[0]} ... {script} ...), or, if {they} "
        f"{script}'s own, put -- before SCRIPT to pass everything after it unchanged "
        f"(tfdist job [options] -- {script} {misplaced[0]} ...)")


def join_option_values(words: Sequence[str]) -> list[str]:
    """Join ``--sbatch-arg`` and ``--launcher-arg`` to a value that starts with a dash, which
    argparse would take for an option of its own (pure).

    ``--sbatch-arg --exclusive`` becomes ``--sbatch-arg=--exclusive``; ``--sbatch-arg --qos
    high`` and ``--sbatch-arg -q high`` become ``--sbatch-arg=--qos=high``, since sbatch's
    ``--qos`` takes a value (:mod:`tfdist.jobs.options`); ``--launcher-arg --exact`` becomes
    ``--launcher-arg=--exact``. Nothing after ``--`` is changed.

    Raises:
        ConfigError: a bare option (no ``=VALUE``) whose value is unknown here is followed by a
            word that may be its value or SCRIPT; the message gives both spellings.
    """
    joined: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            return joined + list(words[index:])
        option = words[index + 1] if index + 1 < len(words) else "--"
        if word not in _OPTION_VALUED or not option.startswith("-") or option == "--":
            joined.append(word)
            index += 1
            continue
        after = words[index + 2] if index + 2 < len(words) else None
        sbatch = word == "--sbatch-arg"
        # A bare option has no value in its word (`--qos`, not `--qos=high` or `--qos high`).
        bare = not any(ch.isspace() for ch in option) and (
            option == option_name(option) if sbatch else "=" not in option)
        if not bare:
            arity = None
        elif sbatch:
            arity = takes_value(option)
        else:
            arity = False if option in LAUNCHER_FLAGS else None
        if bare and arity and after is not None:
            joined.append(f"{word}={sbatch_option(f'{option} {after}')}")
            index += 3
            continue
        if bare and arity is None and after is not None and not after.startswith("-"):
            raise ConfigError(_ambiguous_message(word, option, after))
        joined.append(f"{word}={option}")
        index += 2
    return joined


def _ambiguous_message(word: str, option: str, after: str) -> str:
    separate = "" if word == "--sbatch-arg" else (f", or {word}={option} {word}={after} for a "
                                                  "launcher that takes it as a word of its own")
    return (f"`{word} {option} {after}`: tfdist cannot tell whether {after!r} is the value of "
            f"{option} or SCRIPT. Write {word}={option}={after} for a value{separate}; or "
            f"{word}={option} for an option without one")


def _read_config_word(args: argparse.Namespace) -> None:
    """``tfdist job CONFIG.yaml [options] ...``: take the file, then parse the rest again."""
    words = getattr(args, "words", None) or []
    if words and words[0].endswith(_CONFIG_SUFFIXES):
        args.config_file, args.words = words[0], []
        args.job_parser.parse_args(words[1:], namespace=args)
        if (getattr(args, "words", None) or [""])[0].endswith(_CONFIG_SUFFIXES):
            raise ConfigError(f"give one config file, not {words[0]} and {args.words[0]}")


def run(args: argparse.Namespace) -> int:
    """Run ``tfdist job``: print the script, or ``--save`` it and/or ``--submit`` it."""
    from tfdist.jobs import JobConfig, load_yaml, merge, render, save

    _read_config_word(args)
    path = getattr(args, "config_file", None)
    data = load_yaml(path) if path else {}
    config = _with_node_cores(JobConfig.from_mapping(merge(data, flag_values(args)),
                                                     origin=path or "the flags"))
    _warn_few_cores(config)
    text = render(config, source=path)
    saved = getattr(args, "save", None)
    if saved:
        save(text, saved)
        print(f"tfdist: wrote {saved}", file=sys.stderr)
    if getattr(args, "submit", False):
        _submit(config, text, saved)
    elif not saved:
        sys.stdout.write(text)
    return 0


def _with_node_cores(config: JobConfig) -> JobConfig:
    """``config`` with ``cores_per_node`` from sinfo (the partition's smallest node), where
    neither it nor ``cpus_per_task`` is set and sinfo is installed (a login node)."""
    if (config.cpus_per_task is not None or config.cores_per_node is not None
            or config.kind == "build-venv" or shutil.which("sinfo") is None):
        return config
    command = ["sinfo", "-h", "-o", "%c", *(["-p", config.partition] if config.partition else [])]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return config  # no answer: Slurm's default, as without sinfo
    cores = node_cores(out)
    if cores is None:
        return config
    chosen = dataclasses.replace(config, cores_per_node=cores)
    print(f"tfdist: {cores} cores per node (sinfo"
          f"{f', partition {config.partition}' if config.partition else ''}): "
          f"--cpus-per-task={chosen.effective_cpus_per_task} for "
          f"{chosen.effective_tasks_per_node} task(s) per node (--cpus-per-task or "
          "--cores-per-node to change it)", file=sys.stderr)
    return chosen


def node_cores(sinfo: str) -> int | None:
    """The fewest CPUs of a node in ``sinfo -h -o %c``'s lines (``48``, ``64+``)."""
    counts = [int(word.rstrip("+")) for word in sinfo.split() if word.rstrip("+").isdigit()]
    return min(counts) if counts else None


def _warn_few_cores(config: JobConfig) -> None:
    cpus = config.effective_cpus_per_task
    if config.gpus_per_node > 0 and config.kind != "build-venv" and cpus is not None and cpus < 2:
        print(f"tfdist: warning: {cpus} core per task for {config.effective_tasks_per_node} "
              "GPU task(s) per node: each task's input pipeline and TensorFlow's threads share "
              "one core, which starves the GPU; give each task at least 2 (--cpus-per-task)",
              file=sys.stderr)


def _submit(config: JobConfig, text: str, saved: str | None) -> None:
    """Check, submit, print the job id on stdout; keep a copy (without --save); say where the
    logs will be on stderr."""
    from tfdist.jobs.submit import (
        check_local_paths,
        check_output_dirs,
        job_workdir,
        save,
        script_copy_path,
        submission_notes,
        submit,
    )

    check_output_dirs(config)
    for line in check_local_paths(config):
        print(line, file=sys.stderr)
    job_id = submit(text, script_path=saved)
    print(job_id, flush=True)
    workdir, user = job_workdir(config), _user()
    copy = None
    if not saved:
        copy = script_copy_path(config, job_id, workdir=workdir, user=user)
        try:
            save(text, copy)
        except ConfigError as err:  # the job is submitted: say so, and go on
            print(f"tfdist: job {job_id} is submitted, but its copy was not kept: {err}",
                  file=sys.stderr)
            copy = None
    print(submission_notes(config, job_id, workdir=workdir, user=user, copy=copy),
          file=sys.stderr)


def _user() -> str | None:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        return None
