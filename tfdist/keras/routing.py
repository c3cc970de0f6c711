"""A writer routed on each rank, for every Keras tfdist drives: the bodies of the wrappers
:class:`ChiefOnly`, :class:`ChiefWrites` and :class:`PerRankFiles`, of Keras 3's
``BackupAndRestore`` with a folder per rank (:class:`Keras3BackupPerRank`), and
:func:`route_writer`, which applies :func:`tfdist.keras.plan.route`'s decision.

Each Keras adds its ``Callback`` as the second base, as for
:mod:`tfdist.keras.fit_preemption`: :mod:`tfdist.keras.callbacks` (TensorFlow's Keras: Keras 3 on
TensorFlow and tf_keras) and :mod:`tfdist.jax.callbacks` (Keras 3 on JAX). Writers are told
apart by their classes' names, so it imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Any, NamedTuple

from tfdist import walltime
from tfdist.keras import plan
from tfdist.scratch import as_given, scratch_dir

__all__ = ["ChiefOnly", "ChiefWrites", "Classes", "Keras3BackupPerRank", "PerRankFiles",
           "keeps_logs_open", "path_attribute", "route_writer", "writer_kind"]

logger = logging.getLogger("tfdist")

# The attribute that holds each known writer's output path. tf_keras's TensorBoard and
# ModelCheckpoint derive their real paths from these in set_model or at save time.
_PATHS = {"AtomicCheckpoint": "path", "ModelCheckpoint": "filepath", "CSVLogger": "filename",
          "TensorBoard": "log_dir"}
_CHECKPOINTS = ("AtomicCheckpoint", "ModelCheckpoint")  # large: emptied after each epoch


def _names(callback: Any) -> set[str]:
    return {cls.__name__ for cls in type(callback).__mro__}


def path_attribute(callback: Any) -> str | None:
    """The attribute holding where a writer tfdist knows writes (None for anything else)."""
    for cls in type(callback).__mro__:
        if cls.__name__ in _PATHS:
            return _PATHS[cls.__name__]
    return None


def keeps_logs_open(callback: Any) -> bool:
    """TensorBoard and CSVLogger (also wrapped by :class:`ChiefOnly` or :class:`ChiefWrites`)."""
    inner = callback.callback if isinstance(callback, ChiefOnly | ChiefWrites) else callback
    return bool(_names(inner) & {"TensorBoard", "CSVLogger"})


class ChiefOnly:
    """Runs ``callback`` on the chief only; on the other ranks its hooks do nothing.

    For callbacks that run no collective (notifications, your own logs). File writers that
    may save a model belong in :class:`ChiefWrites`, which ``dist.callbacks()`` picks for the
    ones it knows.
    """

    def __init__(self, callback: Any, is_chief: bool) -> None:
        super().__init__()
        self.callback, self.is_chief = callback, is_chief

    # Forwarded on the chief only: Keras's TensorBoard.set_model already writes the graph.
    def set_model(self, model: Any) -> None:
        super().set_model(model)  # type: ignore[misc]  # the Keras Callback, the other base
        if self.is_chief:
            self.callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)  # type: ignore[misc]
        if self.is_chief:
            self.callback.set_params(params)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and not object.__getattribute__(self, "is_chief"):
            return lambda *args, **kwargs: None
        if name.startswith("on_"):
            return getattr(object.__getattribute__(self, "callback"), name)
        return object.__getattribute__(self, name)


class _Forwarding:
    """Holds ``callback`` and hands it the model and the params, as Keras hands them here."""

    def __init__(self, callback: Any) -> None:
        super().__init__()
        self.callback = callback

    def set_model(self, model: Any) -> None:
        super().set_model(model)  # type: ignore[misc]  # the Keras Callback, the other base
        self.callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)  # type: ignore[misc]
        self.callback.set_params(params)


class ChiefWrites(_Forwarding):
    """Runs a file-writing callback on every rank; only the chief's files are kept.

    On the chief ``callback`` runs unchanged. On the other ranks its output path points into a
    private scratch directory (:func:`tfdist.scratch.scratch_dir`), emptied after each epoch and
    removed at the end of training, so every rank runs the same saves (and their collectives)
    while only the chief's land. Knows tfdist's ``AtomicCheckpoint`` and Keras's
    ``ModelCheckpoint``, ``CSVLogger`` and ``TensorBoard`` (and their subclasses).

    Args:
        callback: the writer.
        rank: this process's rank.

    Raises:
        ValueError: ``callback`` is not a writer this class knows.
    """

    def __init__(self, callback: Any, rank: int) -> None:
        attribute = path_attribute(callback)
        if attribute is None:
            raise ValueError(f"ChiefWrites does not know where {type(callback).__name__} "
                             f"writes; it knows {sorted(_PATHS)}")
        super().__init__(callback)
        self.rank = rank
        self.scratch: str | None = None
        if rank != 0:
            self.scratch = scratch_dir(rank)
            target = getattr(callback, attribute)
            setattr(callback, attribute, os.path.join(self.scratch, os.path.basename(
                str(target).rstrip("/")) or "out"))

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name not in ("on_epoch_end", "on_train_end"):
            hook = getattr(object.__getattribute__(self, "callback"), name)
            # The chief's saves go through tfdist.keras.writers (atomic) where it is installed;
            # the others' already point into their scratch folder, where they are written as
            # given.
            return _as_given(hook) if object.__getattribute__(self, "scratch") else hook
        return object.__getattribute__(self, name)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        with as_given() if self.scratch else contextlib.nullcontext():
            self.callback.on_epoch_end(epoch, logs)
        if self.scratch and _names(self.callback) & set(_CHECKPOINTS):
            _empty(self.scratch)  # checkpoints may be large; logs stay open until the end

    def on_train_end(self, logs: Any = None) -> None:
        try:
            with as_given() if self.scratch else contextlib.nullcontext():
                self.callback.on_train_end(logs)
        finally:
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)


def _as_given(hook: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with as_given():
            return hook(*args, **kwargs)

    return run


class PerRankFiles(_Forwarding):
    """Runs ``callback`` on every rank with its saves written where it says
    (:func:`tfdist.scratch.as_given`): for a writer whose paths are this rank's own (a Keras 3
    ``BackupAndRestore`` moved to ``backup_dir/rank-N``)."""

    def __init__(self, callback: Any, root: str | None = None) -> None:
        super().__init__(callback)
        self.root = root

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name != "on_train_end":
            return _as_given(getattr(object.__getattribute__(self, "callback"), name))
        return object.__getattribute__(self, name)

    def on_train_end(self, logs: Any = None) -> None:
        with as_given():
            self.callback.on_train_end(logs)
        if self.root and getattr(self.callback, "delete_checkpoint", False):
            with contextlib.suppress(OSError):  # another rank's folder is still there, or gone
                os.rmdir(self.root)  # as Keras removes its backup_dir in one process


def _empty(folder: str) -> None:
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


class Keras3BackupPerRank:
    """Keras 3's BackupAndRestore (the other base) with one directory per rank.

    Keras 3's callback is not multi-worker aware: two workers writing one directory race
    (FileExistsError) and abort the collectives. Each rank writes ``backup_dir/rank-N``, and
    every rank restores from rank 0's (the state is the same on every rank at an epoch's
    end), so every worker resumes from the same state: a rank with no backup of its own (the
    job grew) as one whose own is stale (left by a run with more workers).
    """

    _weights_path: str  # set by Keras's BackupAndRestore
    _training_metadata_path: str
    delete_checkpoint: bool

    def __init__(self, backup_dir: str, rank: int, *, strategy_spans_workers: bool = True,
                 **kwargs: Any) -> None:
        del strategy_spans_workers  # Keras 3's callback never keeps workers apart
        self.root = backup_dir
        super().__init__(os.path.join(backup_dir, f"rank-{rank}"),  # type: ignore[call-arg]
                         double_checkpoint=True, **kwargs)

    def on_train_begin(self, logs: Any = None) -> None:
        chief = os.path.join(self.root, "rank-0")
        if os.path.dirname(self._weights_path) == chief:
            return super().on_train_begin(logs)  # type: ignore[misc]  # rank 0: it recovers
        own = self._weights_path, self._training_metadata_path
        for suffix in ("", ".bkp"):  # rank 0's last complete one
            weights = os.path.join(chief, "latest.weights.h5" + suffix)
            if os.path.exists(weights):
                self._weights_path = weights
                self._training_metadata_path = os.path.join(
                    chief, "training_metadata.json" + suffix)
                break
        else:
            return None  # rank 0 has none: a backup of this rank alone is stale
        try:
            self._load_model()  # type: ignore[attr-defined]  # read-only: not rank 0's folder
        finally:
            self._weights_path, self._training_metadata_path = own

    def _save_model(self) -> None:
        started = time.monotonic()
        with as_given():  # this rank's own folder
            super()._save_model()  # type: ignore[misc]
        walltime.record_save(time.monotonic() - started)

    def on_train_end(self, logs: Any = None) -> None:
        super().on_train_end(logs)  # type: ignore[misc]
        if self.delete_checkpoint:  # the other ranks remove theirs at the same moment
            with contextlib.suppress(OSError):  # not empty yet, or already gone
                os.rmdir(self.root)


class Classes(NamedTuple):
    """A Keras's wrappers (the bodies above with its ``Callback``)."""

    chief_only: type
    chief_writes: type
    per_rank_files: type


def writer_kind(callback: Any) -> str | None:
    """What :func:`tfdist.keras.plan.route` is told ``callback`` is: a BackupAndRestore, a file
    writer tfdist knows, or None (anything else, tfdist's per-rank backup, a routed writer)."""
    if isinstance(callback, ChiefOnly | ChiefWrites | PerRankFiles):
        return None
    names = _names(callback)
    if "BackupAndRestore" in names:
        return None if "WorkerBackupAndRestore" in names else plan.BACKUP_WRITER
    return plan.FILE_WRITER if path_attribute(callback) else None


def route_writer(facts: plan.Facts, callback: Any, classes: Classes, *,
                 announce: bool = False) -> Any:
    """``callback`` as it must run on this rank so that every file is written once
    (:func:`tfdist.keras.plan.route`), in ``classes``' wrappers.

    Args:
        facts: the rank's.
        callback: a Keras callback.
        classes: the Keras's wrappers.
        announce: log on the chief, once per kind of writer, that a callback of the user's was
            rerouted.
    """
    how = plan.route(writer_kind(callback), facts)
    if how == plan.AS_GIVEN:
        return callback
    if how == plan.PER_RANK:
        _announce(facts, callback, announce, "keeps one folder per rank, backup_dir/rank-N")
        return _backup_per_rank(callback, facts, classes.per_rank_files)
    _announce(facts, callback, announce, "writes from the chief only; the other ranks " + (
        "write to a scratch directory that is removed" if how == plan.CHIEF_WRITES
        else "skip it"))
    if how == plan.CHIEF_WRITES:
        return classes.chief_writes(callback, facts.rank)
    return classes.chief_only(callback, facts.is_chief)


_announced: set[tuple[str, str]] = set()


def _announce(facts: plan.Facts, callback: Any, announce: bool, what: str) -> None:
    key = (type(callback).__name__, what)
    if announce and facts.is_chief and key not in _announced:
        _announced.add(key)
        logger.info("tfdist: %s %s", type(callback).__name__, what)


def _backup_per_rank(callback: Any, facts: plan.Facts, per_rank_files: type) -> Any:
    """The user's ``BackupAndRestore`` moved to ``backup_dir/rank-N``: one writer per folder."""
    root = str(callback.backup_dir)
    folder = os.path.join(root, f"rank-{facts.rank}")
    callback.backup_dir = folder
    if facts.keras == plan.TF_KERAS:
        return callback  # tf_keras reads backup_dir when training begins
    # Keras 3 derives its files' paths in __init__: move each one into the rank's folder.
    for name in ("_weights_path", "_training_metadata_path", "_prev_weights_path",
                 "_prev_training_metadata_path"):
        if isinstance(getattr(callback, name, None), str):
            setattr(callback, name, os.path.join(folder, os.path.relpath(
                getattr(callback, name), root)))
    return per_rank_files(callback, root)  # its saves are this rank's own: written as given
