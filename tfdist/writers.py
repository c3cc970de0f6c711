"""Keras writers wherever the user puts them: every file written once, by the chief.

A Keras script ported to several workers keeps its own writers: ``ModelCheckpoint``,
``BackupAndRestore``, ``CSVLogger`` or ``TensorBoard`` passed straight to ``fit``, and
``model.save`` or ``save_weights`` called after it, on every rank. Left alone, every rank
writes the same path at once (a corrupt ``.keras`` file, h5py's lock error, a race on a shared
file system). Installed when a TensorFlow backend spans several processes (:func:`install`),
two patches (:mod:`tfdist.patches`) route them the way ``dist.callbacks()`` routes its own:

- ``fit``'s callbacks go through :func:`tfdist.callbacks.route_writer`: the chief writes, the
  other ranks write to a scratch folder that is removed (where a save runs collectives, under
  MultiWorkerMirroredStrategy) or skip the writer (Horovod); a ``BackupAndRestore`` gets one
  folder per rank. Where a save runs collectives, a checkpoint that one rank passes and another
  does not (Horovod's habit, ``if rank == 0: callbacks.append(...)``) would leave the ranks a
  collective apart: :class:`~tfdist.errors.ConfigError` before the first step, with the fix.
- ``model.save``, ``save_weights`` and ``tf.saved_model.save``: the chief writes the file
  (``.keras``, ``.h5`` and SavedModel folders atomically, under a temporary name that is
  renamed), the other ranks write a scratch copy that is removed (MultiWorkerMirroredStrategy:
  the save runs collectives) or nothing (Horovod). Called on the chief alone, a save under
  MultiWorkerMirroredStrategy leaves the others a collective behind: call it on every rank.
  Files that differ per rank are written as given inside :func:`tfdist.scratch.as_given`
  (``tfdist.per_rank_files()``).

Imported only by :func:`install`, after the backend exists.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tfdist import callbacks, patches
from tfdist.errors import ConfigError
from tfdist.scratch import as_given, atomic_path, throwaway, writes_as_given

if TYPE_CHECKING:
    from tfdist.backends.base import Distributed

__all__ = ["check_same_savers", "install"]

logger = logging.getLogger("tfdist")


def install(dist: Distributed) -> None:
    """Routes the writers of every Keras model of this process (once; several processes)."""
    model_class = tf.keras.Model
    patches.apply("user-writers", model_class, "fit", lambda original: _fit(original, dist))
    for name in ("save", "save_weights"):
        patches.apply("save-once", model_class, name, functools.partial(_save, dist=dist,
                                                                         name=name))
    # TensorFlow's own SavedModel writer: the same collectives under MWMS, one folder.
    patches.apply("save-once", tf.saved_model, "save", functools.partial(
        _save, dist=dist, name="tf.saved_model.save", keyword="export_dir"))


def _fit(original: Any, dist: Distributed) -> Any:
    def route(bound: inspect.BoundArguments) -> None:
        given = bound.arguments.get("callbacks")
        if isinstance(given, Sequence):
            routed = [callbacks.route_writer(dist, c, announce=True) for c in given]
            bound.arguments["callbacks"] = routed
            if dist.save_on_every_rank:
                check_same_savers(dist, routed)

    return patches.rebinding(original, route)


def check_same_savers(dist: Distributed, given: Sequence[Any]) -> None:
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


_announced: set[str] = set()


def _save(original: Any, dist: Distributed, name: str, keyword: str = "filepath") -> Any:
    """``original(self, path, ...)``, a save of ``self`` to the path given first or as
    ``keyword``, written once from the chief."""
    @functools.wraps(original)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        where = keyword if keyword in kwargs else 0
        path = kwargs[keyword] if where == keyword else (args[0] if args else None)
        if writes_as_given() or not isinstance(path, str | os.PathLike):
            return original(self, *args, **kwargs)  # tfdist's own writers, or a file object

        def to(target: str) -> Any:
            if where == keyword:
                return original(self, *args, **{**kwargs, keyword: target})
            return original(self, target, *args[1:], **kwargs)

        path = os.fspath(path)
        _announce(dist, name, path)
        with as_given():
            if dist.is_chief:
                return _chief_writes(to, path, kwargs.get("overwrite", True),
                                     folder=name != "save_weights")
            if dist.save_on_every_rank:  # the same collectives as the chief's save
                with throwaway(dist.rank, path) as copy:
                    return to(copy)
            return None

    return save


def _chief_writes(to: Any, path: str, overwrite: Any, *, folder: bool) -> Any:
    """Writes ``path`` under a temporary name, renamed when complete: a file (``.keras``,
    ``.h5``) or, with ``folder``, a SavedModel folder (which replaces the old one). A checkpoint
    prefix (several files) is written as given; so is a file Keras asks before overwriting."""
    atomic = path.endswith((".keras", ".h5")) or folder
    if not atomic or (not overwrite and os.path.exists(path)):
        return to(path)
    with atomic_path(path) as partial:
        return to(partial)


def _announce(dist: Distributed, name: str, path: str) -> None:
    if dist.is_chief and name not in _announced:
        _announced.add(name)
        logger.info(
            "tfdist: model.%s(%r) writes from the chief only; the other ranks %s (for files "
            "that differ per rank: `with tfdist.per_rank_files():`)", name, path,
            "write a scratch copy that is removed" if dist.save_on_every_rank else "skip it")
