"""The comparison behind ``tfdist verify``: one process's record against N workers' (pure).

A :class:`Run` is one run of a script: its exit status, the tail of its output and each rank's
:class:`Record` (what :mod:`tfdist.verify.record` wrote). :func:`compare` walks the two runs
call by call (``fit1``, ``evaluate1``...) and step by step, and returns a :class:`Verdict`:

- **equal**: every step's logs and weights, every result, bit for bit;
- **within rounding**: nothing differs by more than :data:`RTOL` relative to its own scale
  (the replicas' gradients are summed in another order than one process's, in float32);
- **differs**: the first step and quantity that differ by more, with the likely cause and
  its fix (:func:`diagnose`): a loss or gradient scaled by the replicas, another batch,
  random draws per replica, other initial weights, another number of steps;
- **crashed**: a run failed (the one-process run: the script's own failure).

The workers are compared with each other first: they must hold the same weights bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfdist.errors import EXIT_CONFIG

__all__ = ["ATOL", "CRASHED", "DIFFERS", "EQUAL", "OUTCOMES", "ROUNDING", "RTOL", "Record",
           "Run", "Verdict", "compare", "diagnose", "relative_difference", "update_ratio"]

EQUAL, ROUNDING, DIFFERS, CRASHED = "equal", "within rounding", "differs", "crashed"
OUTCOMES = (EQUAL, ROUNDING, DIFFERS, CRASHED)
# Float32 sums in another order: measured differences after tens of steps stay below 1e-5 of a
# quantity's scale with SGD; Adam divides by the gradients' size, which lets a near-zero
# gradient's rounding show: 1e-3 of the variable's scale bounds both.
RTOL = 1e-3
ATOL = 1e-6  # below this, scales are noise: a loss of 0 against 1e-9
# How close a ratio must be to N or 1/N to be named as the replicas' count (2 %).
RATIO_TOL = 0.02
ROUNDING_WHY = ("the replicas' gradients and the losses are summed in another order than one "
                "process's sum, in float32")


@dataclass
class Record:
    """What one process of a run recorded (:mod:`tfdist.verify.record`)."""

    rank: int
    meta: dict[str, Any]
    calls: list[dict[str, Any]]
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | os.PathLike[str], rank: int) -> Record | None:
        """The record rank ``rank`` wrote into ``folder``, or None if it wrote none."""
        path = os.path.join(folder, f"record-{rank}.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        with np.load(os.path.join(folder, f"record-{rank}.npz")) as npz:
            arrays = {key: npz[key] for key in npz.files}
        return cls(rank, data["meta"], data["calls"], arrays)

    def moments(self, key: str) -> list[np.ndarray] | None:
        """The optimizers' first moments recorded with the weights under ``key``."""
        names = self.meta.get("moments", {}).get(key)
        if not names:
            return None
        return [self.arrays[f"{key}#moment/{i}"] for i in range(len(names))]

    def weights(self, key: str) -> list[np.ndarray] | None:
        """The weights recorded under ``key`` (``"fit1/step3"``, ``"final/model"``), in order."""
        names = self.meta.get("variables", {}).get(key)
        if names is None or key in self.meta.get("digests", {}):
            return None
        return [self.arrays[f"{key}/{i}"] for i in range(len(names))]

    def variable_names(self, key: str) -> list[str]:
        return list(self.meta.get("variables", {}).get(key, []))

    def call(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.calls if c["name"] == name), None)


@dataclass
class Run:
    """One run of the script: exit status, output's tail, each rank's record (None: absent)."""

    returncode: int
    output: str
    records: list[Record | None]

    @property
    def world_size(self) -> int:
        return len(self.records)

    def last_line(self) -> str:
        """The line that says why it failed: a ``tfdist:`` line, else the last error line."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        lines = [line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
                 for line in lines]
        own = [line for line in lines if line.startswith("tfdist:")]
        if own and self.returncode == EXIT_CONFIG:  # one of tfdist's own errors: its line last
            return own[-1]
        for line in reversed(own):
            if "error" in line.lower() or "fix" in line.lower() or "refuse" in line.lower():
                return line
        for line in reversed(lines):
            if "Error" in line or "error:" in line or line.startswith("Traceback"):
                return line
        return lines[-1] if lines else f"exit status {self.returncode}, no output"


@dataclass(frozen=True)
class Verdict:
    """What :func:`compare` found: an outcome of :data:`OUTCOMES` and one line saying it."""

    outcome: str
    line: str
    largest: float = 0.0  # the largest relative difference seen (within rounding: the bound)
    step: int | None = None  # differs: the first step that differs
    where: str = ""  # differs: what differs first ("fit1 loss", "fit1 dense/kernel")
    cause: str = ""  # differs: the likely cause and the fix
    steps: int = 0  # steps compared
    told: tuple[str, ...] = ()  # tfdist's warnings on the workers (every rank's, once each)


def relative_difference(a: Any, b: Any) -> float:
    """``max|a - b|`` over ``max|b|`` (at least :data:`ATOL`); inf for other shapes."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        same = np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
            np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b))
        return 0.0 if same else float("inf")
    scale = max(float(np.max(np.abs(b))), ATOL)
    return float(np.max(np.abs(a - b))) / scale


def update_ratio(before: Sequence[np.ndarray], one: Sequence[np.ndarray],
                 many: Sequence[np.ndarray]) -> float | None:
    """How many times one process's update the workers' is, by projection: ``<dN, d1> /
    <d1, d1>`` over every variable (None when one process did not move)."""
    d1 = np.concatenate([(np.asarray(o, np.float64) - np.asarray(b, np.float64)).ravel()
                         for b, o in zip(before, one, strict=False)] or [np.zeros(0)])
    dn = np.concatenate([(np.asarray(m, np.float64) - np.asarray(b, np.float64)).ravel()
                         for b, m in zip(before, many, strict=False)] or [np.zeros(0)])
    norm = float(d1 @ d1)
    if norm <= 0.0 or d1.shape != dn.shape:
        return None
    return float(dn @ d1) / norm


def _near(value: float | None, target: float) -> bool:
    return value is not None and target > 0 and abs(value / target - 1.0) <= RATIO_TOL


_OTHER_BATCH = (
    "the batch differs from one process's (the loss differs before any update differs): the "
    "workers do not split one global batch in one process's order; fix: the same order on "
    "every rank (a seeded shuffle, .cache() before it), dist.shard(ds) on the global batch")


def diagnose(n: int, *, loss_ratio: float | None, update: float | None,
             weights_before_equal: bool, random_layers: Sequence[str],
             first_step: bool) -> str:
    """The likely cause of a first difference, and its fix, in one sentence (pure).

    Args:
        n: the replicas of the compared run.
        loss_ratio: the workers' logged loss at that step over one process's (None: unknown).
        update: :func:`update_ratio` of that step (None: unknown).
        weights_before_equal: the weights before the step were one process's.
        random_layers: the model's layers that draw random values.
        first_step: it is the call's first step.
    """
    if not weights_before_equal and first_step:
        return ("the initial weights differ: the model was built from another random state; "
                "fix: keras.utils.set_random_seed(S) before building it, the same on every rank")
    if loss_ratio is not None and not random_layers and not any(
            _near(loss_ratio, ratio) for ratio in (1.0, float(n), 1.0 / n)):
        return _OTHER_BATCH  # from the same weights: the update's ratio then means nothing
    if _near(update, n):
        return (f"the gradient is {n} times one process's: a loss that is one number for a "
                f"replica's batch (a custom loss that reduces over the batch, reduction='sum') is "
                f"summed over the {n} replicas, not averaged; fix: return one loss per example "
                "and let Keras reduce, or divide the step's loss by dist.num_replicas")
    if _near(update, 1.0 / n):
        return (f"the gradient is 1/{n} of one process's: the loss is divided by the {n} "
                "replicas twice (a loss already averaged over the global batch, then scaled "
                "for the replicas' sum); fix: average over the replica's own rows only")
    if _near(loss_ratio, 1.0 / n):
        return (f"the logged loss is 1/{n} of one process's: a loss computed in your own "
                f"train_step is scaled by 1/{n} for the replicas' sum, and logged scaled; fix: "
                "log it through a metric (keras.metrics.Mean) or multiply the logged value by "
                "dist.num_replicas")
    if _near(loss_ratio, float(n)):
        return (f"the logged loss is {n} times one process's: the replicas' losses are summed "
                "where one process's is a mean; fix: average per example, as Keras's losses do")
    statistics = [layer for layer in random_layers if "(batch statistics)" in layer]
    if statistics:
        return (f"BatchNormalization normalises over each replica's rows "
                f"({', '.join(statistics[:3])}), one process over the whole batch; expected, "
                "of the size shown; for one process's numbers: "
                "BatchNormalization(synchronized=True)")
    if random_layers:
        return (f"random draws are made per replica ({', '.join(random_layers[:3])}): each "
                "replica draws its own values for its rows, one process one set for the whole "
                "batch; the difference is expected, of the size shown")
    if loss_ratio is not None and not _near(loss_ratio, 1.0):
        return _OTHER_BATCH
    return ("the cause is none tfdist recognises (not a loss or gradient scaled by the replicas, "
            "not the input, not random layers)")


@dataclass
class _Walk:
    """The state of one comparison."""

    n: int
    largest: float = 0.0
    steps: int = 0
    exact: bool = True
    first: Verdict | None = None

    def seen(self, difference: float) -> bool:
        """Counts a difference; True when it is beyond rounding."""
        if difference > 0.0:
            self.exact = False
        if difference > RTOL:
            return True
        self.largest = max(self.largest, difference)
        return False


def compare(one: Run, many: Run) -> Verdict:
    """``many`` (N workers) against ``one`` (one process), as the module's docstring says;
    with the warnings tfdist gave on the workers."""
    told: list[str] = []
    for record in many.records:
        for line in (record.meta.get("warnings", []) if record is not None else []):
            if line not in told:
                told.append(line)
    return dataclasses.replace(_compare(one, many), told=tuple(told))


def _compare(one: Run, many: Run) -> Verdict:
    if one.returncode != 0 or not one.records or one.records[0] is None:
        return Verdict(CRASHED, f"the one-process run failed (exit {one.returncode}): "
                       f"{one.last_line()}")
    if many.returncode != 0 or any(r is None for r in many.records):
        missing = [i for i, r in enumerate(many.records) if r is None]
        where = f" (no record from rank {', '.join(map(str, missing))})" if missing else ""
        return Verdict(CRASHED, f"the {many.world_size}-worker run failed (exit "
                       f"{many.returncode}){where}: {many.last_line()}")
    ref = one.records[0]
    ranks = [r for r in many.records if r is not None]
    n = int(ranks[0].meta.get("replicas") or len(ranks))
    walk = _Walk(n)
    apart = _ranks_apart(ranks)
    if apart:
        return Verdict(DIFFERS, apart, where="ranks")
    names_one = [c["name"] for c in ref.calls]
    names_many = [c["name"] for c in ranks[0].calls]
    if names_one != names_many:
        return Verdict(DIFFERS, f"the script made other calls on {len(ranks)} workers "
                       f"({', '.join(names_many) or 'none'}) than in one process "
                       f"({', '.join(names_one) or 'none'})", where="calls")
    for call in ref.calls:
        verdict = _compare_call(call, ref, ranks, walk)
        if verdict is not None:
            return verdict
    for model in ref.meta.get("models", []):
        key = f"final/{model}"
        mine, theirs = ref.weights(key), ranks[0].weights(key)
        if mine is None or theirs is None:
            continue
        for name, a, b in zip(ref.variable_names(key), theirs, mine, strict=False):
            if walk.seen(relative_difference(a, b)):
                return Verdict(DIFFERS, f"differs at the end in model {model!r}, {name}: "
                               f"{relative_difference(a, b):.3g} of its scale",
                               largest=relative_difference(a, b), where=f"{model} {name}",
                               cause=diagnose(n, loss_ratio=None, update=None,
                                              weights_before_equal=True,
                                              random_layers=ref.meta.get("random_layers", []),
                                              first_step=False))
    if walk.exact:
        return Verdict(EQUAL, f"equal: {walk.steps} steps, every loss and weight bit for bit",
                       steps=walk.steps)
    return Verdict(ROUNDING, f"within rounding: {walk.steps} steps, the largest difference "
                   f"{walk.largest:.2g} of a quantity's scale (bound {RTOL:g}), because "
                   f"{ROUNDING_WHY}", largest=walk.largest, steps=walk.steps)


def _ranks_apart(ranks: Sequence[Record]) -> str:
    """A line naming the first rank whose weights are not rank 0's, or ''."""
    first = ranks[0]
    # Where the ranks must agree: when each fit returns, and at the end. Within an epoch a
    # BatchNormalization's moving statistics are each replica's own until the epoch's end.
    keys = [f"{c['name']}/end" for c in first.calls if "end" in c.get("weights", [])]
    keys += [f"final/{m}" for m in first.meta.get("models", [])]
    for other in ranks[1:]:
        for key in keys:
            a, b = first.weights(key), other.weights(key)
            if a is None or b is None:
                continue
            for name, x, y in zip(first.variable_names(key), a, b, strict=False):
                if not np.array_equal(x, y, equal_nan=True):
                    call, _, label = key.partition("/")
                    return (f"the workers' weights differ from each other: rank {other.rank}'s "
                            f"{name} is not rank 0's at {call} {label}; the replicas did not "
                            "apply one update (a variable made outside the scope, an optimizer "
                            "step outside the strategy, or per-rank data in the update)")
    return ""


def _logs(ranks: Sequence[Record], call: str, index: int, kind: str) -> dict[str, float]:
    """The workers' logs of a call's step or epoch: rank 0's where they are the job's, else
    the ranks' average (Horovod's step logs are each rank's own)."""
    own = ranks[0].meta.get("step_logs") == "own" and kind == "steps"
    found = [r.call(call) for r in (ranks if own else ranks[:1])]
    rows = [c[kind][index] for c in found if c is not None and index < len(c[kind])]
    if not rows:
        return {}
    return {k: float(np.mean([row[k] for row in rows if k in row])) for k in rows[0]}


def _compare_call(call: dict[str, Any], ref: Record, ranks: Sequence[Record],
                  walk: _Walk) -> Verdict | None:
    name = call["name"]
    theirs = ranks[0].call(name) or {}
    if call["kind"] == "evaluate":
        return _compare_values(f"{name}", call.get("result", {}), theirs.get("result", {}),
                               walk)
    if call["kind"] == "predict":
        return _compare_outputs(name, call, theirs, ref, ranks[0], walk)
    if len(call["steps"]) != len(theirs.get("steps", [])):
        return Verdict(DIFFERS, f"{name} ran {len(theirs.get('steps', []))} steps on "
                       f"{len(ranks)} workers, {len(call['steps'])} in one process: the workers "
                       "see another number of batches (an input split or repeated otherwise)",
                       where=f"{name} steps")
    verdict = _compare_steps(call, ref, ranks, walk)
    if verdict is not None:
        return verdict
    for index, logs in enumerate(call["epochs"]):
        verdict = _compare_values(f"{name} epoch {index + 1}", logs,
                                  _logs(ranks, name, index, "epochs"), walk)
        if verdict is not None:
            return verdict
    return None


def _compare_steps(call: dict[str, Any], ref: Record, ranks: Sequence[Record],
                   walk: _Walk) -> Verdict | None:
    """A fit call's steps, in order: the first that differs beyond rounding, diagnosed."""
    name, n = call["name"], walk.n
    random_layers = call.get("random_layers") or []
    if "keras3-global-draws" in ranks[0].meta.get("patches", []):  # Keras's draws: global
        random_layers = [layer for layer in random_layers if "(batch statistics)" in layer]
    previous = f"{name}/initial"
    before_equal = True
    mine0, theirs0 = ref.weights(previous), ranks[0].weights(previous)
    if mine0 is not None and theirs0 is not None:
        differences = [relative_difference(a, b) for a, b in zip(theirs0, mine0, strict=False)]
        before_equal = all(d <= RTOL for d in differences)
        for difference in differences:
            walk.seen(difference)
    for index, logs in enumerate(call["steps"]):
        step = index + 1
        walk.steps += 1
        many_logs = _logs(ranks, name, index, "steps")
        loss_ratio = _loss_ratio(logs, many_logs)
        label = f"{name}/step{step}"
        mine, their_w = ref.weights(label), ranks[0].weights(label)
        where, size = "", 0.0
        if mine is not None and their_w is not None:
            for var, a, b in zip(ref.variable_names(label), their_w, mine, strict=False):
                difference = relative_difference(a, b)
                if walk.seen(difference) and not where:
                    where, size = f"{name} {var}", difference
        for key, value in logs.items():
            if key in many_logs:
                difference = relative_difference(many_logs[key], value)
                if walk.seen(difference) and not where:
                    where, size = f"{name} {key}", difference
        if where:
            update = _gradient_ratio(ref, ranks[0], previous, label)
            cause = diagnose(n, loss_ratio=loss_ratio, update=update,
                             weights_before_equal=before_equal, random_layers=random_layers,
                             first_step=step == 1)
            shown = f"{size:.3g} of its scale" if np.isfinite(size) else "another shape or NaN"
            return Verdict(DIFFERS, f"differs first at step {step} in {where} ({shown}): "
                           f"likely cause: {cause}", largest=size, step=step, where=where,
                           cause=cause, steps=walk.steps)
        previous = label if mine is not None else previous
    return None


def _gradient_ratio(ref: Record, rank0: Record, before: str, after: str) -> float | None:
    """How many times one process's gradient the workers' was in a step, from the optimizers'
    first moments (linear in the gradient, Adam's too) where recorded, else from the weights'
    update (SGD's)."""
    for kind in ("moments", "weights"):
        prior, mine = getattr(ref, kind)(before), getattr(ref, kind)(after)
        theirs = getattr(rank0, kind)(after)
        if kind == "moments" and before.endswith("/initial") and mine is not None:
            prior = [np.zeros_like(m) for m in mine]  # moments start at zero
        if prior is not None and mine is not None and theirs is not None:
            ratio = update_ratio(prior, mine, theirs)
            if ratio is not None:
                return ratio
    return None


def _loss_ratio(one: Mapping[str, float], many: Mapping[str, float]) -> float | None:
    """The workers' loss over one process's at a step, from the values named like a loss
    (``loss``, ``d_loss``, ``step_loss``): one that differs first, ``loss`` before others."""
    keys = [k for k in one if k in many and k.endswith("loss") and abs(one[k]) > ATOL]
    keys.sort(key=lambda k: (relative_difference(many[k], one[k]) <= RTOL, k != "loss"))
    return many[keys[0]] / one[keys[0]] if keys else None


def _compare_values(where: str, mine: Mapping[str, float], theirs: Mapping[str, float],
                    walk: _Walk) -> Verdict | None:
    for key, value in mine.items():
        if key not in theirs:
            return Verdict(DIFFERS, f"{where}: {key!r} is missing on the workers",
                           where=f"{where} {key}")
        difference = relative_difference(theirs[key], value)
        if walk.seen(difference):
            ratio = theirs[key] / value if abs(value) > ATOL else None
            cause = diagnose(walk.n, loss_ratio=ratio if key.endswith("loss") else None,
                             update=None, weights_before_equal=True, random_layers=(),
                             first_step=False)
            return Verdict(DIFFERS, f"differs in {where} {key}: {theirs[key]:.6g} on the "
                           f"workers, {value:.6g} in one process: likely cause: {cause}",
                           largest=difference, where=f"{where} {key}", cause=cause)
    return None


def _compare_outputs(name: str, call: dict[str, Any], theirs: dict[str, Any], ref: Record,
                     rank0: Record, walk: _Walk) -> Verdict | None:
    mine_out, their_out = call.get("outputs", []), theirs.get("outputs", [])
    shapes = [o["shape"] for o in mine_out], [o["shape"] for o in their_out]
    if shapes[0] != shapes[1]:
        return Verdict(DIFFERS, f"{name} returned shapes {shapes[1]} on the workers, "
                       f"{shapes[0]} in one process: rows lost or repeated",
                       where=f"{name} shape")
    for i, (a, b) in enumerate(zip(mine_out, their_out, strict=False)):
        key = f"{name}/output/{i}"
        if key in ref.arrays and key in rank0.arrays:
            difference = relative_difference(rank0.arrays[key], ref.arrays[key])
        elif a["digest"] == b["digest"]:
            difference = 0.0
        else:
            difference = relative_difference(b["sum"] or 0.0, a["sum"] or 0.0)
        if walk.seen(difference):
            return Verdict(DIFFERS, f"{name}'s output {i} differs ({difference:.3g} of its "
                           "scale)", largest=difference, where=f"{name} output")
    return None
