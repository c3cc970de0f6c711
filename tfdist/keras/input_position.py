"""Where ``fit``'s input is, and how a resumed ``fit`` continues there: the step, the iterator and
the batch, for Keras 3 and tf_keras alike.

A ``fit`` over a ``tf.data`` dataset reads one iterator per epoch, or one for several epochs
(``steps_per_epoch`` over a repeated dataset). Every new iterator of a dataset that reshuffles
each epoch draws a new order from the dataset's seed generator, so a resumed run sees the stopped
run's order only when it makes as many iterators first. A position is therefore two numbers:
which iterator the epoch reads (counted from the first ``fit`` of the process's dataset) and how
many batches were drawn from it.

:func:`plan` turns a saved position into what the resumed ``fit`` does (pure, tested as a
table); :class:`Keras3Input` and :class:`TfKerasInput` read positions off the two trainers and
carry the plan out. Both count the iterators the trainer makes through a hook that one
installer per Keras puts in place once (:func:`install_keras3`, :func:`install_keras2`,
:func:`install_jax`: patches ``keras3-input-position``, ``keras2-input-position``,
``jax-input-position``); :func:`current` is the input of the ``fit`` that is starting (read it
in ``on_train_begin``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from tfdist import patches
from tfdist.keras import iterators
from tfdist.keras.versions import keras2_module, keras2_package
from tfdist.throughput import arrivals

if TYPE_CHECKING:
    from tfdist.patches import Where

__all__ = ["JaxInput", "Keras3Input", "Position", "Resume", "SeedsOnly", "TfKerasInput", "current",
           "install_jax", "install_keras2", "install_keras3", "plan", "rebatch", "seeds_only",
           "tracked"]

logger = logging.getLogger("tfdist")


class Position(NamedTuple):
    """Where the input stands: the number of the iterator the epoch reads (1 for the first made)
    and the batches drawn from that iterator so far."""

    iterator: int
    drawn: int


class Resume(NamedTuple):
    """What a resumed ``fit`` does: start at ``epoch`` and ``step`` with iterator number
    ``iterator``, ``skip`` batches of which are drawn (and dropped) first."""

    epoch: int
    step: int
    iterator: int
    skip: int


def plan(saved: Position, epoch: int, step: int, *, epoch_done: bool,
         recreates: bool) -> Resume:
    """The resumption of a run stopped after ``step`` steps of ``epoch`` at ``saved``.

    Args:
        saved: the input's position when the run stopped.
        epoch: the epoch it stopped in (0-based).
        step: the steps of that epoch it had trained.
        epoch_done: whether it stopped after the epoch's last step (at its end, or while
            validating): the resumed run starts with the next epoch.
        recreates: whether the trainer makes a new iterator for every epoch (a dataset read
            once per epoch) or reads one across epochs (``steps_per_epoch``).
    """
    if not epoch_done:
        return Resume(epoch, step, saved.iterator, saved.drawn)
    if recreates:
        return Resume(epoch + 1, 0, saved.iterator + 1, 0)
    return Resume(epoch + 1, 0, saved.iterator, saved.drawn)


def rebatch(at: Resume, saved_batch: int | None, batch: int | None) -> Resume | None:
    """``at``, planned in batches of ``saved_batch`` rows, in batches of ``batch`` rows (pure):
    the same rows skipped and trained, so a run resumed with another global batch goes on at
    the row where the stopped one was. ``at`` as it is where either size is unknown or they are
    equal; None where the rows are not a whole number of the new batches (no exact resume)."""
    if not saved_batch or not batch or saved_batch == batch:
        return at
    skip, step = at.skip * saved_batch, at.step * saved_batch
    if skip % batch or step % batch:
        return None
    return at._replace(skip=skip // batch, step=step // batch)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """A batch's part as Keras's symbolic build reads it: a leaf of Keras's tree functions
    (as a NamedTuple, they walked into its shape and failed on an int: "'int' object has no
    attribute 'shape'", the resume of a subclassed model fed one array, ``fit(x)``)."""

    shape: tuple[int | None, ...]
    dtype: str


def _adapter_batch(adapter: Any) -> int | None:
    """A Keras data adapter's rows per batch: its dataset's ``batch`` (tf.data), or the batch
    size it was given (arrays); None where not a constant."""
    from tfdist.throughput import batch_size_of

    dataset = getattr(adapter, "_dataset", None)
    if dataset is not None:
        return batch_size_of(dataset)
    size = getattr(adapter, "batch_size", None)
    size = size() if callable(size) else size
    return int(size) if isinstance(size, int) and size > 0 else None


def _skip(iterator: Any, count: int) -> Any:
    """Draws ``count`` batches from ``iterator`` and drops them; says how long that took."""
    if count:
        started = time.monotonic()
        for _ in range(count):
            next(iterator)
        logger.info("tfdist: skipped %d batches already trained on in %.1f s", count,
                    time.monotonic() - started)
    return iterator


class Keras3Input:
    """The input of a Keras 3 ``fit``: its ``TFEpochIterator``.

    Without ``steps_per_epoch`` Keras makes an iterator for every epoch; with it, one iterator
    lasts until the data runs out (never, for a repeated dataset), and a new one follows.
    """

    batch_offset = 0  # steps of the resumed epoch done before: Keras 3 counts batches from 0

    def __init__(self, epoch_iterator: Any) -> None:
        self.data = epoch_iterator
        self._steps_per_epoch = epoch_iterator.steps_per_epoch

    @property
    def recreates(self) -> bool:
        return self._steps_per_epoch is None

    def position(self, step: int) -> Position:
        """The position after ``step`` steps of the current epoch (or at its end)."""
        created = self.data._tfdist_created
        return Position(created, step if self.recreates else self.data._steps_seen)

    def epoch_steps(self) -> int | None:
        """Steps in a whole epoch, when known."""
        return self._steps_per_epoch or self.data.data_adapter.num_batches

    def batch_size(self) -> int | None:
        """Rows per batch of the input, when it is a constant."""
        return _adapter_batch(self.data.data_adapter)

    def element_spec(self) -> Any:
        """The shapes and types of a batch (``shape`` and ``dtype`` each), without drawing one;
        None where unknown."""
        adapter = self.data.data_adapter
        dataset = getattr(adapter, "_dataset", None)
        if dataset is not None and hasattr(dataset, "element_spec"):
            return dataset.element_spec
        arrays = getattr(adapter, "_inputs", None)
        if arrays is None:
            return None
        from keras import tree

        return tree.map_structure(
            lambda a: None if a is None else _Spec((None, *a.shape[1:]), str(a.dtype)), arrays)

    def resume(self, at: Resume) -> None:
        data = self.data
        prepared = self._prepare(at)
        self.batch_offset = at.step
        if self.recreates:
            data._tfdist_next = prepared
            if at.step and data.data_adapter.num_batches:
                data._num_batches = data.data_adapter.num_batches - at.step
        else:
            data._current_iterator, data._steps_seen = prepared, at.skip
            if at.step:
                data.steps_per_epoch = self._steps_per_epoch - at.step

    def _prepare(self, at: Resume) -> Any:
        """Iterator number ``at.iterator``, its first ``at.skip`` batches drawn, the ones before
        it made and dropped (each advances the dataset's seed generator)."""
        data = self.data
        while data._tfdist_created < at.iterator - 1:
            iter(data._get_iterator())
        prepared = _skip(iter(data._get_iterator()), at.skip)
        if self.recreates:
            data._tfdist_created -= 1  # counted again when the epoch asks for it
        return prepared

    def epoch_begin(self) -> None:
        """A new epoch after the resumed one: whole epochs again."""
        if self.batch_offset:
            self.batch_offset = 0
            self.data.steps_per_epoch = self._steps_per_epoch
            if self.recreates:
                self.data._num_batches = self.data.data_adapter.num_batches


class JaxInput(Keras3Input):
    """The input of a Keras 3 ``fit`` on JAX: its ``JAXEpochIterator``, whose iterators are
    generators. A generator makes the dataset's iterator when its first batch is drawn, so
    only the iterators drawn from are counted (:func:`_track_keras3_jax`), and one made to
    advance the dataset's seed generator has a batch drawn."""

    def _prepare(self, at: Resume) -> Any:
        data = self.data
        while data._tfdist_created < at.iterator - 1:
            next(iter(data._get_iterator()), None)  # made, one batch drawn, dropped
        return _skip(iter(data._get_iterator()), at.skip)  # counted at its first batch

    def waited(self) -> float:
        """Seconds this ``fit``'s training batches took to arrive so far, all its epochs: each
        ``next`` of the batches Keras draws for a step, but for an iterator's first (not its
        evaluation's, which has an epoch iterator of its own)."""
        return float(self.data._tfdist_waited)


class TfKerasInput:
    """The input of a tf_keras ``fit``: its ``DataHandler``.

    ``DataHandler.enumerate_epochs`` makes one iterator first and, when the adapter recreates
    iterators, one more for every epoch. tf_keras counts steps from the resumed step (its
    batches are numbered within the whole epoch), and starts at the epoch and step that
    ``Model._maybe_load_initial_counters_from_ckpt`` returns.
    """

    batch_offset = 0

    def __init__(self, handler: Any, model: Any) -> None:
        self.handler, self.model = handler, model

    @property
    def recreates(self) -> bool:
        return bool(self.handler._adapter.should_recreate_iterator())

    def position(self, step: int) -> Position:
        handler = self.handler
        return Position(handler._tfdist_created,
                        step if self.recreates else handler._tfdist_drawn_before + step)

    def epoch_steps(self) -> int | None:
        """Steps in a whole epoch, when known."""
        steps = self.handler._inferred_steps
        return int(steps) if steps is not None else None

    def batch_size(self) -> int | None:
        """Rows per batch of the input, when it is a constant."""
        return _adapter_batch(self.handler._adapter)

    def element_spec(self) -> Any:
        """None: tf_keras builds a model at its first step (``_build_for_loading`` builds the
        optimizer only)."""
        return None

    def resume(self, at: Resume) -> None:
        self.handler._tfdist_plan = at
        _counters[id(self.model)] = (at.epoch, at.step)

    def epoch_begin(self) -> None:
        pass


# The trainer's input made last, by Keras: a weak reference, so that the input of a fit that has
# ended (its iterator, the buffers that iterator prefetched) is freed with the fit.
_last: dict[str, weakref.ref[Any]] = {}
_counters: dict[int, tuple[int, int]] = {}  # id(model): where its next tf_keras fit starts


def _counting_init(init: Any) -> Any:
    """A Keras 3 epoch iterator's ``__init__``, which starts the count and is remembered as the
    input of the ``fit`` that is starting."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        self._tfdist_created, self._tfdist_next, self._tfdist_waited = 0, None, 0.0
        _last["keras3"] = weakref.ref(self)

    return __init__


def _track_keras3() -> None:
    from keras.src.backend.tensorflow import trainer

    def wrap_get_iterator(get_iterator: Any) -> Any:
        def _get_iterator(self: Any) -> Any:
            self._tfdist_created += 1
            prepared, self._tfdist_next = self._tfdist_next, None
            if prepared is not None:
                return prepared
            data = get_iterator(self)
            if _dropped_unread(self):  # its seeds drawn, no multi-device iterator made
                return seeds_only(data) or data
            return data

        return _get_iterator

    cls = trainer.TFEpochIterator
    patches.apply("keras3-input-position", cls, "__init__", _counting_init)
    patches.apply("keras3-input-position", cls, "_get_iterator", wrap_get_iterator)


def _dropped_unread(epoch_iterator: Any) -> bool:
    """Whether the iterator a Keras 3 epoch iterator asks for now is the one it makes when an
    epoch's batches are done and, without ``steps_per_epoch``, drops unread at the next epoch's
    start (``EpochIterator._enumerate_iterator``, Keras 3.7 and later)."""
    batches = getattr(epoch_iterator, "_num_batches", None) or 0
    return (epoch_iterator.steps_per_epoch is None and batches > 0
            and getattr(epoch_iterator, "_current_iterator", None) is not None
            and getattr(epoch_iterator, "_steps_seen", 0) >= batches)


class SeedsOnly:
    """Stands for the distributed iterator Keras 3 makes when an epoch's batches are done and,
    without ``steps_per_epoch``, drops unread at the next epoch's start.

    Made, it draws its dataset's random seeds as the real one would (one plain iterator of
    each worker's dataset, never read), so every epoch's shuffle order stays Keras's own; what
    it saves is a multi-device iterator: about 45 ms to make on 2 CPU workers, a prefetch that
    would fill its shuffle buffer for nothing, and its freeing, which waits for that prefetch
    and for tf.data's autotuner (docs/performance.md). Read after all (a Keras that reads the
    iterator it made at an epoch's end), it makes the real iterator then and says so once: the
    batches come, in another order than Keras's own.
    """

    def __init__(self, distributed: Any) -> None:
        self._distributed = distributed
        for dataset in distributed._cloned_datasets:
            iter(dataset)  # made (its seed drawn) and dropped unread: nothing to wait for
        self._real: Any = None

    def __iter__(self) -> SeedsOnly:
        return self

    def __next__(self) -> Any:
        if self._real is None:
            if not _read_stand_in:
                _read_stand_in.append(True)
                logger.warning("tfdist: Keras read the iterator it made at an epoch's end, "
                               "which tfdist expected it to drop unread (a Keras newer than "
                               "3.15?); it is made now, and this epoch's shuffle order differs "
                               "from the one Keras alone would draw")
            self._real = iter(self._distributed)
        return next(self._real)


_read_stand_in: list[bool] = []


def seeds_only(dataset: Any) -> SeedsOnly | None:
    """A :class:`SeedsOnly` for ``dataset`` where it is a tf.distribute dataset with a dataset
    per worker (None: make the real iterator)."""
    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    if not isinstance(dataset, input_lib.DistributedDataset) or not tf.executing_eagerly():
        return None
    if not getattr(dataset, "_cloned_datasets", None):
        return None
    return SeedsOnly(dataset)


def _track_keras3_jax() -> None:
    from keras.src.backend.jax import trainer

    def wrap_get_iterator(get_iterator: Any) -> Any:
        def _get_iterator(self: Any) -> Any:
            iterators.install_where_loaded()  # a tf.data dataset's epochs: freed off this thread
            prepared, self._tfdist_next = self._tfdist_next, None
            return prepared if prepared is not None else _counted(self, get_iterator(self))

        return _get_iterator

    cls = trainer.JAXEpochIterator
    patches.apply("jax-input-position", cls, "__init__", _counting_init)
    patches.apply("jax-input-position", cls, "_get_iterator", wrap_get_iterator)


def _counted(epoch_iterator: Any, batches: Any) -> Any:
    """``batches``, counted as an iterator made when its first batch is drawn, and the time
    each later batch takes to arrive added to the epoch iterator's input wait
    (``_tfdist_waited``). The first batch is not: drawing it makes the dataset's iterator, the
    epoch's start (the throughput meter's ``start_s``), as TensorFlow's steps time only reads."""
    for index, (waited, batch) in enumerate(arrivals(batches)):
        if index:
            epoch_iterator._tfdist_waited += waited
        else:
            epoch_iterator._tfdist_created += 1
        yield batch


def _track_keras2() -> None:
    # tf_keras, or TensorFlow 2.15's keras 2.15 and older: the same engine under another name
    data_adapter = keras2_module("engine.data_adapter")
    training = keras2_module("engine.training")

    def wrap_init(init: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            init(self, *args, **kwargs)
            self._tfdist_created, self._tfdist_drawn_before = 0, 0
            self._tfdist_plan = None
            _last["tf_keras"] = weakref.ref(self)

        return __init__

    def wrap_counters(load_counters: Any) -> Any:
        def counters(self: Any, steps_per_epoch: Any, initial_epoch: int) -> Any:
            resumed = _counters.pop(id(self), None)
            return resumed if resumed is not None else load_counters(self, steps_per_epoch,
                                                                     initial_epoch)

        return counters

    cls = data_adapter.DataHandler
    patches.apply("keras2-input-position", cls, "__init__", wrap_init)
    patches.apply("keras2-input-position", cls, "enumerate_epochs", _tracked_epochs)
    patches.apply("keras2-input-position", training.Model,
                  "_maybe_load_initial_counters_from_ckpt", wrap_counters)


def _tracked_epochs(enumerate_epochs: Any) -> Any:
    """tf_keras's ``enumerate_epochs``, counting the iterators it makes and starting a resumed
    fit's first epoch at the step it stopped at."""

    def tracked_epochs(self: Any) -> Any:
        at: Resume | None = self._tfdist_plan
        self._tfdist_plan = None
        recreates = self._adapter.should_recreate_iterator()
        if at is not None:  # the iterators the stopped run had made before this epoch's
            for _ in range(at.iterator - (2 if recreates else 1)):
                iter(self._dataset)
                self._tfdist_created += 1
        first = True
        for epoch, iterator in enumerate_epochs(self):
            if first:
                self._tfdist_created += 2 if recreates else 1
                if at is not None:
                    _skip(iterator, at.skip)
                    self._tfdist_drawn_before = at.skip - at.step
            elif recreates:
                self._tfdist_created += 1
                self._tfdist_drawn_before = 0
            else:  # the same iterator goes on: the last epoch's steps were drawn from it
                self._tfdist_drawn_before += self._current_step
            first = False
            yield epoch, iterator

    return tracked_epochs


def install_keras3(where: Where, dist: Any) -> None:
    """Patch ``keras3-input-position``'s installer (:func:`tfdist.patches.install`): the
    counting hooks of Keras 3 on TensorFlow, once."""
    _track(_track_keras3)


def install_keras2(where: Where, dist: Any) -> None:
    """Patch ``keras2-input-position``'s installer: the counting hooks of tf_keras (or the keras
    2.x of TensorFlow 2.15 and older), once."""
    _track(_track_keras2)


def install_jax(where: Where, dist: Any) -> None:
    """Patch ``jax-input-position``'s installer: the counting hooks of Keras 3 on JAX, once."""
    _track(_track_keras3_jax)


def _track(hooks: Callable[[], None]) -> None:
    """Installs ``hooks``; where they cannot be (a Keras without the classes hooked), says so:
    a resumed ``fit`` then starts with the epoch."""
    try:
        hooks()
    except (ImportError, AttributeError) as error:
        logger.info("tfdist: cannot follow fit's input on this Keras (%s): a preempted fit "
                    "resumes at its epoch", error)
        _tracking[:] = [False]
        return
    _tracking[:] = [True]


def tracked() -> bool:
    """Whether the counting hooks of the Keras in use are installed in this process."""
    return bool(_tracking and _tracking[0])


_tracking: list[bool] = []


def _made_last(keras: str) -> Any:
    made = _last.get(keras)
    return made() if made is not None else None


def current(model: Any) -> Keras3Input | TfKerasInput | None:
    """The input of the ``fit`` of ``model`` that is starting (call in ``on_train_begin``)."""
    if keras2_package():
        handler = _made_last("tf_keras")
        return TfKerasInput(handler, model) if handler is not None else None
    epoch_iterator = _made_last("keras3")
    if epoch_iterator is None:
        return None
    return (JaxInput if type(epoch_iterator).__name__ == "JAXEpochIterator"
            else Keras3Input)(epoch_iterator)
