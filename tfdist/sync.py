"""Replica sync check: every rank must hold the same weights, bit for bit.

Data-parallel training is correct only while every replica holds identical weights. When
gradients stop being averaged (with Keras 3, Horovod's stock ``DistributedOptimizer`` silently
never averages them) or one rank changes its weights alone, training still "works": losses go
down, nothing raises, and each rank trains its own model. This check compares a fingerprint of
the weights across ranks and stops training with an error naming the ranks and variables that
differ.

A fingerprint is one 64-bit BLAKE2b digest per variable (dtype, shape and bytes), so one ulp in
one element changes it; it costs one read of the weights into host memory and about 1 ms per MB
of weights. The ranks exchange 32 bytes per replica; only when they differ do they exchange the
per-variable digests, to name the variables. Every rank gathers the same table and reaches the
same decision, so all ranks raise together and none waits on another.

Use :class:`ReplicaSyncCheck` (added by ``dist.callbacks()``) with ``fit``, or :func:`check` in
a custom loop. Imported only after :func:`tfdist.init`, like :mod:`tfdist.keras.callbacks`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfdist import throughput
from tfdist.errors import ConfigError, ReplicaMismatchError, TfdistError
from tfdist.keras.batch_statistics import as_tf_variable, batch_statistics, to_numpy
from tfdist.settings import resolve

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = [
    "ReplicaSyncCheck",
    "check",
    "digest",
    "fingerprint",
    "model_variables",
    "sync_check_callback",
]

keras: Any = tf.keras  # Keras 3 or tf_keras, known only at run time
logger = logging.getLogger("tfdist")
DEFAULT_TIMEOUT_S = 600.0  # covers a chief still writing a large checkpoint at the epoch end
_HEADER_WIDTH = 4  # rank, local replica, variable count, digest
_SHOWN = 6  # ranks and variables named in an error message before "... and N more"


def fingerprint(values: Iterable[Any]) -> np.ndarray:
    """One 64-bit digest per value: equal digests mean equal dtype, shape and bytes.

    Args:
        values: arrays, or anything ``np.asarray`` reads (tf or Keras variables, tensors).

    Returns:
        A ``uint64`` array with one digest per value, in order.
    """
    return np.array([_digest(to_numpy(value)) for value in values], dtype=np.uint64)


def digest(values: Iterable[Any]) -> str:
    """One short hex digest of all ``values``, for logs: equal on two ranks means identical weights.

    ``print(tfdist.sync.digest(tfdist.sync.model_variables(model)))`` on every rank shows at a
    glance whether the ranks agree; :func:`check` compares them for you and names the culprits.
    """
    return hashlib.blake2b(fingerprint(values).tobytes(), digest_size=8).hexdigest()


def model_variables(model: Any, *, include_optimizer: bool = False,
                    include_batch_statistics: bool = False) -> list[Any]:
    """The variables of ``model`` that every replica must hold identically.

    These are ``model.weights`` (trainable and non-trainable) without the moving statistics of
    BatchNormalization layers that are not ``synchronized``: Keras updates those from each
    replica's own batches, so they differ between replicas until
    :func:`tfdist.keras.batch_statistics.average_batch_statistics` evens them out at an epoch's end.

    Args:
        model: a Keras model (Keras 3 or tf_keras).
        include_optimizer: also compare the optimizer's variables (step count, moments).
        include_batch_statistics: also those moving statistics (right after they were
            averaged).
    """
    per_replica = ({id(v) for v in batch_statistics(model)} if not include_batch_statistics
                   else set())
    variables = [v for v in model.weights if id(v) not in per_replica]
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None:
        extra = optimizer.variables
        variables += list(extra() if callable(extra) else extra)
    return variables


def check(dist: Handle, variables: Sequence[Any], step: int | None = None, *,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Compares ``variables`` across all ranks and replicas; raises on every rank if they differ.

    Call it on every rank at the same point of a custom training loop, eagerly (outside
    ``tf.function`` and ``strategy.run``), e.g. after the first step::

        tfdist.sync.check(dist, tfdist.sync.model_variables(model), step=1)

    Sync-on-read variables (e.g. tf_keras BatchNormalization moving statistics) are skipped:
    each replica keeps its own copy by design.

    Args:
        dist: the handle from :func:`tfdist.init`.
        variables: the variables to compare, e.g. from :func:`model_variables`.
        step: the training step, for the error message.
        timeout_s: how long to wait for the other ranks, where the backend can bound it
            (MultiWorkerMirroredStrategy; Horovod stops a stalled job by its own timeout).

    Raises:
        ReplicaMismatchError: some ranks hold different values; the message names them, the
            variables that differ, the usual causes and the fix.
        TfdistError: a rank did not reach the check within ``timeout_s``.
    """
    if dist.num_replicas == 1:
        return  # one replica: nothing to compare
    variables = [v for v in variables if not _is_sync_on_read(v)]
    local = _local_digests(dist, variables)
    combined = [_digest(row) for row in local]
    header = np.array([[dist.rank, i, len(variables), d] for i, d in enumerate(combined)],
                      dtype=np.uint64)
    rows = _gather(dist, header, timeout_s)
    if len(set(rows[:, 2].tolist())) == 1 and len(set(rows[:, 3].tolist())) == 1:
        return
    # Every rank gathered the same table, so every rank takes this branch together.
    detail = None
    if len(set(rows[:, 2].tolist())) == 1:
        detail = _gather(dist, np.concatenate([header[:, :2], local], axis=1), timeout_s)
    raise mismatch_error(rows, detail, [_name(v) for v in variables], step)


def mismatch_error(rows: np.ndarray, detail: np.ndarray | None, names: Sequence[str],
                   step: int | None) -> ReplicaMismatchError:
    """The error for a gathered table whose rows differ (pure, so it is tested as a table).

    Args:
        rows: one header row per replica: rank, local replica, variable count, digest.
        detail: one row per replica: rank, local replica, then one digest per variable; None
            when the variable counts differ.
        names: the variable names, in the order of the digests.
        step: the training step, or None.
    """
    rows = rows[np.lexsort((rows[:, 1], rows[:, 0]))]
    several = bool((rows[:, 1] > 0).any())  # several replicas per rank (GPUs): name them too

    def label(row: np.ndarray) -> str:
        return f"rank {row[0]} replica {row[1]}" if several else f"rank {row[0]}"

    when = f" after step {step}" if step is not None else ""
    reference, odd = rows[0], [r for r in rows[1:] if (r[2:] != rows[0, 2:]).any()]
    if detail is None:
        lines = [f"Replica sync check failed{when}: the ranks compare different numbers of "
                 f"variables ({label(reference)}: {reference[2]}), so they built different "
                 "models. Build the same model on every rank, inside the strategy scope.",
                 *(f"  {label(r)}: {r[2]} variables" for r in odd[:_SHOWN])]
    else:
        lines = [f"Replica sync check failed{when}: {_listed([label(r) for r in odd])} "
                 f"{'holds' if len(odd) == 1 else 'hold'} different weights from "
                 f"{label(reference)}, so they no longer train one model:",
                 *_variable_lines(detail, reference, odd, names, label)]
    if len(odd) > _SHOWN:
        lines.append(f"  ... and {len(odd) - _SHOWN} more")
    groups = _groups(rows, label)
    if len(groups) > 2:
        lines.append("  groups of identical replicas: " + " | ".join(groups))
    return ReplicaMismatchError("\n".join([*lines, causes(step)]))


def _variable_lines(detail: np.ndarray, reference: np.ndarray, odd: list[np.ndarray],
                    names: Sequence[str], label: Any) -> list[str]:
    digests = {(int(r[0]), int(r[1])): r[2:] for r in detail}
    base = digests[(int(reference[0]), int(reference[1]))]
    lines = []
    for row in odd[:_SHOWN]:
        which = [names[int(i)] for i in np.flatnonzero(digests[(int(row[0]), int(row[1]))] != base)]
        lines.append(f"  {label(row)}: {len(which)} of {len(names)} variables differ: "
                     f"{_listed(which)}")
    return lines


def _listed(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f", ... ({more} more)" if more > 0 else "")


_NOT_BROADCAST = ("initial weights that differ: the model was built outside the strategy "
                  "scope (build and compile it inside `with dist.scope():`), so rank 0's "
                  "weights were never copied to the others")
_NOT_AVERAGED = ("gradients that are not averaged across ranks (with Keras 3, Horovod's stock "
                 "horovod.tensorflow.keras.DistributedOptimizer silently never averages: use "
                 "tfdist's horovod backend instead)")
_CHANGED = ("weights changed on some ranks only (loaded or assigned on the chief after the "
            "strategy was created, a callback or custom loop that writes one rank's weights "
            "outside strategy.run)")


def causes(step: int | None) -> str:
    """The usual causes, the likeliest first: after the first step, weights that never were
    the same (a model built outside the scope), or never averaged; later, once they were
    the same, weights that one rank changed alone."""
    ordered = ([_NOT_BROADCAST, _NOT_AVERAGED, _CHANGED] if step is None or step <= 1
               else [_CHANGED, _NOT_AVERAGED, _NOT_BROADCAST])
    return (f"Likeliest cause: {ordered[0]}. Others: {ordered[1]}; {ordered[2]}. Fix the "
            "cause; to train without this check, pass dist.callbacks(sync_check=False) or set "
            "TFDIST_SYNC_CHECK=0.")


class ReplicaSyncCheck(keras.callbacks.Callback):
    """Checks that all ranks hold the same weights after the first step, and every N steps.

    Runs :func:`check` on :func:`model_variables` after the first training batch of each
    ``fit``, after every ``every_n_steps``-th batch when given, and at the end of training
    (unless that step was just checked). Every rank runs it at the same batches, so it is
    safe with collectives. With ``steps_per_execution``, a "step" is one execution.

    Attributes:
        checked_steps: the steps of this ``fit`` that were checked.
        seconds: how long each of those checks took.
    """

    def __init__(self, dist: Handle, every_n_steps: int | None = None, *,
                 at_train_end: bool = True, include_optimizer: bool = False,
                 batch_statistics_at_end: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigError(f"every_n_steps={every_n_steps}: use a positive number of steps, "
                              "or None to check after the first step only")
        self.dist, self.every_n_steps, self.at_train_end = dist, every_n_steps, at_train_end
        self.include_optimizer, self.timeout_s = include_optimizer, timeout_s
        self.batch_statistics_at_end = batch_statistics_at_end
        self.checked_steps: list[int] = []
        self.seconds: list[float] = []
        self._step = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._step, self.checked_steps, self.seconds = 0, [], []
        # Trace the gather now rather than in the first batch's hook, which tf_keras times.
        self.dist.prepare_gather_rows(_HEADER_WIDTH, self.timeout_s)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1
        if self._step == 1 or (self.every_n_steps and self._step % self.every_n_steps == 0):
            self._check()

    def on_train_end(self, logs: Any = None) -> None:
        if self.at_train_end and self._step and (self.checked_steps[-1:] != [self._step]
                                                 or self.batch_statistics_at_end):
            self._check(at_end=True)

    def _check(self, *, at_end: bool = False) -> None:
        start = time.perf_counter()
        sync = getattr(self.model, "jax_state_sync", None)
        if callable(sync):  # Keras 3 on JAX keeps the variables' values aside inside fit
            sync()
        variables = model_variables(self.model, include_optimizer=self.include_optimizer,
                                    include_batch_statistics=at_end
                                    and self.batch_statistics_at_end)
        check(self.dist, variables, self._step, timeout_s=self.timeout_s)
        self.checked_steps.append(self._step)
        self.seconds.append(time.perf_counter() - start)
        if self.dist.is_chief and len(self.checked_steps) == 1:
            passed = (f"replica sync check passed at step {self._step}: {len(variables)} "
                      f"variables identical on {self.dist.num_replicas} replicas "
                      f"({1000 * self.seconds[-1]:.1f} ms)")
            if not throughput.note(passed):  # with the epoch's line, where one comes
                logger.info("tfdist: %s", passed)


def sync_check_callback(dist: Handle, enabled: bool | None = None,
                        every_n_steps: int | None = None,
                        environ: Mapping[str, str] | None = None, *,
                        batch_statistics_at_end: bool = False) -> ReplicaSyncCheck | None:
    """The :class:`ReplicaSyncCheck` that ``dist.callbacks()`` adds, or None.

    Args:
        dist: the handle from :func:`tfdist.init`.
        enabled: run the check; env ``TFDIST_SYNC_CHECK`` (``1``/``0``), default on. With
            one replica there is nothing to compare and no callback.
        every_n_steps: also check every N steps; env ``TFDIST_SYNC_CHECK_EVERY``, default
            None (after the first step and at the end only).
        environ: the environment to read (default ``os.environ``).
        batch_statistics_at_end: compare the BatchNormalization moving statistics too at the
            end of training (they were averaged at the last epoch's end).

    Raises:
        ConfigError: an invalid setting.
    """
    enabled = resolve("sync_check", enabled, environ)
    every_n_steps = resolve("sync_check_every", every_n_steps, environ)
    if not enabled or dist.num_replicas == 1:
        return None
    return ReplicaSyncCheck(dist, every_n_steps, batch_statistics_at_end=batch_statistics_at_end)


def _digest(array: np.ndarray) -> int:
    hasher = hashlib.blake2b(f"{array.dtype.name}{array.shape}".encode(), digest_size=8)
    hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return int.from_bytes(hasher.digest(), "little")


def _is_sync_on_read(variable: Any) -> bool:
    sync = getattr(as_tf_variable(variable), "synchronization", None)
    return bool(sync == tf.VariableSynchronization.ON_READ)


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def _local_digests(dist: Handle, variables: Sequence[Any]) -> np.ndarray:
    """Rows of per-variable digests, one row per replica on this rank (its own copies)."""
    count = dist.local_replicas
    copies = [dist.local_copies(v) for v in variables]
    return np.array([fingerprint(c[i] for c in copies) for i in range(count)],
                    dtype=np.uint64).reshape(count, len(variables))


def _gather(dist: Handle, rows: np.ndarray, timeout_s: float) -> np.ndarray:
    """All replicas' rows (``uint64``), the same table on every rank."""
    packed = rows.view(np.int64)  # collectives carry int64, not uint64
    try:
        gathered = dist.gather_rows(packed, timeout_s)
    except TfdistError as error:
        raise TfdistError(
            f"replica sync check: {error}. Call tfdist.sync.check() on every rank at the same "
            "step (not only on the chief); a rank that is still busy needs a larger "
            "timeout_s") from None
    return np.ascontiguousarray(gathered, dtype=np.int64).view(np.uint64)


def _groups(rows: np.ndarray, label: Any) -> list[str]:
    groups: dict[tuple[int, ...], list[str]] = {}
    for row in rows:
        groups.setdefault(tuple(int(x) for x in row[2:]), []).append(label(row))
    return [", ".join(members) for members in groups.values()]
