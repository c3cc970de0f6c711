"""The ``tfdist`` command: ``tfdist launch`` runs local workers, ``tfdist env`` shows the
cluster environment tfdist detects, ``tfdist settings`` every setting and its value here,
``tfdist job`` renders and submits Slurm job scripts, ``tfdist doctor`` checks a launch,
``tfdist scaling`` measures the scaling efficiency of a script.

Each subcommand has one small function adding its flags and one running it. Nothing here imports
TensorFlow, so ``tfdist --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tfdist
from tfdist.backend_facts import BACKENDS
from tfdist.errors import ConfigError, TfdistError
from tfdist.settings import setting

__all__ = ["build_parser", "main"]

_Handler = Callable[[argparse.Namespace], int]

# How a launch's workers share the GPUs: tfdist.devices.select_gpus (tested against this text).
_GPU_SPLIT_HELP = (
    "tfdist launch gives every worker the CUDA_VISIBLE_DEVICES it inherited; tfdist.init() (or "
    "tfdist.torch.init()) in each worker then keeps an equal, contiguous share by rank, with the "
    "physical ids. Example: CUDA_VISIBLE_DEVICES=0,1,2,3 and -n 2: worker 0 gets GPUs 0,1, "
    "worker 1 gets GPUs 2,3. A single id (CUDA_VISIBLE_DEVICES=0) is shared by all workers; "
    "with CUDA_VISIBLE_DEVICES unset each worker takes the same share of the GPUs the framework "
    "counts. A GPU count that N does not divide is an error at init. --dry-run shows each "
    "worker's GPUs. A script that does not call tfdist.init() sees every GPU."
)
_GPUS_PER_WORKER_HELP = (
    "give each worker K GPUs: every worker gets the first N*K ids of CUDA_VISIBLE_DEVICES (or of "
    "the node's GPUs when it is unset), and keeps its own K as above; an error if fewer are "
    "visible. With K > 1 each worker trains one replica per GPU (MultiWorkerMirroredStrategy; "
    "not --backend horovod). Example: -n 2 --gpus-per-worker 4 on an 8-GPU node."
)

# `tfdist launch --backend`: the backends it starts local workers for (the first by default).
_LAUNCHABLE = tuple(row.name for row in BACKENDS if row.launchable)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tfdist`` command line.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: the subcommand's, or 2 for a :class:`TfdistError` (printed as
        ``tfdist: <message>``, without a traceback). Bad flags exit 2 through argparse.
    """
    from tfdist import autostart

    autostart.off()  # the command's own TensorFlow work (doctor's collectives) starts no strategy
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        if words[:1] == ["job"]:  # `--sbatch-arg --qos high`: see tfdist.jobs.cli
            from tfdist.jobs.cli import join_option_values

            words[1:] = join_option_values(words[1:])
        parser = build_parser()
        _check_command(parser, words[:1])
        args = parser.parse_args(words)
        handler: _Handler = args.handler
        return handler(args)
    except TfdistError as err:
        print(f"tfdist: {err}", file=sys.stderr)
        return 2


def _check_command(parser: argparse.ArgumentParser, first: Sequence[str]) -> None:
    """A first word that is no command is one line naming the nearest (not argparse's usage
    of every command).

    Raises:
        ConfigError: the word is no command.
    """
    import difflib

    commands = [name for action in parser._subparsers._group_actions  # type: ignore[union-attr]
                for name in getattr(action, "choices", None) or ()]
    if not first or first[0].startswith("-") or first[0] in commands:
        return
    near = difflib.get_close_matches(first[0], commands, n=1)
    hint = f"did you mean `tfdist {near[0]}`? " if near else ""
    raise ConfigError(f"{first[0]!r} is no tfdist command; {hint}the commands: "
                      f"{', '.join(commands)} (`tfdist COMMAND --help` for each)")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``tfdist`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="tfdist", description="Data-parallel TensorFlow/Keras training on Slurm."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {tfdist.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_launch(commands)
    _add_env(commands)
    _add_doctor(commands)
    _add_settings(commands)
    _add_job(commands)
    _add_scaling(commands)
    _add_survive(commands)
    _add_verify(commands)
    return parser


def _add_verify(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "verify", allow_abbrev=False,
        help="check that a script computes on N workers what it computes in one process",
        description="Run SCRIPT for a few steps in one process, then on N local workers "
        "(tfdist launch) with the same arguments, global batch and seed, and compare every "
        "step's loss and weights, evaluate's and predict's results and the final weights. "
        "Prints 'equal', 'within rounding' (with the bound and why) or where it differs first, "
        "the likely cause and the fix. Exit status: 0 equal or within rounding, 1 differs, 2 a "
        "run failed.",
        usage="tfdist verify [-n N] [--backend B] [--steps S] [--seed S] SCRIPT [ARGS ...]",
    )
    parser.add_argument("-n", "--num-workers", dest="workers", type=_at_least(2), default=2,
                        metavar="N", help="workers of the compared run (default 2)")
    parser.add_argument("--backend", choices=_LAUNCHABLE,
                        help="the compared run's backend (default: tfdist launch's)")
    parser.add_argument("--steps", type=_at_least(0), default=10, metavar="S",
                        help="each fit stops after S steps (default 10; 0: the script's own)")
    parser.add_argument("--seed", type=_at_least(0), default=0, metavar="S",
                        help="seeds Python, NumPy and the framework in both runs when the "
                        "strategy is created (default 0)")
    parser.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                        help="the longest each run may take (default 600; or 10min, 1h)")
    parser.add_argument("--keep", metavar="DIR", help="keep both runs' records in DIR")
    parser.add_argument("--show-output", action="store_true",
                        help="print the last lines of both runs' output")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (.py)")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    parser.set_defaults(handler=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from tfdist.verify import run

    if not os.path.isfile(args.script):
        raise ConfigError(f"verify: no script {args.script!r}: give the path of a .py file")
    return run.main(args.script, args.args, run.Options(
        workers=args.workers, backend=args.backend, steps=args.steps, seed=args.seed,
        timeout_s=args.timeout, keep=args.keep), show_output=args.show_output)


def _add_launch(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "launch", allow_abbrev=False,
        help="run N workers of a script on this machine",
        description="Run N worker processes of SCRIPT on this machine, each with its own "
        "TF_CONFIG (or, with --backend horovod, Horovod's variables), TFDIST_LOCAL_RANK and CPU "
        "core; torch scripts (tfdist.torch) use the default backend and meet at rank 0's "
        "TF_CONFIG address. Everything after SCRIPT goes to the script; a SCRIPT, module or "
        "executable that does not exist is refused before anything starts. "
        "Output lines are prefixed with [rank]; a carriage return (progress bars) ends a line. "
        "--dry-run prints each worker's command, variables, cores and GPUs instead of starting "
        "it. torchrun's --nproc-per-node, --max_restarts and --module are accepted too.",
        usage="tfdist launch -n N [options] (SCRIPT.py | -m MODULE | EXECUTABLE) [ARGS ...]",
    )
    _add_launch_workers(parser.add_argument_group("workers"))
    parser.add_argument_group("GPUs", _GPU_SPLIT_HELP).add_argument(
        "--gpus-per-worker", type=_at_least(1), metavar="K", help=_GPUS_PER_WORKER_HELP)
    _add_launch_cpus(parser.add_argument_group("CPU pinning"))
    _add_launch_output(parser.add_argument_group("output and shutdown"))
    parser.add_argument(
        "-m", "--module", dest="module", action="store_true",
        help="run SCRIPT as a module, like python -m",
    )
    parser.add_argument("script", metavar="SCRIPT", help="a .py script, module or executable")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="script arguments")
    parser.set_defaults(handler=_run_launch)


def _add_launch_workers(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "-n",
        "--num-workers",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="num_workers",
        type=_at_least(1),
        required=True,
        metavar="N",
        help="number of workers (>= 1); --nproc-per-node is torchrun's name for it",
    )
    group.add_argument(
        "--port-base",
        type=int,
        metavar="P",
        help="use ports P, P+1, ... for the workers, or P for Horovod's rendezvous "
        "(default: free ports)",
    )
    group.add_argument(
        "--backend",
        choices=_LAUNCHABLE,
        default=_LAUNCHABLE[0],
        help="mwms: a TF_CONFIG per worker (default); horovod: serve Horovod's Gloo rendezvous "
        "and set horovodrun's HOROVOD_* variables, like `horovodrun --gloo` (needs horovod in "
        "this Python)",
    )


def _add_launch_cpus(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin workers to CPU cores"
    )
    group.add_argument(
        "--cpus-per-worker",
        type=_at_least(1),
        metavar="K",
        help="pin each worker to K consecutive cores (default: one core each)",
    )


def _add_launch_output(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=_at_least(0),
        default=0,
        metavar="N",
        help="after a preemption (workers exit 75 having saved their state) or a failure, start "
        "all workers again, at most N times (default: 0); not after exit code 78, one of "
        "tfdist's own errors in the script's set-up (a setting, the walltime margin), which "
        "every run would repeat",
    )
    group.add_argument(
        "--time-limit",
        type=_duration,
        metavar="DURATION",
        help="each run's walltime, as a Slurm job's: workers see its end (TFDIST_END_TIME), so "
        "that tfdist's walltime guard saves and exits 75 in time; at the end the launch stops "
        "them (SIGTERM, then SIGKILL after --grace-period). 90s, 10min, 2h, or sbatch "
        "--time's forms (a bare number is minutes)",
    )
    group.add_argument(
        "--grace-period",
        type=_seconds_or_zero,
        default=10.0,
        metavar="SECONDS",
        help="after a failure, SIGKILL workers still running this long after SIGTERM (default: 10)",
    )
    group.add_argument(
        "--no-prefix",
        dest="prefix",
        action="store_false",
        help="do not prefix output lines with [rank]",
    )
    group.add_argument(
        "--log-dir",
        metavar="DIR",
        help="also write each worker's output, unprefixed, to DIR/rank-<R>.log (DIR is created "
        "if missing; the files are emptied at the start and flushed as lines arrive, so they "
        "are complete when a worker fails or the launch is interrupted; the runs of "
        "--max-restarts follow one another)",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="start nothing: check the options and SCRIPT, then print for each worker its "
        "command, the variables the launch sets or unsets (TF_CONFIG, TFDIST_*, HOROVOD_*, "
        "PYTHONUNBUFFERED, as shell lines), its cores and the GPUs tfdist.init() would keep; "
        "exit 0",
    )


def _run_launch(args: argparse.Namespace) -> int:
    from tfdist.launch import build_command, launch

    command = build_command(args.script, args.args, module=args.module)
    return launch(
        command,
        args.num_workers,
        port_base=args.port_base,
        pin=args.pin,
        cpus_per_worker=args.cpus_per_worker,
        grace_period=args.grace_period,
        prefix=args.prefix,
        backend=args.backend,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        dry_run=args.dry_run,
        gpus_per_worker=args.gpus_per_worker,
        time_limit=args.time_limit,
    )


def _add_env(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "env", allow_abbrev=False,
        help="print the detected cluster environment and this process's plan",
        description="Print the cluster environment tfdist detects (rank, world size, ...), the "
        "backend it would choose and why, the GPUs this process would drive and the replicas "
        "it would train (one per GPU under MWMS and MirroredStrategy), and what tfdist doctor "
        "would warn of for this process alone, and the library patches that apply; every "
        "TFDIST_* variable is checked. Exits 1 when a setting is invalid or the plan has an "
        "error.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of name: value")
    parser.set_defaults(handler=_run_env)


def _run_env(args: argparse.Namespace) -> int:
    from tfdist.doctor import probe
    from tfdist.doctor.report import check
    from tfdist.env import detect

    environment = detect()
    plan = probe.report(environment)  # what tfdist doctor's table shows for this process
    if plan.errors:
        raise TfdistError(plan.errors[0])  # every TFDIST_* variable valid, or name it
    fields = {**dataclasses.asdict(environment), "backend": plan.backend,
              "backend_reason": plan.why, "collective": plan.collective or "none",
              "gpus": {"?": "counted by the framework", "": "none (CPU)"}.get(plan.gpus,
                                                                              plan.gpus),
              "replicas": plan.replicas, "cpus": plan.cpus, "host": plan.host,
              "versions": plan.versions}
    found = check([plan])  # the doctor's checks, for this rank
    problems = [problem.line() for problem in found]
    changed = _patches(plan, environment)
    if args.json:
        shown = [{"key": p.key, "target": p.target, "by": p.by, "installer": p.installer,
                  "when": p.when, "reason": p.reason} for p in changed]
        print(json.dumps({**fields, "patches": shown, "problems": problems}, indent=2,
                         default=str))
    else:
        print("\n".join(f"{name}: {value}" for name, value in fields.items()))
        print(f"patches: {len(changed)} change(s) to library internals here (tfdist/patches.py)")
        for patch in changed:
            print(f"  {patch.key}: {patch.target}\n    {patch.reason}")
        for line in problems:
            print(f"tfdist env: {line}", file=sys.stderr)
    return 1 if any(problem.severity == "error" for problem in found) else 0


def _patches(plan: Any, environment: Any) -> list[Any]:
    """The patches tfdist would apply in this process (:func:`tfdist.patches.planned`), from
    the launch as :func:`tfdist.init` would see it (the same :func:`tfdist.patches.where`)."""
    import os

    from tfdist import backend_facts as facts
    from tfdist import patches
    from tfdist.strategy import resolve_settings

    gpus = plan.node_gpus > 0 if plan.gpus == "?" else bool(plan.gpus)
    row = next(row for row in facts.BACKENDS  # TensorFlow's backends and Keras 3 on JAX's
               if row.name == plan.backend and row.framework != facts.TORCH)
    where = patches.where(row, plan.versions, os.environ, resolve_settings(),
                          several_processes=environment.world_size > 1, gpus=gpus)
    return patches.planned(where)


def _add_doctor(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "doctor", allow_abbrev=False,
        help="check a launch in seconds: every rank's plan, versions, ports, an all-reduce",
        description="Run it like the training, as its own step (`srun python -m tfdist "
        "doctor`, `tfdist launch -n 2 -m tfdist doctor`), or with --dry-run on a login node. "
        "Every rank reports its host, cores, GPUs, versions and network settings to rank 0 "
        "over TCP (rank 0's port, within --timeout); rank 0 checks them together and prints "
        "one table; then the engine starts as training will start it and a tiny all-reduce "
        "must finish within --timeout. A problem names the rank, the host and the fix; the "
        "step fails (rank 0 exits 1 once the ranks it stopped have exited 0).",
    )
    parser.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS",
                        help="deadline of each phase (default: 30; or 2min)")
    parser.add_argument("--bandwidth", type=_positive_float, default=0.0, metavar="MB",
                        help="also time all-reduces of MB megabytes and print the bus bandwidth")
    parser.add_argument("--expect-gbps", type=_positive_float, metavar="GB/S",
                        help="fail if the bus bandwidth is below this (default: warn below "
                        "5 GB/s for NCCL across nodes)")
    parser.add_argument("--framework", choices=("auto", "tf", "torch"), default="auto",
                        help="the engine to check (default: tf, Keras's, when TensorFlow is "
                        "installed, or JAX under KERAS_BACKEND=jax; else torch)")
    parser.add_argument("--backend", choices=setting("backend").choices,
                        help="the backend to start: TensorFlow's, or with --framework torch "
                        "auto, ddp, horovod, deepspeed (default: TFDIST_BACKEND, else auto)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no network: print this launch's plan and the checks one process "
                        "can make (versions, settings, interfaces, names)")
    parser.add_argument("--hosts", metavar="HOSTLIST",
                        help="with --dry-run: also resolve these nodes' names through "
                        "TFDIST_HOST_TEMPLATE, e.g. 'gpu[01-04]'")
    parser.add_argument("--model-dir", metavar="DIR",
                        help="also check the training's model_dir: every rank can write it "
                        "and sees the same folder (not node-local scratch), and no live run "
                        "holds it")
    parser.set_defaults(handler=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    from tfdist import doctor

    return doctor.run(doctor.Options(
        timeout_s=args.timeout, bandwidth_mb=args.bandwidth, expect_gbps=args.expect_gbps,
        framework=args.framework, backend=args.backend, dry_run=args.dry_run,
        hosts=args.hosts, model_dir=args.model_dir))


def _add_settings(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "settings", allow_abbrev=False,
        help="print every tfdist setting, its value here and where it came from",
        description="Print every setting (argument, environment variable, value, source) as "
        "this environment sets it; an invalid value is an error naming the allowed ones.",
    )
    parser.add_argument("--markdown", action="store_true",
                        help="print the reference table of docs/settings.md instead")
    parser.set_defaults(handler=_run_settings)


def _run_settings(args: argparse.Namespace) -> int:
    from tfdist import settings

    if args.markdown:
        print(settings.markdown_table())
        return 0
    rows = [(entry.variable, settings.shown(value), source)
            for entry, value, source in settings.current()]
    width = max(len(variable) for variable, _, _ in rows)
    for variable, value, source in rows:
        print(f"{variable:<{width}}  {value}  ({source})")
    return 0


def _add_job(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tfdist.jobs.cli import add_parser  # `tfdist job`: flag groups and handler live there

    add_parser(commands)


def _add_scaling(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "scaling", allow_abbrev=False,
        help="measure a script's scaling efficiency: throughput on N workers against N x one",
        description="Run SCRIPT under `tfdist launch -n N` for each size N, in increasing order "
        "(with --repeat K the sizes take turns K times), each with TFDIST_THROUGHPUT_FILE set to "
        "OUT/runs/n<N>-r<K>.jsonl, where the chief's throughput meter (dist.callbacks()) writes "
        "one line per epoch. Then write OUT/scaling.md, scaling.csv and, with matplotlib "
        "(tfdist[plot]), scaling.png: throughput, speed-up, efficiency and step time per size. "
        "A run's throughput is the median over its epochs after the first. The first run that "
        "fails ends it, showing its last lines. --report DIR only builds the report from "
        "DIR/runs (the Slurm job of `tfdist job --kind scaling` does that).",
        usage="tfdist scaling -n SIZES [options] (SCRIPT.py | -m MODULE) [ARGS ...]\n"
        "       tfdist scaling --report DIR",
    )
    parser.add_argument("-n", "--num-workers", metavar="SIZES",
                        help="the numbers of workers to measure, e.g. 1,2,4")
    parser.add_argument("--repeat", type=_at_least(1), default=1, metavar="K",
                        help="run every size K times, taking turns (1,2,1,2,...); the report "
                        "shows the median and the range (default: 1)")
    parser.add_argument("--out", metavar="DIR",
                        help="folder of the runs and the report (default: scaling-DATE-TIME)")
    parser.add_argument("--timeout", type=_seconds, default=3600.0, metavar="SECONDS",
                        help="stop a run that takes longer, and end there (default: 3600)")
    parser.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                        help="one more option for tfdist launch, e.g. --launch-arg=--no-pin "
                        "(repeat)")
    parser.add_argument("--report", metavar="DIR",
                        help="run nothing: write the report of the runs in DIR/runs")
    parser.add_argument(
        "-m", dest="module", action="store_true", help="run SCRIPT as a module, like python -m"
    )
    parser.add_argument("script", metavar="SCRIPT", nargs="?",
                        help="a .py script, module or executable")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="script arguments")
    parser.set_defaults(handler=_run_scaling)


def _run_scaling(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from tfdist import scaling

    if args.report is not None:
        if args.script or args.num_workers:
            raise TfdistError("--report DIR builds the report from DIR/runs and runs nothing; "
                              "leave out -n and SCRIPT, or leave out --report to measure")
        return scaling.report_only(Path(args.report))
    if not args.num_workers or not args.script:
        raise TfdistError("give the sizes and the script: tfdist scaling -n 1,2,4 SCRIPT.py "
                          "[ARGS ...] (or --report DIR to report earlier runs)")
    out = args.out or time.strftime("scaling-%Y%m%d-%H%M%S")
    return scaling.run(scaling.Options(
        sizes=scaling.parse_sizes(args.num_workers), target=args.script, args=tuple(args.args),
        out_dir=Path(out), repeat=args.repeat, timeout_s=args.timeout,
        launch_args=tuple(args.launch_arg), module=args.module))


def _add_survive(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "survive", allow_abbrev=False,
        help="in a job script: run the training's srun step, and again on the nodes left "
        "after one dies",
        description="Run `srun [options] PROGRAM` over the job's nodes with explicit counts "
        "and --overlap. When a task fails, ask every node with a one-task step; a node that "
        "does not answer is dropped and the step starts again on the others (from the last "
        "save), while at least --min-nodes are left and at most --restarts times; else exit "
        "75 (the job script requeues the job). A failure with every node answering ends it "
        "with srun's code. The job needs `sbatch --no-kill` to outlive a node "
        "(tfdist job's min_nodes renders both).",
        usage="tfdist survive --min-nodes M --tasks-per-node T [options] -- srun [OPTIONS] "
        "PROGRAM [ARGS ...]",
    )
    parser.add_argument("--min-nodes", type=_at_least(1), required=True, metavar="M",
                        help="go on while at least M nodes answer")
    parser.add_argument("--tasks-per-node", type=_at_least(1), required=True, metavar="T",
                        help="srun tasks on each node (the job's --ntasks-per-node)")
    parser.add_argument("--restarts", type=_at_least(0), default=3, metavar="R",
                        help="restart the step at most R times: on the nodes that answer, or on "
                        "the same ones after a task failed on a healthy node (default: 3)")
    parser.add_argument("--probe-timeout", type=_seconds, default=30.0,
                        metavar="SECONDS", help="a node that has not run a one-task step "
                        "within this is taken for lost (default: 30)")
    parser.add_argument("--probe-again", type=_seconds, default=30.0, metavar="SECONDS",
                        help="while training runs, ask the lost nodes again this often: one "
                        "that answers is a spare, or rejoins the step at its next save when it "
                        "runs short (default: 30)")
    parser.add_argument("--spares", type=_at_least(0), default=0, metavar="K",
                        help="the job's last K nodes wait idle; a lost node's place goes to one "
                        "of them, so the step starts again as large as before (default: 0)")
    parser.add_argument("srun", nargs=argparse.REMAINDER, metavar="-- srun ...",
                        help="the training's srun command")
    parser.set_defaults(handler=_run_survive)


def _run_survive(args: argparse.Namespace) -> int:
    import os

    from tfdist import survive
    from tfdist.env.slurm import job_allocation

    srun = args.srun[1:] if args.srun[:1] == ["--"] else args.srun
    survive.check_place(os.environ)
    job_id, nodes = job_allocation(os.environ)
    if args.spares >= len(nodes):
        raise TfdistError(f"--spares {args.spares} leaves none of the job's {len(nodes)} nodes "
                          "to train on")
    if args.min_nodes > len(nodes) - args.spares:
        raise TfdistError(f"--min-nodes {args.min_nodes} is more than the "
                          f"{len(nodes) - args.spares} of the job's {len(nodes)} nodes that "
                          f"train (--spares {args.spares})")
    survive.step_command(srun, nodes, args.tasks_per_node)  # refuses a command without srun
    return survive.run(survive.Options(
        job_id=job_id, nodes=tuple(nodes), min_nodes=args.min_nodes,
        max_restarts=args.restarts, tasks_per_node=args.tasks_per_node,
        probe_timeout_s=args.probe_timeout, spares=args.spares,
        return_probe_s=args.probe_again, slurmd=survive.slurmd_addresses(nodes)), srun)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _duration(text: str, bare: str = "min") -> float:
    """``--time-limit``'s seconds (:func:`tfdist.durations.parse_duration`; a bare number is
    minutes, as sbatch --time's)."""
    from tfdist.durations import parse_duration

    try:
        return parse_duration(text, bare=bare)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds_or_zero(text: str) -> float:
    """:func:`_seconds`, where a bare number may be 0 (or less: checked where it is used)."""
    try:
        return float(text)
    except ValueError:
        return _seconds(text)


def _seconds(text: str) -> float:
    """A SECONDS option: every duration's forms (``90s``, ``10min``, ``2h``), a bare number of
    seconds (the one dialect of durations: the settings read them alike)."""
    return _duration(text, bare="s")
