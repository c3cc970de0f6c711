"""Where the ranks that do not write put what they must write anyway.

Under MultiWorkerMirroredStrategy every worker runs a save (it may run collectives), but only the
chief's copy is kept: the others write into a private scratch folder that is thrown away.

Also the two rules every writer of tfdist's follows: a file is written under a temporary name
beside it and renamed (:func:`atomic_path`), and inside :func:`as_given` a save writes where it
is told, on every rank (:mod:`tfdist.keras.writers` routes the others to the chief).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["as_given", "atomic_path", "in_per_rank_files", "keeps_config", "own_file",
           "per_rank_files", "remove_scratch_dirs", "save_atomically", "save_once", "scratch_dir",
           "throwaway", "writes_as_given"]

_made: list[str] = []


def scratch_dir(rank: int) -> str:
    """A new private directory for a non-chief rank's throw-away writes (node-local temp).

    Removed at the latest when the process exits, also when training stopped with an error.
    """
    folder = tempfile.mkdtemp(prefix=f"tfdist-rank{rank}-")
    _made.append(folder)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def remove_scratch_dirs() -> None:
    """Removes every scratch directory made so far (for an exit that skips ``atexit``)."""
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


_as_given = threading.local()


@contextlib.contextmanager
def as_given() -> Iterator[None]:
    """Inside, ``model.save`` and ``save_weights`` write exactly where they are told, on every
    rank: for files that differ per rank, and for tfdist's own writers, which route themselves.
    Outside, under several workers, :mod:`tfdist.keras.writers` writes them once, from the chief."""
    _as_given.depth = getattr(_as_given, "depth", 0) + 1
    try:
        yield
    finally:
        _as_given.depth -= 1


def writes_as_given() -> bool:
    """Whether this thread is inside :func:`as_given`."""
    return getattr(_as_given, "depth", 0) > 0


@contextlib.contextmanager
def per_rank_files() -> Iterator[None]:
    """``tfdist.per_rank_files()``: :func:`as_given` for the script's own saves, files that
    differ per rank. A save inside whose path names no rank is written whole all the same (to
    a temporary name, renamed: :mod:`tfdist.keras.writers`), and said once."""
    _as_given.mine = getattr(_as_given, "mine", 0) + 1
    try:
        with as_given():
            yield
    finally:
        _as_given.mine -= 1


def in_per_rank_files() -> bool:
    """Whether this thread is inside the script's :func:`per_rank_files`."""
    return getattr(_as_given, "mine", 0) > 0


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` to write to; renamed to ``path`` when the block ends
    without an error, removed when it raises. A job killed mid-write leaves the previous file.
    A folder written there replaces a folder at ``path`` (two renames: a kill between them
    leaves the new folder under the temporary name and the old one under ``.old-``).

    The process id keeps two writers of one path apart (several one-process jobs sharing a
    folder): each renames a complete file, and the last one wins.
    """
    path = os.fspath(path).rstrip("/") or path
    folder = os.path.dirname(path)
    os.makedirs(folder or ".", exist_ok=True)
    partial = os.path.join(folder, f".partial-{os.getpid()}-{os.path.basename(path)}")
    try:
        yield partial
    except BaseException:
        _remove(partial)
        raise
    if os.path.isdir(partial) and os.path.isdir(path):  # a folder (a SavedModel) replaces one
        old = os.path.join(folder, f".old-{os.getpid()}-{os.path.basename(path)}")
        os.replace(path, old)
        os.replace(partial, path)
        _remove(old)
    else:
        os.replace(partial, path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def throwaway(rank: int, path: str) -> Iterator[str]:
    """Where a non-chief rank writes its copy of ``path`` (same base name, in a new scratch
    folder), written as given; the folder is removed when the block ends."""
    folder = scratch_dir(rank)
    try:
        with as_given():
            yield os.path.join(folder, os.path.basename(str(path).rstrip("/")) or "out")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def keeps_config(model: Any) -> bool:
    """Whether ``model.save`` can write ``model``'s config: a model whose constructor takes
    other models (a VAE, a GAN, a distiller) has no ``get_config`` (NotImplementedError)."""
    try:
        model.get_config()
    except NotImplementedError:
        return False
    except Exception:  # any other failure: model.save says it
        return True
    return True


def own_file(model: Any, path: str) -> str:
    """Where tfdist's own save of ``model`` to ``path`` (``checkpoint.keras``, the exact
    state's ``model.keras``) goes: ``path``, or for a model without a config its weights and
    optimizer's state beside it (``.weights.h5``: what ``load_weights`` reads back)."""
    if path.endswith(".keras") and not keeps_config(model):
        _built_by_its_layers(model)
        return path[: -len(".keras")] + ".weights.h5"
    return path


def _built_by_its_layers(model: Any) -> None:
    """A model without ``call()`` is never built by Keras, though the models it holds are
    (its step called them): it is, for ``save_weights``, once every layer it holds is."""
    layers = getattr(model, "_flatten_layers", None)
    if getattr(model, "built", True) or layers is None:
        return
    held = [layer for layer in layers(include_self=False) if layer is not model]
    if held and all(getattr(layer, "built", False) for layer in held):
        model.built = True


def _save_to(model: Any, path: str) -> None:
    if path.endswith(".weights.h5"):
        model.save_weights(path)
    else:
        model.save(path)


def save_atomically(model: Any, path: str) -> None:
    """``model.save(path)`` (``save_weights`` for a ``.weights.h5`` path) under a temporary
    name, renamed when complete, written as given."""
    with atomic_path(path) as partial, as_given():
        _save_to(model, partial)


def save_once(is_chief: bool, rank: int, every_rank: bool, model: Any, path: str) -> bool:
    """``model.save(path)`` (``save_weights`` for a ``.weights.h5`` path) once, from the chief,
    atomically; where a save runs collectives (``every_rank``) the other ranks save into a
    scratch folder removed at once, so that every rank runs the same collectives; elsewhere
    they return at once. Whether this process wrote ``path``."""
    if is_chief:
        save_atomically(model, path)
        return True
    if every_rank:
        with throwaway(rank, path) as copy:
            _save_to(model, copy)
    return False
