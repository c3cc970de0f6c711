"""Every setting a user can give tfdist, in one table: argument, variable, parser, default.

Precedence, highest first: the Python argument (examples pass a flag as the argument only when
the user gave it), then the environment variable, then the default (``None`` where the cluster
implies the value). :func:`resolve` applies that order and validates the result, so every
setting is parsed one way: ``TFDIST_SYNC_CHECK=false`` and ``TFDIST_KERAS_FIX=false`` both turn
their feature off, and a typo names the setting, the variable and the allowed values.

Launch protocol variables that ``tfdist launch`` writes for its workers (``TFDIST_LAUNCHER``,
``TFDIST_LOCAL_RANK``...) are not settings: :mod:`tfdist.env` reads them with the launchers'.

Pure: no TensorFlow, no torch. docs/settings.md's table is checked against :data:`SETTINGS`
(``tests/test_settings.py``).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tfdist.backend_facts import BACKENDS
from tfdist.durations import parse_duration
from tfdist.errors import ConfigError

__all__ = ["SETTINGS", "Setting", "current", "flag", "markdown_table", "resolve", "setting",
           "shown", "skipped_patches"]

logger = logging.getLogger("tfdist")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, any case.

    Raises:
        ValueError: anything else.
    """
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("use 1 (on) or 0 (off)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("is not an integer") from None
    if value < 1:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("is not an integer") from None
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def _duration(text: str) -> float:
    """Every duration setting's one dialect (:func:`tfdist.durations.parse_duration`): ``90s``,
    ``10min``, ``2h``, ``1d``, or a bare number of seconds."""
    try:
        return parse_duration(text, bare="s")
    except ValueError:
        raise ValueError("is no positive duration: write 90s, 10min, 2h or 1d (a bare number "
                         "is seconds)") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError("is not an integer") from None
    if not 1024 <= value <= 65535:
        raise ValueError("must be a port in 1024..65535")
    return value


def _host_template(text: str) -> str:
    if "{host}" not in text:
        raise ValueError("must contain '{host}', e.g. '{host}-ib0' to reach each node through "
                         "its InfiniBand name")
    return text


def _text(text: str) -> str:
    return text.strip()


def _patch_keys(text: str) -> tuple[str, ...]:
    """Comma-separated keys of :data:`tfdist.patches.INVENTORY`, as a tuple.

    Raises:
        ValueError: a key that is no row, naming the rows.
    """
    from tfdist.patches import INVENTORY

    keys = tuple(dict.fromkeys(key.strip() for key in text.split(",") if key.strip()))
    known = [patch.key for patch in INVENTORY]
    unknown = [key for key in keys if key not in known]
    if unknown:
        raise ValueError(f"names no patch: {', '.join(unknown)}; the patches are "
                         f"{', '.join(known)}")
    return keys


def catchable_signal(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` as a signal a process can catch.

    Raises:
        ValueError: not a signal, or one that cannot be caught; the message says which to use.
    """
    name = text.strip().upper()
    try:
        found = signal.Signals(int(name)) if name.isdigit() else signal.Signals[
            name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ValueError("is not a signal: use a name such as USR2 or SIGUSR2, or a "
                         "number") from None
    if found in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"names {found.name}, which cannot be caught: use USR1, USR2 or TERM")
    return found


def _signal(text: str) -> str:
    catchable_signal(text)
    return text.strip()


@dataclass(frozen=True)
class Setting:
    """One user setting.

    Attributes:
        name: the key tfdist uses for it.
        variable: the environment variable.
        parse: text -> value; raises ``ValueError`` with what is wrong.
        default: the value when neither argument nor variable is given; ``None`` means "derived
            from the cluster" (or off).
        choices: the allowed values of a choice (compared in lower case).
        argument: where a script passes it (``"init(backend=)"``), or ``""`` for variable only.
        doc: one line for docs/settings.md's table.
        aliases: older variable names still read, with a warning naming the new one.
    """

    name: str
    variable: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    argument: str = ""
    aliases: tuple[str, ...] = ()

    def convert(self, raw: Any, source: str) -> Any:
        """Parses and validates ``raw`` (text from ``source``, or a Python value)."""
        if self.choices:
            value = str(raw).strip().lower()
            if value not in self.choices:
                raise ConfigError(f"{self.name} {value!r} is not one of {self.choices} "
                                  f"({self._where()})")
            return value
        if isinstance(raw, str):
            try:
                return self.parse(raw)
            except ValueError as error:
                raise ConfigError(f"{source}={raw!r} {error} ({self._where()})") from None
        try:
            return self.parse(str(raw)) if raw is not None else None
        except ValueError as error:
            raise ConfigError(f"{self.name}={raw!r} {error} ({self._where()})") from None

    def _where(self) -> str:
        return (f"argument `{self.argument}` or {self.variable}" if self.argument
                else f"environment variable {self.variable}")


def _choice(name: str, variable: str, choices: tuple[str, ...], doc: str,
            argument: str = "", aliases: tuple[str, ...] = ()) -> Setting:
    return Setting(name, variable, str.lower, choices[0], doc, choices, argument, aliases)


SETTINGS: tuple[Setting, ...] = (
    _choice("backend", "TFDIST_BACKEND",
            ("auto", *dict.fromkeys(row.name for row in BACKENDS)),
            "the data-parallel engine. TensorFlow (`init`): `auto`, `mwms`, `horovod`, "
            "`mirrored`, `single`; `auto`: Horovod under horovodrun/mpirun, else MWMS when "
            "several processes were launched, else one process: MirroredStrategy over its GPUs "
            "when it sees several (`mirrored`), else TensorFlow's default strategy (`single`). "
            "Keras 3 on JAX (`KERAS_BACKEND=jax`): `auto` or `jax`, Keras's DataParallel over "
            "every process's devices. PyTorch (`tfdist.torch.init`): `auto`, `ddp`, `horovod`, "
            "`deepspeed`; `auto`: Horovod under horovodrun or mpirun without `MASTER_ADDR`, "
            "else DDP",
            "init(backend=), tfdist.torch.init(backend=)"),
    _choice("collective", "TFDIST_COLLECTIVE", ("auto", "ring", "nccl"),
            "MWMS all-reduce; `auto`: NCCL with GPUs, ring on CPU", "init(collective=)"),
    Setting("collective_timeout", "TFDIST_COLLECTIVE_TIMEOUT", _duration, None,
            "seconds an MWMS collective waits for the other ranks, then fails with a tfdist "
            "line: for a rank alive but stuck, which the heartbeat does not catch; default: "
            "wait forever. Set it above the longest time one rank may work alone (the chief "
            "saving, a first trace)", argument="init(collective_timeout=)"),
    Setting("heartbeat_timeout", "TFDIST_HEARTBEAT_TIMEOUT", _duration, 30.0,
            "seconds a rank's process may send no heartbeat before every rank stops with a "
            "line naming it (stopped, frozen, cut off or dead). MWMS: TensorFlow's coordination "
            "service (TensorFlow's own default, 10 s, fails ranks that are only starved of CPU); "
            "Horovod on Gloo and the torch shim: tfdist's heartbeat through the rendezvous' "
            "store (torch: at most half TFDIST_TORCH_TIMEOUT). The heartbeat is a thread of its "
            "own, so a rank that computes, saves or evaluates alone keeps beating"),
    Setting("peer_watch", "TFDIST_PEER_WATCH", _duration, 10.0,
            "MWMS on several nodes: a rank whose host has not answered a TCP connection to its "
            "port for this long (a dead node, a cut network; a busy or stopped process still "
            "answers) is named and this rank exits, so `tfdist survive` starts again sooner "
            "than the heartbeat's verdict; `0`: off"),
    Setting("threads", "TFDIST_NUM_THREADS", _positive_int, None,
            "TensorFlow (and torch) threads; default: the cores this process is pinned to; "
            "unpinned beside other ranks on the machine (srun without CPU binding, horovodrun, "
            "`mpirun --bind-to none`), the machine's cores divided by the ranks on it; unset "
            "where `OMP_NUM_THREADS` (torch) or `TF_NUM_INTRAOP_THREADS` (TensorFlow) is, "
            "which the framework reads",
            argument="init(threads=)"),
    Setting("port_base", "TFDIST_PORT_BASE", _port, None,
            "first port on each node; default: derived from the Slurm job and step id "
            "(20000-32767)"),
    Setting("host_template", "TFDIST_HOST_TEMPLATE", _host_template, "{host}",
            "address to dial for each node, e.g. `{host}-ib0` for the InfiniBand interface"),
    Setting("skip_patches", "TFDIST_SKIP_PATCHES", _patch_keys, None,
            "patches of Keras, TensorFlow or Horovod internals to leave out, comma-separated "
            "keys of tfdist's inventory (`tfdist env` lists those of the launch; "
            "docs/architecture.md all of them), e.g. `keras3-step-logs,input-end-check`: to "
            "reproduce an upstream bug, or to rule a patch out; default: none"),
    Setting("keras_fix", "TFDIST_KERAS_FIX", flag, True,
            "deprecated, still read: `0` is `TFDIST_SKIP_PATCHES=keras3-symbolic-build,"
            "keras3-reduce-per-replica,keras3-steps-per-execution,keras3-epoch-chunks,"
            "keras3-step-logs` (the Keras 3 multi-worker `fit` fix off, to reproduce the "
            "upstream bug)"),
    _choice("step_logs", "TFDIST_STEP_LOGS", ("auto", "global", "local"),
            "Keras 3 on several MWMS workers: what each step's logs hold. `global` averages "
            "them over the workers every step (a collective per step, as Keras does), `local` "
            "keeps each worker's own until the epoch's end, which is always global; `auto`: "
            "local unless a callback of yours reads per-step logs"),
    Setting("verbose", "TFDIST_VERBOSE", flag, None,
            "`1` shows TensorFlow's start-up lines and C++ INFO logs on every rank, and every "
            "rank's Keras/TensorFlow warnings; `0` hides them; default: hidden unless you set "
            "`TF_CPP_MIN_LOG_LEVEL` yourself"),
    Setting("traceback", "TFDIST_TRACEBACK", flag, None,
            "`1`: one of tfdist's own errors that ends a script prints Python's traceback too "
            "(`TFDIST_VERBOSE=1` as well); default: its one line, `tfdist: <message>` (exit "
            "code 78)"),
    Setting("throughput_file", "TFDIST_THROUGHPUT_FILE", _text, None,
            "the file the chief appends one JSON line per epoch to (throughput, step time); "
            "default: `model_dir/throughput.jsonl` with a model_dir, else none (the log line "
            "stays)"),
    _choice("input_end_check", "TFDIST_INPUT_END_CHECK", ("auto", "always"),
            "deprecated, still read: `always` is `TFDIST_SKIP_PATCHES=input-end-check` "
            "(MWMS keeps tf.distribute's per-step check that every worker still has a batch, "
            "a collective per step, also where every worker provably gets the same number of "
            "batches)"),
    _choice("input_iterator", "TFDIST_INPUT_ITERATOR", ("auto", "tensorflow"),
            "deprecated, still read: `tensorflow` is `TFDIST_SKIP_PATCHES=host-input-iterator` "
            "(an MWMS worker whose one replica is its CPU reads a distributed dataset through "
            "TensorFlow's multi-device iterator, not a plain tf.data one)"),
    _choice("iterator_free", "TFDIST_ITERATOR_FREE", ("thread", "tensorflow"),
            "deprecated, still read: `tensorflow` is `TFDIST_SKIP_PATCHES=iterator-free-thread` "
            "(a tf.data iterator is freed where TensorFlow frees it, on the thread that drops "
            "it, not on a thread of tfdist's own)"),
    Setting("sync_check", "TFDIST_SYNC_CHECK", flag, True,
            "the replica sync check; `0` turns it off", argument="callbacks(sync_check=)"),
    Setting("batch_statistics", "TFDIST_AVERAGE_BATCH_STATISTICS", flag, True,
            "average BatchNormalization's moving statistics over the ranks at each epoch's end, "
            "so that every rank holds the same model; `0` leaves each rank its own",
            argument="callbacks(average_batch_statistics=)"),
    Setting("cpu_replicas", "TFDIST_CPU_REPLICAS", _positive_int, None,
            "split each process's CPU into N logical devices and train one replica on each, "
            "as on N GPUs: the CPU stand-in for several GPUs per process (MirroredStrategy in "
            "one process, MWMS per worker) for tests and laptops; ignored where GPUs are "
            "visible, and by Horovod"),
    Setting("sync_check_every", "TFDIST_SYNC_CHECK_EVERY", _positive_int, None,
            "also compare the ranks' weights every N steps",
            argument="callbacks(sync_check_every=)"),
    _choice("horovod_controller", "TFDIST_HOROVOD_CONTROLLER", ("auto", "gloo", "mpi"),
            "Horovod under srun; `auto`: MPI when srun's PMIx/PMI started the step"),
    Setting("horovod_start_timeout", "TFDIST_HOROVOD_START_TIMEOUT", _duration, 120.0,
            "seconds the ranks wait for rank 0's Gloo rendezvous under srun"),
    Setting("horovod_gloo_timeout", "HOROVOD_GLOO_TIMEOUT_SECONDS", _positive_int, 120,
            "Horovod's own: seconds Gloo's rendezvous and collectives wait (tfdist's default "
            "120, Horovod's 30)"),
    Setting("horovod_gloo_iface", "HOROVOD_GLOO_IFACE", _text, None,
            "Horovod's own: network interface for Gloo; default: `lo` on one node, else the "
            "address the host name resolves to"),
    _choice("torch_collective", "TFDIST_TORCH_COLLECTIVE", ("auto", "nccl", "gloo"),
            "torch process group; `auto`: NCCL with CUDA, gloo on CPU; `nccl` without CUDA "
            "falls back to gloo with a warning", "tfdist.torch.init(collective=)",
            aliases=("TFDIST_TORCH_BACKEND",)),
    Setting("torch_timeout", "TFDIST_TORCH_TIMEOUT", _duration, 600.0,
            "seconds the torch rendezvous and each collective wait for the other ranks; a "
            "stopped rank is named sooner, by tfdist's heartbeat, after half of it (at most 30 s)",
            argument="tfdist.torch.init(timeout=)"),
    Setting("deepspeed_config", "TFDIST_DEEPSPEED_CONFIG", _text, None,
            "tfdist.torch with backend `deepspeed`: a DeepSpeed JSON config (a file's path, or "
            "the JSON itself) merged over tfdist's (ZeRO stage 2, fp32, your optimizer as it "
            "is, no gradient clipping, the micro batch from `dist.loader`)",
            argument="dist.wrap(config=)"),
    Setting("preempt_signal", "TFDIST_PREEMPT_SIGNAL", _signal, None,
            "one more signal that asks for a checkpoint and a stop, besides SIGTERM and SIGUSR1 "
            "(e.g. `USR2`)"),
    Setting("max_requeues", "TFDIST_MAX_REQUEUES", _non_negative_int, 20,
            "after a preemption tfdist requeues a Slurm job with `scontrol requeue` while "
            "`SLURM_RESTART_COUNT` is below this"),
    Setting("requeue_if_batch_lost", "TFDIST_REQUEUE_IF_BATCH_LOST", flag, False,
            "`1`: a task of a Slurm job whose peers on the node of the job's batch script "
            "failed asks that node with a one-task step and, when it does not answer, requeues "
            "the job (`scontrol requeue`): the step loop (`tfdist survive`) ran there, and "
            "without it the job would idle to its time limit. `tfdist job` sets it in jobs "
            "with `min_nodes` and `requeue`"),
    Setting("checkpoint_every", "TFDIST_CHECKPOINT_EVERY", _duration, None,
            "with `dist.callbacks(model_dir=...)` or `dist.preemption()`: every rank saves the "
            "same exact state as for a preemption at one agreed step this often (`90s`, `10min`, "
            "`2h`; a bare number is seconds), and at each epoch's end, so a hard kill (out of "
            "memory, a dead node, SIGKILL) loses at most this much; default: off",
            argument="callbacks(checkpoint_every=)"),
    Setting("background_saves", "TFDIST_BACKGROUND_SAVES", flag, False,
            "`1`: `fit`'s safety saves and epoch-end states (`TFDIST_CHECKPOINT_EVERY`, "
            "model_dir) are written in the background: the step waits for a copy of the state "
            "in host memory, the files are written, made durable and committed while training "
            "goes on, one save in flight; the save at a signal or the walltime waits for the "
            "one in flight and is written the same way (the state's raw bytes, several times "
            "faster than Keras's file). Keras 3 and tf_keras; a custom loop's "
            "`dist.save_state` (Keras models, optimizers, variables); the torch shim's `dist.save` "
            "(a copy in host memory, the file written on a thread of its own; "
            "`dist.exit_preempted` and the end of `distributed()` wait for it); default: off"),
    Setting("signal_lead", "TFDIST_SIGNAL_LEAD", _duration, None,
            "seconds between the signal that stops a run (sbatch `--signal=USR1@N`'s N, a "
            "partition's GraceTime) and its kill: a save of the run's state that would not fit "
            "is named, with the fix, after the first save and by `tfdist doctor --model-dir`; "
            "`tfdist job` sets it from `signal`; default: unknown (not checked)"),
    Setting("walltime_margin", "TFDIST_WALLTIME_MARGIN", _duration, None,
            "seconds before the run's end (Slurm's time limit, `tfdist launch --time-limit`) at "
            "which every rank stops at one step, saves its exact state and exits 75 to be "
            "requeued, with no signal needed; default: twice the longest save timed plus twice "
            "the time between two agreements plus 10 s, at least 60 s. A margin that leaves a "
            "run no time past its first step is refused there, on every rank (exit code 78: "
            "not requeued, not restarted)"),
    Setting("preempt_check_seconds", "TFDIST_PREEMPT_CHECK_SECONDS", _duration, 1.0,
            "about how often the ranks agree whether one of them was signalled (one tiny "
            "collective each time); the step interval follows the measured step time",
            argument="dist.preemption(check_seconds=)"),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    """The setting called ``name``."""
    return _BY_NAME[name]


def resolve(name: str, argument: Any = None, environ: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name``: ``argument``, else its variable, else its default.

    Args:
        name: a name from :data:`SETTINGS`.
        argument: the value a script passed, or None.
        environ: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: the value is invalid; the message names the setting, where it came from
            and what is allowed.
    """
    entry = _BY_NAME[name]
    if argument is not None:
        return entry.convert(argument, entry.argument or entry.variable)
    environ = os.environ if environ is None else environ
    for variable in (entry.variable, *entry.aliases):
        raw = environ.get(variable, "")
        if raw.strip():
            if variable != entry.variable:
                logger.warning("tfdist: %s is deprecated: set %s instead", variable,
                               entry.variable)
            return entry.convert(raw, variable)
    return entry.default


# The per-patch switches TFDIST_SKIP_PATCHES replaced: setting -> (the value that leaves the
# patches out, their keys). Still read, each with one deprecation line naming the new form.
_PATCH_SWITCHES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "keras_fix": (False, ("keras3-symbolic-build", "keras3-reduce-per-replica",
                          "keras3-steps-per-execution", "keras3-epoch-chunks",
                          "keras3-step-logs")),
    "input_end_check": ("always", ("input-end-check",)),
    "input_iterator": ("tensorflow", ("host-input-iterator",)),
    "iterator_free": ("tensorflow", ("iterator-free-thread",)),
}
_deprecated: set[str] = set()  # the old switches warned about in this process


def skipped_patches(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The rows of :data:`tfdist.patches.INVENTORY` to leave out: ``TFDIST_SKIP_PATCHES``'s,
    and those an old per-patch switch turns off (``TFDIST_KERAS_FIX=0``,
    ``TFDIST_INPUT_END_CHECK=always``, ``TFDIST_INPUT_ITERATOR=tensorflow``,
    ``TFDIST_ITERATOR_FREE=tensorflow``), each old switch set named once a process in a
    deprecation line with its new form.

    Raises:
        ConfigError: a key that is no row (the message lists them), or an invalid value of an
            old switch.
    """
    environ = os.environ if environ is None else environ
    skip = set(resolve("skip_patches", environ=environ) or ())
    for name, (off, keys) in _PATCH_SWITCHES.items():
        variable = _BY_NAME[name].variable
        raw = environ.get(variable, "").strip()
        if not raw:
            continue
        if resolve(name, environ=environ) == off:
            skip.update(keys)
        if variable not in _deprecated:
            _deprecated.add(variable)
            logger.warning("tfdist: %s=%s is deprecated (it still works): "
                           "TFDIST_SKIP_PATCHES=%s leaves those patches out, and without "
                           "either they are in", variable, raw, ",".join(keys))
    return frozenset(skip)


def markdown_table() -> str:
    """docs/settings.md's table, one row per setting (``tfdist settings --markdown``)."""
    rows = ["| argument | environment | default | meaning |", "|---|---|---|---|"]
    for entry in SETTINGS:
        argument = f"`{entry.argument}`" if entry.argument else ""
        default = "" if entry.default is None else f"`{_shown(entry.default)}`"
        choices = ", ".join(f"`{c}`" for c in entry.choices)
        meaning = f"{choices}: {entry.doc}" if choices else entry.doc
        if entry.aliases:
            meaning += f" (old name: {', '.join(f'`{a}`' for a in entry.aliases)})"
        rows.append(f"| {argument} | `{entry.variable}` | {default} | {meaning} |")
    return "\n".join(rows)


def current(environ: Mapping[str, str] | None = None) -> list[tuple[Setting, Any, str]]:
    """Every setting's value in ``environ`` (default ``os.environ``) and where it came from.

    Raises:
        ConfigError: a variable holds an invalid value.
    """
    environ = os.environ if environ is None else environ
    result = []
    for entry in SETTINGS:
        given = [v for v in (entry.variable, *entry.aliases) if environ.get(v, "").strip()]
        result.append((entry, resolve(entry.name, environ=environ),
                       given[0] if given else "default"))
    return result


def shown(value: Any) -> str:
    """``value`` as docs/settings.md and ``tfdist settings`` write it."""
    if value is None:
        return "-"
    return _shown(value)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):  # TFDIST_SKIP_PATCHES's keys
        return ",".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)

