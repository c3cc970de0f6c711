"""The plan of ``dist.callbacks()``: which callbacks, in which order, for every Keras (pure).

:func:`plan` reads the options (:class:`CallbackOptions`), what the handle knows
(:class:`Facts`: its row of the backend table, its ranks and replicas, the Keras in use, what is
installed) and the settings' variables, and returns the steps. Each Keras turns a step into
its own callback classes (:func:`tfdist.keras.callbacks.build` for TensorFlow's Keras: Keras 3
on TensorFlow and tf_keras; :func:`tfdist.jax.callbacks.build` for Keras 3 on JAX) and
:func:`assemble` puts them in the plan's order. An option the Keras in use cannot honour is
refused here, before anything is made, in one line with the reason and the fix; so is an option
another option turns off. :func:`route` says how a user's own writer runs on a rank.

It imports no framework.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tfdist import model_dir as layout
from tfdist.backend_facts import Backend
from tfdist.errors import ConfigError
from tfdist.settings import resolve

__all__ = ["KERAS3", "KERAS3_JAX", "KINDS", "TF_KERAS", "CallbackOptions", "Facts", "Plan",
           "Step", "assemble", "options", "plan", "route"]

# The Keras in use (``Facts.keras``).
KERAS3, TF_KERAS, KERAS3_JAX = "Keras 3 on TensorFlow", "tf_keras", "Keras 3 on JAX"

# The steps, in the order :func:`plan` puts them (a step is left out where it has nothing to do).
BACKEND = "backend"  # the backend's own first (Horovod: the broadcast from rank 0)
BATCH_STATISTICS = "batch_statistics"  # first at an epoch's end: later ones see the mean
BACKUP = "backup"  # Keras's BackupAndRestore, a folder per rank
WARMUP = "warmup"
YOURS = "yours"  # the callbacks given, each routed (:func:`route`)
SYNC_CHECK = "sync_check"  # after yours: it sees their changes
CHIEF_ONLY = "chief_only"
CHECKPOINT = "checkpoint"
TENSORBOARD = "tensorboard"
PREEMPTION = "preemption"  # after the writers: a stop at an epoch's end comes after its backup
THROUGHPUT = "throughput"
SILENT_PROGRESS_BAR = "silent_progress_bar"  # on the other ranks: the chief's bar alone
# First of all: the step a rank stood at, for the line naming a failed peer.
PROGRESS = "progress"
KINDS = (PROGRESS, BACKEND, BATCH_STATISTICS, BACKUP, WARMUP, YOURS, SYNC_CHECK, CHIEF_ONLY,
         CHECKPOINT, TENSORBOARD, PREEMPTION, THROUGHPUT, SILENT_PROGRESS_BAR)

# How a user's writer runs on a rank (:func:`route`).
AS_GIVEN, PER_RANK, CHIEF_WRITES, CHIEF_ALONE = ("as given", "a folder per rank",
                                                 "the chief writes", "the chief alone")
# What a user's callback is (:func:`route`'s first argument).
BACKUP_WRITER, FILE_WRITER = "BackupAndRestore", "file writer"


@dataclass(frozen=True)
class CallbackOptions:
    """The options of ``dist.callbacks(**options)``, the same for every Keras.

    Attributes:
        model_dir: where outputs go (:mod:`tfdist.model_dir`); without it only warmup,
            progress and the callbacks given are set up.
        checkpoint: save ``model_dir/checkpoint.keras`` after each epoch (chief only, atomic).
        tensorboard: write TensorBoard logs to ``model_dir/logs`` (chief only).
        backup: save at each epoch's end so that a run killed without warning (SIGKILL, a
            lost node) resumes there: the exact state of the preemption checkpoint (with
            ``preempt`` on, where tfdist follows ``fit``'s input: the resumed run ends
            bit-identical), else Keras's BackupAndRestore in ``model_dir/backup``, per rank.
        warmup_epochs: ramp the learning rate up from ``lr / num_replicas`` over this many
            epochs.
        chief_only: more callbacks to run on the chief only. The file writers tfdist knows
            (``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``) run as :func:`route` says;
            others must not run collectives (no ``model.save``, no metric reads).
        sync_check: compare the weights of all ranks after the first step and at the end of
            training, and stop with ReplicaMismatchError naming the ranks that differ
            (:class:`tfdist.sync.ReplicaSyncCheck`); env ``TFDIST_SYNC_CHECK`` (1/0), default on.
        sync_check_every: also check every N steps; env ``TFDIST_SYNC_CHECK_EVERY``.
        preempt: with ``model_dir``, stop every rank at one agreed step after SIGTERM, SIGUSR1
            or ``TFDIST_PREEMPT_SIGNAL``, save the state in ``model_dir/preempted`` and exit
            with code 75 (:class:`tfdist.keras.fit_preemption.PreemptionCallback`).
        average_batch_statistics: at each epoch's end, replace each rank's BatchNormalization
            moving statistics by their mean over the ranks, before anything saves or compares
            (:class:`tfdist.keras.batch_statistics.BatchStatisticsAverage`); env
            ``TFDIST_AVERAGE_BATCH_STATISTICS``, default on. Keras 3 on JAX refuses ``True``:
            its statistics are one array over every device, the same everywhere.
        throughput: measure examples per second and step time
            (:class:`tfdist.throughput.StepMeter`): one log line per epoch on the chief,
            and one JSON line in ``TFDIST_THROUGHPUT_FILE`` or ``model_dir/throughput.jsonl``.
        global_batch: examples per step over all workers, for the meter; default: the batch
            size of the dataset given to ``dist.shard``.
        checkpoint_every: with ``model_dir``, a safety save of the same exact state as for a
            preemption at one agreed step this often (seconds, or ``"10min"``), and at each
            epoch's end, training going on; env ``TFDIST_CHECKPOINT_EVERY``, default off.
    """

    model_dir: str | None = None
    checkpoint: bool = True
    tensorboard: bool = True
    backup: bool = True
    warmup_epochs: float = 0
    chief_only: tuple[Any, ...] = ()
    sync_check: bool | None = None
    sync_check_every: int | None = None
    preempt: bool = True
    average_batch_statistics: bool | None = None
    throughput: bool = True
    global_batch: int | None = None
    checkpoint_every: float | str | None = None


def options(**given: Any) -> CallbackOptions:
    """``given`` as :class:`CallbackOptions`.

    Raises:
        TypeError: an option it does not have; the message names the nearest and lists them.
    """
    known = [f.name for f in fields(CallbackOptions)]
    for name in given:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else "."
            raise TypeError(f"dist.callbacks() has no option {name!r}{hint} Its options: "
                            f"{', '.join(known)}")
    return CallbackOptions(**given)


@dataclass(frozen=True)
class Facts:
    """What the plan reads of the handle and the process.

    Attributes:
        backend: the handle's row of the backend table (``dist.facts``).
        keras: the Keras in use: :data:`KERAS3`, :data:`TF_KERAS` or :data:`KERAS3_JAX`.
        rank, world_size, num_replicas: the handle's.
        save_on_every_rank: a save may run collectives, so every rank runs it (the handle's).
        strategy_spans_workers: a tf.distribute strategy over several workers, whose workers
            tf_keras's BackupAndRestore keeps apart itself.
        input_tracked: tfdist follows ``fit``'s input (:func:`tfdist.keras.input_position.tracked`),
            so the preemption's exact state can replace Keras's backup.
        tensorboard_missing: the packages TensorBoard's logs need that are not installed.
        sync_check_readable: :mod:`tfdist.sync` can read this Keras's variables (it needs
            TensorFlow installed).
    """

    backend: Backend
    keras: str
    rank: int = 0
    world_size: int = 1
    num_replicas: int = 1
    save_on_every_rank: bool = False
    strategy_spans_workers: bool = False
    input_tracked: bool = True
    tensorboard_missing: tuple[str, ...] = ()
    sync_check_readable: bool = True

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Step:
    """One step of a plan: its kind (one of :data:`KINDS`) and what the Keras's class takes."""

    kind: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The steps in order, and the lines the chief logs about what was left out (level, text)."""

    steps: tuple[Step, ...]
    notes: tuple[tuple[int, str], ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(step.kind for step in self.steps)

    def __getitem__(self, kind: str) -> Step:
        for step in self.steps:
            if step.kind == kind:
                return step
        raise KeyError(kind)


def plan(o: CallbackOptions, facts: Facts, extra: Sequence[Any] = (),
         environ: Mapping[str, str] | None = None) -> Plan:
    """The callbacks of ``dist.callbacks(*extra, **options)`` on a rank with ``facts``.

    Args:
        o: the options.
        facts: the handle's and the process's.
        extra: the user's callbacks (step :data:`YOURS`).
        environ: where the settings' variables are read (default ``os.environ``).

    Raises:
        ConfigError: an option this Keras cannot honour, or one another option turns off.
    """
    _refuse(o, facts)
    model_dir = o.model_dir
    notes: list[tuple[int, str]] = []
    averaged = _averages(o, facts, environ)
    exact = bool(model_dir and o.preempt and facts.input_tracked)
    # The step a rank stood at first, before any callback's collective: a peer lost during a
    # save (or the backend's averaging) is reported after the step just trained.
    steps = [Step(PROGRESS)] if facts.keras != KERAS3_JAX else []  # JAX: no failure line
    steps.append(Step(BACKEND))
    steps += [Step(BATCH_STATISTICS)] if averaged else []
    if model_dir and o.backup and not exact:
        steps.append(Step(BACKUP, {"path": layout.path(model_dir, layout.BACKUP)}))
    if o.warmup_epochs:
        steps.append(Step(WARMUP, {"epochs": o.warmup_epochs, "replicas": facts.num_replicas}))
    steps.append(Step(YOURS, {"callbacks": tuple(extra)}))
    steps += _sync_check(o, facts, environ, averaged, notes)
    steps += [Step(CHIEF_ONLY, {"callbacks": tuple(o.chief_only)})] if o.chief_only else []
    if model_dir and o.checkpoint:
        steps.append(Step(CHECKPOINT, {"path": layout.path(model_dir, layout.CHECKPOINT)}))
    if model_dir and o.tensorboard:
        steps += _tensorboard(facts, layout.path(model_dir, layout.LOGS), notes)
    if model_dir and o.preempt:
        steps.append(Step(PREEMPTION, {"model_dir": model_dir, "every": o.checkpoint_every,
                                       "epoch_saves": exact and o.backup}))
    if o.throughput:
        steps.append(Step(THROUGHPUT, {"global_batch": o.global_batch, "model_dir": model_dir}))
    steps += [] if facts.is_chief else [Step(SILENT_PROGRESS_BAR)]
    return Plan(tuple(steps), tuple(notes))


def _averages(o: CallbackOptions, facts: Facts, environ: Mapping[str, str] | None) -> bool:
    """Whether BatchNormalization's moving statistics are averaged at each epoch's end: asked
    for (the default) and several replicas whose statistics differ. tf_keras keeps them as
    sync-on-read means under a strategy whose row says so; Keras 3 on JAX as one array."""
    if not resolve("batch_statistics", o.average_batch_statistics, environ):
        return False
    synced = facts.keras == KERAS3_JAX or (facts.keras == TF_KERAS
                                           and facts.backend.keras2_synced_batch_norm)
    return facts.num_replicas > 1 and not synced


def _sync_check(o: CallbackOptions, facts: Facts, environ: Mapping[str, str] | None,
                averaged: bool, notes: list[tuple[int, str]]) -> list[Step]:
    """The replica sync check, where it is on and there is more than one replica to compare."""
    every = resolve("sync_check_every", o.sync_check_every, environ)
    if not resolve("sync_check", o.sync_check, environ) or facts.num_replicas == 1:
        return []
    if not facts.sync_check_readable:
        notes.append((logging.INFO, "tfdist: the replica sync check is off: it needs "
                                    "TensorFlow installed"))
        return []
    return [Step(SYNC_CHECK, {"every": every, "batch_statistics": averaged})]


def _tensorboard(facts: Facts, path: str, notes: list[tuple[int, str]]) -> list[Step]:
    # Keras writes summaries through the tensorboard package; without it the first summary
    # raises mid-epoch on the chief alone and the other workers' collectives abort.
    if not facts.tensorboard_missing:
        return [Step(TENSORBOARD, {"path": path})]
    missing = facts.tensorboard_missing
    names = " and ".join(f"`{name}`" for name in missing)
    notes.append((logging.WARNING, f"tfdist: TensorBoard logs are off: the {names} "
                  f"package{'s are' if len(missing) > 1 else ' is'} not installed (pip install "
                  f"{' '.join(missing)}, or callbacks(tensorboard=False))"))
    return []


def _refuse(o: CallbackOptions, facts: Facts) -> None:
    """Raises :class:`ConfigError` for the first option this Keras cannot honour, or that
    another option turns off (given as an argument: a variable may serve every backend)."""
    call = "dist.callbacks"
    if facts.keras == KERAS3_JAX and o.average_batch_statistics:
        raise ConfigError(
            f"{call}(average_batch_statistics=True): on Keras 3 on JAX each step is one "
            "computation over every device, so BatchNormalization's moving statistics are one "
            "array, computed from the global batch and the same on every replica: there is "
            "nothing to average. Drop the argument")
    readable = facts.sync_check_readable or facts.num_replicas == 1
    for name in ("sync_check", "sync_check_every"):
        if getattr(o, name) and not readable and o.sync_check is not False:
            raise ConfigError(
                f"{call}({name}={getattr(o, name)!r}): the replica sync check reads the "
                f"variables through TensorFlow (tfdist.sync), which is not installed here. "
                "Install tensorflow, or drop the argument")
    if o.sync_check_every is not None and o.sync_check is False:
        raise ConfigError(
            f"{call}(sync_check_every={o.sync_check_every!r}) times the replica sync check, "
            "which sync_check=False turns off: drop one of the two")
    if o.global_batch is not None and not o.throughput:
        raise ConfigError(
            f"{call}(global_batch={o.global_batch!r}) is the throughput meter's examples per "
            "step, which throughput=False turns off: drop one of the two")
    if o.checkpoint_every is not None and not (o.model_dir and o.preempt):
        lacking = "preempt=False" if o.model_dir else "no model_dir"
        raise ConfigError(
            f"{call}(checkpoint_every={o.checkpoint_every!r}) saves the preemption's exact "
            f"state in model_dir, but {lacking}: pass model_dir=... with preempt on, or drop "
            "checkpoint_every")


def route(writer: str | None, facts: Facts) -> str:
    """How a user's callback runs on this rank so that each file is written once.

    Args:
        writer: :data:`BACKUP_WRITER` (Keras's BackupAndRestore, not tfdist's), :data:`FILE_WRITER`
            (``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``, tfdist's checkpoint), or None
            (anything else, or a writer routed already).
        facts: the rank's.

    Returns:
        :data:`AS_GIVEN`; :data:`PER_RANK` (a BackupAndRestore's folder, ``backup_dir/rank-N``,
        where Keras would have every rank write one: Keras 3 always, tf_keras without a
        strategy over several workers); :data:`CHIEF_WRITES` (every rank runs it, the others
        into a scratch folder: where a save runs collectives); :data:`CHIEF_ALONE` (the others
        skip it).
    """
    if facts.world_size == 1 or writer is None:
        return AS_GIVEN
    if writer == BACKUP_WRITER:
        kept_apart = facts.keras == TF_KERAS and facts.strategy_spans_workers
        return AS_GIVEN if kept_apart else PER_RANK
    return CHIEF_WRITES if facts.save_on_every_rank else CHIEF_ALONE


Maker = Callable[[Step, list[Any]], Sequence[Any]]


def assemble(chosen: Plan, make: Mapping[str, Maker]) -> list[Any]:
    """The callbacks of ``chosen``, in its order: each step's from ``make[step.kind]`` (a Keras's
    own classes), which is also handed the callbacks made before it."""
    callbacks: list[Any] = []
    for step in chosen.steps:
        callbacks += make[step.kind](step, callbacks)
    return callbacks
