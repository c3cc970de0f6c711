"""Keras writers wherever the user puts them: every file written once, complete when the save
returns.

A Keras script ported to several workers keeps its own writers: ``ModelCheckpoint``,
``BackupAndRestore``, ``CSVLogger`` or ``TensorBoard`` passed straight to ``fit``, and
``model.save`` or ``save_weights`` called after it, on every rank. Left alone, every rank
writes the same path at once (a corrupt ``.keras`` file, h5py's lock error, a race on a shared
file system). Installed when a TensorFlow backend spans several processes (:func:`install`),
two patches (:mod:`tfdist.patches`) route them the way ``dist.callbacks()`` routes its own:

- ``fit``'s callbacks go through :func:`tfdist.keras.callbacks.route_writer`: the chief writes, the
  other ranks write to a scratch folder that is removed (where a save runs collectives, under
  MultiWorkerMirroredStrategy) or skip the writer (Horovod); a ``BackupAndRestore`` gets one
  folder per rank. Where a save runs collectives, a checkpoint that one rank passes and another
  does not (Horovod's habit, ``if rank == 0: callbacks.append(...)``) would leave the ranks a
  collective apart: :class:`~tfdist.errors.ConfigError` before the first step, with the fix.
- ``model.save``, ``save_weights``, ``tf.saved_model.save`` and a custom loop's
  ``tf.train.Checkpoint.write`` and ``save`` (:func:`_save`) and
  ``tf.train.CheckpointManager.save`` (:func:`_manager_save`, a save to its directory).
  ``.keras``, ``.h5`` and SavedModel folders are written atomically, under a temporary name
  that is renamed (a checkpoint prefix, several files, as given). A rank that writes a scratch
  copy gets the written path back (``Checkpoint.save``'s ``prefix-3``; a manager names the
  writer's files), and the checkpoint saves run on every rank, so their numbering agrees.

  - MultiWorkerMirroredStrategy (a save runs collectives: every rank must run it). One small
    collective compares the ranks' paths first: each path is written once, by the first rank
    that gave it, and a rank whose path another rank writes saves a scratch copy that is
    removed. One path on every rank is the chief's file; a path per rank
    (``f"model-{rank}.keras"``) is each rank's own. A second collective after the writes holds
    every rank until all are renamed into place, so ``load_model`` right after ``save`` finds
    the file on every rank. Called on the chief alone, such a save stops with a
    :class:`~tfdist.errors.TfdistError` naming the fix when the others end or run another
    collective, at the latest after :data:`_ARRIVAL_S`.
  - During ``fit`` (a callback's save) no collective is added: the chief writes the path, the
    others a scratch copy, and they return at once. tfdist's routed checkpoints
    (:class:`tfdist.keras.callbacks.ChiefWrites`) save through here on the chief only (the others
    write their scratch copy as given), so a collective here would run on the chief alone.
  - Horovod: a save runs no collective, and scripts commonly save on rank 0 alone
    (``if hvd.rank() == 0: model.save(...)``), so tfdist adds none. The chief writes the path;
    the other ranks skip the save (a ``tf.train.Checkpoint``: write a scratch copy) and return
    at once, before the chief's file may be complete
    (a script that reads it on every rank waits first, e.g. ``dist.sum_over_ranks([0.0])``);
    a path that differs per rank is written by the chief only (files per rank: save them
    inside ``tfdist.per_rank_files()``).
  - Inside :func:`tfdist.scratch.as_given` (``tfdist.per_rank_files()``, and tfdist's own
    writers) a save writes its path as given, on the rank that calls it, with no collective.

Keras 3 on JAX installs none of this (:mod:`tfdist.backends.keras_jax`). Imported only by
:func:`tfdist.patches.install`, which runs :func:`install_user_writers` and
:func:`install_save_once` after the backend exists.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfdist import patches
from tfdist.errors import ConfigError, TfdistError
from tfdist.keras import callbacks
from tfdist.keras.checks import check_empty_replicas
from tfdist.scratch import as_given, atomic_path, in_per_rank_files, throwaway, writes_as_given

if TYPE_CHECKING:
    from tfdist.handle import Handle
    from tfdist.patches import Where

__all__ = ["check_same_savers", "install_save_once", "install_user_writers", "planned_by_tfdist"]

logger = logging.getLogger("tfdist")


def install_user_writers(where: Where, dist: Handle) -> None:
    """Patch ``user-writers``'s installer (:func:`tfdist.patches.install`): routes the writers
    passed to every Keras model's ``fit`` in this process (once; several processes)."""
    patches.apply("user-writers", tf.keras.Model, "fit", lambda original: _fit(original, dist))


def install_save_once(where: Where, dist: Handle) -> None:
    """Patch ``save-once``'s installer: every Keras model's saves, and TensorFlow's SavedModel
    writer, write each path once (once; several processes)."""
    model_class = tf.keras.Model
    for name in ("save", "save_weights"):
        patches.apply("save-once", model_class, name, functools.partial(_save, dist=dist,
                                                                         name=name))
    # TensorFlow's own SavedModel writer: the same collectives under MWMS, one folder.
    patches.apply("save-once", tf.saved_model, "save", functools.partial(
        _save, dist=dist, name="tf.saved_model.save", keyword="export_dir"))
    # A custom loop's tf.train.Checkpoint on every rank: one prefix, routed the same way. Every
    # rank writes (the others a scratch copy, under Horovod too), so save's numbering
    # (save_counter) stays the same on every rank, and every rank gets the chief's path back.
    for name in ("write", "save"):
        patches.apply("save-once", tf.train.Checkpoint, name, functools.partial(
            _save, dist=dist, name=f"tf.train.Checkpoint.{name}", keyword="file_prefix"))
    patches.apply("save-once", tf.train.CheckpointManager, "save",
                  functools.partial(_manager_save, dist=dist))


# How long a save under MultiWorkerMirroredStrategy waits for every rank to arrive at it: a
# bound for a save called on some ranks only, not a working time (the ranks arrive together).
_ARRIVAL_S = 600.0
# fit calls under way in this process (any thread: Keras may run callbacks on a pool). Their
# callbacks' saves run no collective here (see the module's docstring).
_fitting = 0


def _fit(original: Any, dist: Handle) -> Any:
    def route(bound: inspect.BoundArguments) -> None:
        check_empty_replicas(bound.arguments.get("self"), _rows_left(bound.arguments),
                             int(dist.num_replicas))
        given = bound.arguments.get("callbacks")
        own = per_rank_writers(dist, given if isinstance(given, Sequence) else ())
        if isinstance(given, Sequence):
            routed = [callbacks.PerRankFiles(c) if i in own
                      else callbacks.route_writer(dist, c, announce=True)
                      for i, c in enumerate(given)]
            bound.arguments["callbacks"] = routed
            if dist.save_on_every_rank:
                check_same_savers(dist, routed)
        if given is None or isinstance(given, Sequence):
            planned = planned_by_tfdist(given or ())
            averaged = _batch_statistics_averaged(dist, bound.arguments.get("self"),
                                                  bound.arguments.get("callbacks") or [],
                                                  add=not planned)
            if averaged is not None:
                bound.arguments["callbacks"] = averaged

    routed_fit = patches.rebinding(original, route)

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _fitting
        _fitting += 1
        try:
            return routed_fit(self, *args, **kwargs)
        finally:
            _fitting -= 1

    return fit


def planned_by_tfdist(given: Sequence[Any]) -> bool:
    """Whether ``given`` (a fit's callbacks) holds ``dist.callbacks()``'s, whose
    ``average_batch_statistics=`` then decides (pure). tfdist verify's recorder, an observer
    added to every fit, is no such plan: taken for one, it left a model's BatchNormalization
    statistics unaveraged under verify alone."""
    return any(type(c).__module__.startswith("tfdist.")
               and not type(c).__module__.startswith("tfdist.verify.") for c in given)


def _rows_left(arguments: Mapping[str, Any]) -> int | None:
    """The rows of the last batch of each epoch of ``fit``'s input when it is short, 0 when
    none is, None when not known."""
    from tfdist import sharding
    from tfdist.keras.fit_inputs import arrays_rows_left, is_arrays

    x = arguments.get("x")
    if is_arrays(x):
        return arrays_rows_left(arguments)
    return sharding.last_batch_rows(x) if hasattr(x, "cardinality") else None


# A fit's writers whose paths are compared over the ranks: at most this many (one sum).
_COMPARED = 8
_WRITER_PATHS = ("filepath", "filename", "log_dir", "backup_dir", "_backup_dir")


def per_rank_writers(dist: Handle, given: Sequence[Any]) -> set[int]:
    """The indices of ``given``'s file writers whose path differs from rank to rank (a
    ``tempfile.mkdtemp()`` per rank): each rank writes its own, as given
    (:class:`tfdist.keras.callbacks.PerRankFiles`), and reads it back after ``fit``; the others
    are routed (one file, from the chief). One sum over the ranks of
    a fixed size, every fit call on every rank: the writers' count and, for each of the first
    :data:`_COMPARED`, three bytes of its path's fingerprint and their squares (values are all
    equal exactly when the squared sum is the ranks times the sum of squares; bytes keep the
    float32 sums exact up to 256 ranks, beyond which every writer is routed)."""
    found = [(i, _writer_path(c)) for i, c in enumerate(given)]
    paths = [(i, p) for i, p in found if p][:_COMPARED]
    values = [float(len(paths)), float(len(paths)) ** 2]
    for slot in range(_COMPARED):
        marks = _marks(paths[slot][1]) if slot < len(paths) else [0.0] * _MARKS
        for mark in marks:
            values += [mark, mark * mark]
    n = dist.world_size
    sums = dist.sum_over_ranks(values)
    if n > 256 or round(sums[0]) ** 2 != n * round(sums[1]):  # other writers per rank: route
        return set()

    def apart(slot: int) -> bool:
        start = 2 + 2 * _MARKS * slot
        return any(round(sums[start + 2 * j]) ** 2 != n * round(sums[start + 2 * j + 1])
                   for j in range(_MARKS))

    return {i for slot, (i, _) in enumerate(paths) if apart(slot)}


_MARKS = 3  # bytes of a path's fingerprint compared: two paths agree on all by chance 2**-24


def _marks(path: str) -> list[float]:
    digest = _fingerprint(path) & 0xFFFFFF
    return [float(((digest >> (8 * j)) & 0xFF) + 1) for j in range(_MARKS)]


def _writer_path(callback: Any) -> str | None:
    for name in _WRITER_PATHS:
        value = getattr(callback, name, None)
        if isinstance(value, str | os.PathLike) and str(value):
            return str(value)
    return None


_told_statistics: set[type] = set()


def _batch_statistics_averaged(dist: Handle, model: Any, given: Sequence[Any], *,
                               add: bool = True) -> list[Any] | None:
    """``given`` with the BatchNormalization statistics averaged at each epoch's end, for a
    model that has unsynchronised ones and a fit without ``dist.callbacks()``: the ranks would
    end with other moving statistics (apart, each its own rows'); one line on the chief says
    what still differs from one process. None: nothing to add."""
    from tfdist.keras import batch_statistics as statistics
    from tfdist.settings import resolve

    if (model is None or not statistics.averages_batch_statistics(dist)
            or not resolve("batch_statistics") or not statistics.has_batch_statistics(model)):
        return None
    if dist.is_chief and type(model) not in _told_statistics:
        _told_statistics.add(type(model))
        logger.warning(
            "tfdist: %s's BatchNormalization layers normalise each replica's rows with their "
            "own batch statistics (one process normalises over the whole batch), so the numbers "
            "differ from one process's; their moving statistics are averaged over the replicas "
            "at each epoch's end (unless dist.callbacks(average_batch_statistics=False)). For "
            "one process's numbers: "
            "BatchNormalization(synchronized=True)", type(model).__name__)
    if not add or any(isinstance(c, statistics.BatchStatisticsAverage) for c in given):
        return None
    return [*given, statistics.BatchStatisticsAverage(dist)]


def check_same_savers(dist: Handle, given: Sequence[Any]) -> None:
    """Refuses, on every rank alike, callbacks that save the model on some ranks only.

    Under MultiWorkerMirroredStrategy a save runs collectives, so every rank must run it. One
    small sum over the ranks: the count of savers and its square; the counts are all equal
    exactly when (sum of counts)^2 = ranks * (sum of squares).

    Raises:
        ConfigError: the ranks pass different numbers of model-saving callbacks.
    """
    mine = [type(getattr(c, "callback", c)).__name__ for c in given if callbacks.saves_model(c)]
    total, squares = dist.sum_over_ranks([len(mine), len(mine) ** 2])
    if round(total) ** 2 == dist.world_size * round(squares):
        return
    raise ConfigError(
        f"the ranks pass fit different checkpoints (rank {dist.rank}: "
        f"{', '.join(mine) or 'none'}; {round(total)} over {dist.world_size} ranks): under "
        "MultiWorkerMirroredStrategy a save runs collectives on every rank, so a checkpoint "
        "on one rank alone leaves the others a collective behind. Pass the same callbacks on "
        "every rank (drop `if rank == 0:`): tfdist writes their files from the chief only")


_announced: set[tuple[str, str]] = set()


def _save(original: Any, dist: Handle, name: str, keyword: str = "filepath") -> Any:
    """``original(self, path, ...)``, a save of ``self`` to the path given first or as
    ``keyword``, routed as the module's docstring says."""
    @functools.wraps(original)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = keyword if keyword in kwargs else 0
        path = kwargs[keyword] if where == keyword else (args[0] if args else None)
        if not isinstance(path, str | os.PathLike):
            return original(self, *args, **kwargs)  # a file object

        def to(target: str) -> Any:
            if where == keyword:
                return original(self, *args, **{**kwargs, keyword: target})
            return original(self, target, *args[1:], **kwargs)

        path = os.fspath(path)
        if in_per_rank_files() and dist.world_size > 1 and not _names_rank(path, dist.rank):
            return _one_path_on_every_rank(dist, name, path, to)
        if writes_as_given():
            return original(self, *args, **kwargs)  # tfdist's own writers
        write = functools.partial(_write, to, overwrite=kwargs.get("overwrite", True),
                                  folder=name in _FOLDERS)
        return _routed(dist, name, path, to, write)

    return save


def _names_rank(path: str | os.PathLike[str], rank: int) -> bool:
    """Whether ``path``'s file or folder name names ``rank`` (the number, apart from other
    digits: ``model-1.keras``, ``rank1/model.keras``) (pure). The folders above are the run's,
    alike on every rank."""
    folder, name = os.path.split(os.path.normpath(os.fspath(path)))
    return re.search(rf"(?<!\d){rank}(?!\d)", os.path.join(os.path.basename(folder),
                                                            name)) is not None


_said_one_path: set[str] = set()


def _one_path_on_every_rank(dist: Handle, name: str, path: str,
                            to: Callable[[str], Any]) -> Any:
    """A save inside ``tfdist.per_rank_files()`` whose path names no rank: every rank may write
    that one path at once. Each writes a temporary name and renames it, so the file is whole
    (the last rank's); the chief says so once per path, with the fix."""
    if dist.is_chief and path not in _said_one_path:
        _said_one_path.add(path)
        logger.warning("tfdist: %s(%r) inside tfdist.per_rank_files(): the path names no rank, "
                       "so every rank writes this one file (it stays whole: the last rank's). "
                       "Fix: put the rank in the path (f\"...-{dist.rank}...\"), or save outside "
                       "per_rank_files(), where the chief writes it once", _label(name), path)
    with atomic_path(path) as partial:
        return to(partial)


def _routed(dist: Handle, name: str, path: str, to: Callable[[str], Any],
            write: Callable[[str], Any]) -> Any:
    """A save of ``path`` routed as the module's docstring says: ``write(path)`` where this
    rank writes it, ``to(copy)`` where it writes a scratch copy."""
    with as_given():
        if dist.save_on_every_rank and not _fitting:
            return _written_before_return(dist, name, path, to, write)
        return _from_the_chief(dist, name, path, to, write)


# The saves whose path without a suffix is a folder (a SavedModel); the others' is a checkpoint
# prefix (several files, written as given).
_FOLDERS = ("save", "tf.saved_model.save")
# The saves every rank runs under Horovod too (a scratch copy): tf.train.Checkpoint.save numbers
# its files by a counter each call advances, and both return the path written.
_EVERY_RANK = ("tf.train.Checkpoint.write", "tf.train.Checkpoint.save",
               "tf.train.CheckpointManager.save")


def _manager_save(original: Any, dist: Handle) -> Any:
    """``tf.train.CheckpointManager.save`` routed as a save to the manager's directory: a rank
    that does not write it saves, numbers and sweeps in a scratch copy of the directory, and
    its manager then names the writer's files (``latest_checkpoint``, ``checkpoints``)."""
    name = "tf.train.CheckpointManager.save"

    @functools.wraps(original)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        if writes_as_given():
            return original(self, *args, **kwargs)
        directory = os.fspath(self._directory)

        def to(target: str) -> Any:
            if target == directory:
                return original(self, *args, **kwargs)
            return _in_directory(self, directory, target,
                                 lambda: original(self, *args, **kwargs))

        return _routed(dist, name, directory, to, to)

    return save


def _in_directory(manager: Any, directory: str, copy: str, save: Callable[[], Any]) -> Any:
    """``save()`` with ``manager`` pointed at ``copy`` in place of ``directory``: its files, its
    state file and the deletion of its old checkpoints land in ``copy``; after it, the manager's
    paths name ``directory`` again (the files the writer wrote)."""
    def moved(path: str | None, source: str, target: str) -> str | None:
        return target + path[len(source):] if path and path.startswith(source) else path

    def point(source: str, target: str) -> None:
        manager._directory = target
        manager._checkpoint_prefix = moved(manager._checkpoint_prefix, source, target)
        manager._latest_checkpoint = moved(manager._latest_checkpoint, source, target)
        kept = list(manager._maybe_delete.items())
        manager._maybe_delete.clear()
        for path, stamp in kept:
            manager._maybe_delete[moved(path, source, target)] = stamp

    point(directory, copy)
    try:
        return _as_written(save(), copy, directory)
    finally:
        point(copy, directory)


def _written_before_return(dist: Handle, name: str, path: str,
                           to: Callable[[str], Any], write: Callable[[str], Any]) -> Any:
    """Where a save runs collectives (every rank runs it): each path written once, by the first
    rank that gave it, the others' copies thrown away; no rank returns before every path is
    complete. Two collectives: the paths compared, then a barrier after the writes."""
    writer, paths = _writer_of(dist, name, path)
    _announce_agreed(dist, name, path, writer, paths)
    if writer == dist.rank:
        result = write(path)
    else:  # the same collectives as the writer's save
        with throwaway(dist.rank, path) as copy:
            result = _as_written(to(copy), copy, path)
    dist.sum_over_ranks([0.0])  # every rank's file renamed into place before any returns
    return result


def _writer_of(dist: Handle, name: str, path: str) -> tuple[int, int]:
    """The rank that writes ``path`` (the lowest that gave it) and how many different paths the
    ranks gave: one gather of each replica's ``(rank, hash of the absolute path)``.

    Raises:
        TfdistError: not every rank arrived within :data:`_ARRIVAL_S`, or a rank ended or ran
            another collective instead (a save on the chief alone).
    """
    mine = _fingerprint(path)
    rows = np.array([[dist.rank, mine]] * dist.local_replicas, dtype=np.int64)
    try:
        table = dist.gather_rows(rows, _ARRIVAL_S)
    except (TfdistError, tf.errors.OpError) as error:
        said = (str(error) if isinstance(error, TfdistError)
                else f"the comparison of the paths failed: {type(error).__name__}, above")
        raise TfdistError(
            f"{_label(name)}({path!r}) on rank {dist.rank}: not every rank reached this save "
            f"({said}). Under MultiWorkerMirroredStrategy a save runs collectives: call it on "
            "every rank at the same point, not under `if rank == 0:` or `if dist.is_chief:` "
            "(tfdist writes the file once, and every rank returns once it is written)"
        ) from error
    first: dict[int, int] = {}
    for rank, digest in table.tolist():
        first[digest] = min(first.get(digest, rank), rank)
    return first[mine], len(first)


def _fingerprint(path: str) -> int:
    """A signed 64-bit hash of the absolute ``path`` (a collective carries int64)."""
    absolute = os.path.abspath(path.rstrip("/") or path)
    return int.from_bytes(hashlib.blake2b(absolute.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _from_the_chief(dist: Handle, name: str, path: str, to: Callable[[str], Any],
                    write: Callable[[str], Any]) -> Any:
    """The routing without a collective of its own: the chief writes ``path``; the others write
    a scratch copy (where a save runs collectives) or nothing, and return at once."""
    if dist.is_chief and (name, "chief") not in _announced:
        _announced.add((name, "chief"))
        logger.info(
            "tfdist: %s(%r)%s writes from the chief only; the other ranks %s (for files that "
            "differ per rank: `with tfdist.per_rank_files():`)", _label(name), path,
            " during fit" if dist.save_on_every_rank else "",
            "write a scratch copy that is removed"
            if dist.save_on_every_rank or name in _EVERY_RANK else "skip it")
    if dist.is_chief:
        return write(path)
    if dist.save_on_every_rank or name in _EVERY_RANK:  # the chief's collectives, its counter
        with throwaway(dist.rank, path) as copy:
            return _as_written(to(copy), copy, path)
    return None


def _as_written(result: Any, copy: str, path: str) -> Any:
    """A save's result on a rank that wrote the scratch ``copy`` of ``path``: a path returned
    (``tf.train.Checkpoint.save``'s ``copy-3``) names the file the writer wrote (``path-3``)."""
    if isinstance(result, str) and result.startswith(copy):
        return path + result[len(copy):]
    return result


def _write(to: Callable[[str], Any], path: str, *, overwrite: Any, folder: bool) -> Any:
    """Writes ``path`` under a temporary name, renamed when complete: a file (``.keras``,
    ``.h5``) or, with ``folder``, a SavedModel folder (which replaces the old one). A checkpoint
    prefix (several files) is written as given; so is a file Keras asks before overwriting."""
    atomic = path.endswith((".keras", ".h5")) or folder
    if not atomic or (not overwrite and os.path.exists(path)):
        return to(path)
    with atomic_path(path) as partial:
        return to(partial)


def _announce_agreed(dist: Handle, name: str, path: str, writer: int, paths: int) -> None:
    """One line per kind of save: with one path, on the chief; with paths that differ, on every
    rank (INFO, which the chief shows), what happens to that rank's own path."""
    if paths == 1:
        if dist.is_chief and (name, "one path") not in _announced:
            _announced.add((name, "one path"))
            logger.info("tfdist: %s(%r) on every rank: the chief writes it, the other ranks a "
                        "scratch copy that is removed; every rank returns once it is written",
                        _label(name), path)
        return
    if (name, "paths") in _announced:
        return
    _announced.add((name, "paths"))
    logger.info("tfdist: %s(%r): the ranks gave %d different paths; each is written once, by "
                "the first rank that gave it (this one by rank %d%s), and every rank returns "
                "once all are written", _label(name), path, paths, writer,
                ", this rank" if writer == dist.rank
                else f"; rank {dist.rank} writes a scratch copy")


def _label(name: str) -> str:
    """``model.save``, ``model.save_weights``, ``tf.saved_model.save``."""
    return name if "." in name else f"model.{name}"
