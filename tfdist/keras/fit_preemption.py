"""The preemption callback of ``fit``, for every Keras tfdist drives: the body of
:class:`tfdist.keras.callbacks.PreemptionCheckpoint` (``tf.keras``: Keras 3 on TensorFlow, or
tf_keras) and of Keras 3 on JAX's (:mod:`tfdist.jax.callbacks`), each of which adds its Keras's
``Callback`` as the second base. It imports neither TensorFlow nor Keras.

What it does, on each rank: the agreement of :mod:`tfdist.preemption` at agreed steps, the
exact state saved at the agreed step (the model with its optimizer, each rank's random
generators, the input's position from :mod:`tfdist.keras.input_position`), and a resumed
``fit`` that continues there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tfdist import background, ownership, preemption, savetime, walltime
from tfdist import model_dir as layout
from tfdist.errors import StorageError
from tfdist.keras import input_position, keras2, optimizers, random_draws, snapshot
from tfdist.scratch import own_file, save_once
from tfdist.settings import resolve

if TYPE_CHECKING:
    from tfdist.handle import Handle

__all__ = ["PreemptionCallback", "fingerprint", "save_model"]

logger = logging.getLogger("tfdist")


def save_model(dist: Handle, model: Any, path: str) -> bool:
    """The model with its optimizer to ``path``, once, from the chief, run on every rank
    (:func:`tfdist.scratch.save_once`); whether this process wrote it."""
    return save_once(dist.is_chief, dist.rank, dist.save_on_every_rank, model, path)


class PreemptionCallback:
    """After a preemption signal on any rank, stops every rank at one agreed step, saves the
    state there and ends the process with :data:`tfdist.preemption.EXIT_PREEMPTED` (75); the
    next ``fit`` with the same ``model_dir`` resumes at that step.

    The state goes to ``model_dir/preempted/`` (:func:`tfdist.preemption.commit`): the whole
    model with its optimizer (``model.keras``, saved by every rank as :func:`save_model` does,
    written by the chief), per rank the random generators' states the model file leaves out
    (``rank-N.npz``), and ``state.json``: the epoch, the steps done in it, where the input was
    (:mod:`tfdist.keras.input_position`), world size and signal. A signal during validation inside
    ``fit`` stops there too; the resumed run then starts with the next epoch.

    Resuming (Keras 3 on TensorFlow or JAX, and tf_keras): the model and optimizer are loaded,
    training starts at the saved epoch and step, and the input continues at the saved batch
    with the order the stopped run would have seen, also for a dataset that reshuffles every
    epoch and for ``steps_per_epoch`` over a repeated dataset. The folder is removed at the end
    of the first epoch the resumed run completes, when the epoch's backup is newer, or at the
    end of a fit that resumed at the end of its last epoch and so had no epoch left to train.

    Args:
        dist: the handle.
        model_dir: where the state goes.
        check_seconds: about how often the ranks agree; env ``TFDIST_PREEMPT_CHECK_SECONDS``,
            default 1.
        logs: callbacks that keep log files open (TensorBoard, CSVLogger): their
            ``on_train_end`` closes them before the process ends.
        every: seconds between two safety saves (the same state, at an agreed step, training
            going on; each epoch's end is one too); env ``TFDIST_CHECKPOINT_EVERY``, default
            none. A fit that ends normally removes its last one.
        epoch_saves: save the state at each epoch's end (as ``every`` does), so that a run
            killed without warning resumes there exactly; :func:`tfdist.keras.callbacks.build` sets
            it in place of Keras's BackupAndRestore.
    """

    model: Any  # set by Keras (its Callback, the other base)

    def __init__(self, dist: Handle, model_dir: str,
                 check_seconds: float | None = None, *, logs: Sequence[Any] = (),
                 every: float | str | None = None, epoch_saves: bool = False) -> None:
        super().__init__()
        self.epoch_saves = epoch_saves
        self.dist, self.model_dir, self.logs = dist, model_dir, list(logs)
        self.watch = preemption.Watch(dist, resolve("preempt_check_seconds", check_seconds),
                                      every=resolve("checkpoint_every", every))
        self._saved_here = False  # this fit wrote a safety save (removed when it ends well)
        self.epoch, self.step, self._in_fit = 0, 0, False
        self.resumed_from: dict[str, Any] | None = None  # the state this fit resumed from
        self._state_found = False
        self._epochs_begun = 0  # in this fit: none, and no collective ran either
        self._input: input_position.Keras3Input | input_position.TfKerasInput | None = None
        self._resumed_epoch: int | None = None
        # TFDIST_BACKGROUND_SAVES: safety saves written by this writer (tfdist.background)
        self.background = bool(resolve("background_saves"))
        self._writer = background.Writer()
        self._saves = 0  # this process's background saves so far: each one's folder number
        self._snapshot: snapshot.Snapshot | None = None  # the chief's buffer, reused
        self._save_time_checked = False  # whether the saves' time was held to the limits

    def on_train_begin(self, logs: Any = None) -> None:
        ownership.claim(self.dist, self.model_dir)  # one run, a folder every rank sees
        self._in_fit = True
        self.watch.install()
        late = preemption.take_late_signal()  # came between two fits: this one stops at once
        if late is not None and self.watch.signal is None:
            self.watch.signal, self.watch.received_at = late, time.monotonic()
        self._input = input_position.current(self.model) if input_position.tracked() else None
        self._epochs_begun = 0
        if self.dist.is_chief:  # the partial folders of background saves a kill left behind
            self._writer.wait()
            background.remove_partials(self.model_dir)  # no rank writes before the first step
            if self.background and self._snapshot is None:
                self._writer.submit(self._prepare)  # the first save's buffer, beside training
        states = preemption.read_states(self.model_dir)
        if states:
            self._state_found = True
            self._resume(states)

    def on_train_end(self, logs: Any = None) -> None:
        self._in_fit = False
        try:
            self._writer.wait()  # the save in flight is committed before the state is removed
        except OSError as error:
            logger.warning("tfdist: the last background save failed: %s", error)
        # A signal from now on (or one too late for this fit to act on) must not kill the
        # script's last work: it is recorded, and the script ends normally.
        pending = None if self.watch.stop_requested else self.watch.signal
        self.watch.uninstall(redeliver=False)
        preemption.after_training(self.watch.catch, pending, self.dist.rank)
        # Resumed at the end of the last epoch: fit ran no epoch, and the state is used up. Left
        # behind, the next fit with this model_dir would resume from it and train nothing. So
        # would it from this fit's last safety save.
        if self._state_found and not self._epochs_begun and self.dist.world_size > 1:
            # No epoch, so no collective, ran: a rank may not have read the state yet. Removed
            # now, it would train from the start alone, waiting in a collective for ranks that
            # have ended (seen: 1 in 8 runs, two at a time on 2 cores). Every rank meets first.
            self.dist.sum_over_ranks([0.0])
        self._state_found = self._state_found or self._saved_here
        self._discard_state()

    def _discard_state(self) -> None:
        """Removes the state this fit resumed from (on the chief), once it is used up."""
        if self._state_found and self.dist.is_chief:
            for folder in (preemption.CHECKPOINT_DIR, f"{preemption.CHECKPOINT_DIR}.old"):
                shutil.rmtree(os.path.join(self.model_dir, folder), ignore_errors=True)
        self._state_found = False

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epochs_begun += 1
        if self._input is not None and epoch != self._resumed_epoch:
            self._input.epoch_begin()
        self.epoch = epoch
        self.step = self._input.batch_offset if self._input is not None else 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.step = (self._input.batch_offset if self._input is not None else 0) + batch + 1
        if self._input is not None and self.step == self._input.epoch_steps():
            return  # the epoch's last step: its end checks, after the epoch's backup and logs
        if self.watch.step():
            self._save_and_exit(validating=False)
        elif self.watch.save_now:
            self._safety_save(validating=False)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        saves = self.epoch_saves or self.watch.every is not None  # each epoch's end saves
        if not saves:
            self._discard_state()  # this epoch's backup, written before this callback, is newer
        # Every epoch ends with a check, however long the interval between checks has grown.
        if self.watch.check():
            self._save_and_exit(validating=False, epoch_done=True)
        elif saves:  # the new state replaces the one found, atomically
            self._safety_save(validating=False, epoch_done=True)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._in_fit:
            return
        if self.watch.step():
            self._save_and_exit(validating=True, epoch_done=True)
        elif self.watch.save_now:
            self._safety_save(validating=True, epoch_done=True)

    def _safety_save(self, *, validating: bool, epoch_done: bool = False) -> None:
        """The exact state at this agreed step, every ``every`` seconds; training goes on."""
        started = time.monotonic()
        final = self._save(validating=validating, epoch_done=epoch_done,
                           in_background=self.background)
        self.watch.saved()
        self._saved_here, self._state_found = True, False  # this state is newer than any found
        self._check_save_time()
        if final is not None:
            took = time.monotonic() - started
            every = (f"; TFDIST_CHECKPOINT_EVERY={self.watch.every:g}s"
                     if self.watch.every is not None else "")
            # A line only when it is worth one (a quiet run: one tfdist line an epoch), or
            # asked for (TFDIST_VERBOSE=1).
            shown = preemption.slow_save(took, self.watch.every) or bool(resolve("verbose"))
            level = logging.INFO if shown else logging.DEBUG
            logger.log(level, "tfdist: safety save after step %d of epoch %d%s in %s (%.2f s%s)",
                       self.step, self.epoch + 1, " (during validation)" if validating else "",
                       final, took, every)

    def _check_save_time(self) -> None:
        """Once, on the chief, from the first save timed (a background one once written): the
        limits this run's saves do not fit (:func:`tfdist.savetime.problems`), with the fix."""
        seconds = walltime.longest_save()
        if self._save_time_checked or not self.dist.is_chief or seconds <= 0:
            return
        self._save_time_checked = True
        for what, fix in savetime.problems(
                seconds, lead_s=resolve("signal_lead"), margin_s=resolve("walltime_margin"),
                every_s=self.watch.every, background=self.background):
            logger.warning("tfdist: %s. Fix: %s.", what, fix)

    def _save_and_exit(self, *, validating: bool, epoch_done: bool = False) -> None:
        try:
            self._writer.wait()  # a background save in flight ends first: one commit at a time
        except OSError as error:  # the last complete state stays; this save tries again
            logger.warning("tfdist: the background save before this one failed: %s", error)
        # With background saves the final one is written as they are (the state's raw bytes,
        # several times faster than Keras's file) and waited for here.
        final = self._save(validating=validating, epoch_done=epoch_done,
                           in_background=self.background)
        if self.background:
            try:
                self._writer.wait()
            except OSError as error:
                raise StorageError(
                    f"could not save the training state in {final or self.model_dir}: "
                    f"{error.strerror or error}. {layout.storage_fix(error.errno)}; the last "
                    "complete state is kept") from None
        if final is not None:
            logger.warning("tfdist: saved the state after step %d of epoch %d%s in %s; exiting "
                           "with code %d", self.step, self.epoch + 1,
                           " (during validation)" if validating else "", final,
                           preemption.EXIT_PREEMPTED)
        for callback in self.logs:  # the process ends without teardown: close the logs now
            try:
                callback.on_train_end()
            except Exception as error:  # the state is saved: a log is not worth failing for
                logger.warning("tfdist: closing %s failed: %s", type(callback).__name__, error)
        preemption.exit_preempted(self.dist)

    def _save(self, *, validating: bool, epoch_done: bool,
              in_background: bool = False) -> str | None:
        """Writes the exact state at this step (every rank); the folder on the chief. In the
        background: the state's copy is taken here, and the folder it will be committed to is
        returned on the chief."""
        sync = getattr(self.model, "jax_state_sync", None)
        if callable(sync):  # Keras 3 on JAX keeps the variables' values aside inside fit
            sync()
        if in_background:
            return self._save_in_background(self._state(validating, epoch_done))

        def write(folder: str) -> None:
            save_model(self.dist, self.model, own_file(self.model,
                                                       os.path.join(folder, "model.keras")))
            # What the model file leaves out, per rank: the random generators' states
            # (Dropout's seed generator), without which the resumed run would draw other masks.
            import numpy as np

            np.savez(os.path.join(folder, f"rank-{self.dist.rank}.npz"),
                     **_unsaved_values(self.model))  # type: ignore[arg-type]

        return preemption.save_state(self.dist, self.model_dir, write,
                                     self._state(validating, epoch_done))

    def _state(self, validating: bool, epoch_done: bool) -> dict[str, Any]:
        """``state.json``'s content for a save at this step."""
        state: dict[str, Any] = {
            "epoch": self.epoch, "step": self.step, "epoch_done": epoch_done,
            "validating": validating, "num_replicas": self.dist.num_replicas,
            "signal": self.watch.signal.name if self.watch.signal else None,
            "walltime": self.watch.walltime}
        if self._input is not None:
            where = self._input.position(self.step)
            state["input"] = {"iterator": where.iterator, "drawn": where.drawn,
                              "recreates": self._input.recreates,
                              "global_batch": self._global_batch()}
        state["fingerprint"] = fingerprint(self.model)
        state["optimizers"] = optimizers.record(self.model)
        return state

    def _prepare(self) -> None:
        self._snapshot = snapshot.prepare(self.model)

    def _save_in_background(self, state: dict[str, Any]) -> str | None:
        """Copies the state to host memory and writes it on the writer thread
        (:func:`tfdist.background.start_save`); the folder it goes to, on the chief."""
        import numpy as np

        final = os.path.join(self.model_dir, preemption.CHECKPOINT_DIR)
        try:
            self._writer.wait()  # the buffer the state is copied into is free again
            # The save before is written and timed: its limits are said before this one's
            # write can end the process (a kill inside it).
            self._check_save_time()
            # The state is the same on every rank: the chief's copy is the one written.
            if self.dist.is_chief:
                self._snapshot = snapshot.take(self.model, self._snapshot)
            values = self._snapshot
            extra = _unsaved_values(self.model)
            rank = self.dist.rank

            def write(folder: str) -> None:
                if values is not None:
                    snapshot.write(folder, values)
                np.savez(os.path.join(folder, f"rank-{rank}.npz"), **extra)  # type: ignore[arg-type]

            self._saves += 1
            background.start_save(self._writer, model_dir=self.model_dir, final=final,
                                  number=self._saves, rank=rank,
                                  world_size=self.dist.world_size, is_chief=self.dist.is_chief,
                                  write=write, state=state, commit=preemption.commit,
                                  state_file=preemption.STATE_FILE)
        except OSError as error:  # the save before this one could not be written
            raise StorageError(
                f"could not save the training state in {final} in the background: "
                f"{error.strerror or error}. {layout.storage_fix(error.errno)}; the last "
                "complete state is kept") from None
        return final if self.dist.is_chief else None

    def _global_batch(self) -> int | None:
        """Rows per step over all workers: what ``dist.shard`` saw, or in one process the
        input's batch; None where unknown (a position then stays in batches)."""
        found = getattr(self.dist, "sharded_batch_size", None)
        if found:
            return int(found)
        if self.dist.world_size != 1 or self._input is None:
            return None
        return self._input.batch_size()

    def _resume(self, states: list[dict[str, Any]]) -> None:
        state = states[0]
        saved, found = state.get("input"), self._input
        if found is None or saved is None or saved["recreates"] != found.recreates:
            why = ("needs a Keras whose fit tfdist can follow" if found is None
                   else "was saved by another Keras")
            instead = ("training starts from the first epoch (no epoch backup is kept beside "
                       "the exact state)" if self.epoch_saves else
                       "resuming from the last epoch's backup instead")
            if self.dist.is_chief:
                logger.warning("tfdist: %s holds the state at %s, but resuming there %s: %s",
                               state["path"], _where(state), why, instead)
            return
        self._build_for_loading(state)
        script_rate = _learning_rate(self.model)
        state = self._load(states)
        walltime.record_save(state.get("save_seconds"))  # the run that saved it timed the save
        epoch, step, saved = int(state["epoch"]), int(state["step"]), state["input"]
        at = input_position.plan(input_position.Position(saved["iterator"], saved["drawn"]), epoch,
                              step, epoch_done=bool(state["epoch_done"]),
                              recreates=found.recreates)
        before, now = saved.get("global_batch"), self._global_batch()
        rebatched = input_position.rebatch(at, before, now)
        if rebatched is None:
            raise StorageError(
                f"{state['path']} stopped after {at.skip * before} rows in batches of {before}, "
                f"which is not a whole number of this run's global batch {now}: no exact resume. "
                f"Resume with a global batch that divides {at.skip * before} (such as {before}), "
                f"or start afresh: rm -r {layout.path(self.model_dir, layout.PREEMPTED)}*")
        found.resume(rebatched)
        self.model._initial_epoch = at.epoch  # Keras 3's fit starts there; tf_keras: resume()
        self._resumed_epoch, self.epoch, self.resumed_from = at.epoch, at.epoch, state
        if self.dist.is_chief:
            changed = ("" if state["world_size"] == self.dist.world_size else
                       f"; it ran on {state['world_size']} workers, now {self.dist.world_size}: "
                       "the global batch is what the script sets")
            rate = _learning_rate(self.model)
            if changed and None not in (rate, script_rate) and rate != script_rate:
                changed += (f"; the learning rate is the saved {rate:g}, not the {script_rate:g} "
                            "the script set (the optimizer's state is restored whole)")
            if before and now and before != now:
                changed += (f"; its global batch was {before}, now {now}: it goes on after "
                            f"the same {at.skip * before} rows")
            logger.warning("tfdist: resuming at %s from %s%s", _where(state), state["path"],
                           changed)

    def _build_for_loading(self, state: dict[str, Any]) -> None:
        """Builds the model (where its weights do not exist yet) and every optimizer it held
        built at the save (:func:`tfdist.keras.optimizers.build_as_saved`), the way the first
        step would, so that loading the state restores every variable. One process builds them
        only at its first step (Keras 3 without a strategy; Keras 2.15's BackupAndRestore; a
        GAN's own two optimizers always), and ``load_weights`` would skip an optimizer's state:
        "Skipping variable loading for optimizer"."""
        model, saved = self.model, state.get("fingerprint") or {}
        if not _built(model) and saved.get("weights") != fingerprint(model)["weights"]:
            spec = self._input.element_spec() if self._input is not None else None
            symbolic_build = getattr(model, "_symbolic_build", None)
            if spec is not None and callable(symbolic_build):
                try:
                    symbolic_build(data_batch=spec)  # Keras 3: builds the optimizer too
                except Exception as error:  # a model without call(): Keras cannot build it
                    raise StorageError(
                        f"{state['path']} holds {len(saved.get('weights', []))} weights, and "
                        f"this model has {len(model.weights)} before its first step; Keras "
                        f"cannot make the others ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:160]}): give each model it holds a "
                        "keras.Input (or build it) before fit, so its weights exist to "
                        "resume into") from None
        if getattr(model, "built", True) is False and saved.get("weights") == fingerprint(
                model)["weights"]:
            # Every weight exists (a GAN whose networks the script built), but a model without
            # call() is never marked built, and Keras loads nothing into one so marked.
            model.built = True
        with _scope(model):
            problems = optimizers.build_as_saved(model, state.get("optimizers"))
        if problems:
            raise StorageError(
                f"{state['path']} cannot be resumed into this model: {'; '.join(problems)}. "
                "Resume with the program that saved it, or start afresh: "
                f"rm -r {layout.path(self.model_dir, layout.PREEMPTED)}*")

    def _load(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """Loads the newest state that can be read (the same one on every rank); refuses the
        state of another model. Returns it."""
        now = fingerprint(self.model) if _built(self.model) else None
        failures: list[str] = []
        used = len(states)
        for index, state in enumerate(states):
            saved = state.get("fingerprint")
            if now is not None and saved:
                different = layout.difference(saved, now)
                if different:
                    raise StorageError(
                        f"{state['path']} holds the state of another model ({different}): "
                        "resume with the model and optimizer that saved it, or start afresh "
                        f"with another model_dir or rm -r "
                        f"{layout.path(self.model_dir, layout.PREEMPTED)}*")
            try:
                arrays = os.path.join(state["path"], snapshot.FILE)
                if os.path.exists(arrays):  # a background save's
                    snapshot.restore(self.model, arrays)
                else:
                    saved = os.path.join(state["path"], "model.keras")
                    if not os.path.exists(saved):  # a model without a config: its weights
                        saved = os.path.join(state["path"], "model.weights.h5")
                    self.model.load_weights(saved)
                self._restore_unsaved(state["path"])
            except Exception as error:  # damaged: a truncated file, a half-copied folder
                failures.append(f"{state['path']}: {type(error).__name__}: {error}"[:300])
                continue
            used = index
            break
        if self.dist.world_size > 1:  # every rank resumes from the same one, or none does
            total = round(self.dist.sum_over_ranks([float(used)])[0])
            if total != used * self.dist.world_size:
                raise StorageError(
                    f"the ranks read different states in {self.model_dir} (this rank: "
                    f"{'none' if used == len(states) else states[used]['path']}): is "
                    "model_dir one folder that every rank sees?")
        if used == len(states):
            raise StorageError(
                f"the saved training state in {self.model_dir} cannot be read ("
                f"{'; '.join(failures)}), and there is no earlier complete one: start afresh "
                f"with rm -r {layout.path(self.model_dir, layout.PREEMPTED)}*")
        if failures and self.dist.is_chief:
            logger.warning("tfdist: %s cannot be read (%s): resuming from the complete state "
                           "before it, %s", states[0]["path"], failures[0],
                           states[used]["path"])
        return states[used]

    def _restore_unsaved(self, folder: str) -> None:
        mine = os.path.join(folder, f"rank-{self.dist.rank}.npz")
        path = mine if os.path.exists(mine) else os.path.join(folder, "rank-0.npz")
        if not os.path.exists(path):
            return
        import numpy as np

        with np.load(path) as saved:
            for i, variable in enumerate(_unsaved(self.model)):
                if f"v{i}" in saved and saved[f"v{i}"].shape == tuple(variable.shape):
                    variable.assign(saved[f"v{i}"])
            if _GLOBAL_SEED in saved:  # made here if the step has not made it yet
                with _scope(self.model):
                    found = random_draws.global_seed_generator(create=True)
                if found is not None:
                    found.state.assign(saved[_GLOBAL_SEED])


def _learning_rate(model: Any) -> float | None:
    """The optimizer's learning rate now, where it is one number (not a schedule)."""
    optimizer = getattr(model, "optimizer", None)
    if callable(getattr(optimizer, "_learning_rate", None)):  # a schedule (Keras 3, tf_keras)
        return None
    rate = getattr(optimizer, "learning_rate", None)
    if rate is None or (callable(rate) and not hasattr(rate, "numpy")):
        return None
    try:
        value = rate.numpy() if hasattr(rate, "numpy") else rate
        return float(value)
    except (TypeError, ValueError):
        return None


def _where(state: dict[str, Any]) -> str:
    """``step 4 of epoch 2``: where a saved state stopped."""
    return (f"step {int(state['step'])} of epoch {int(state['epoch']) + 1}"
            + (" (its end)" if state["epoch_done"] else ""))


def fingerprint(model: Any) -> dict[str, Any]:
    """What :func:`tfdist.model_dir.difference` compares: the shapes and types of the model's
    weights in order, and its optimizer's class."""
    weights = list(getattr(model, "weights", []))
    optimizer = getattr(model, "optimizer", None)
    return {"weights": [[int(d) for d in w.shape] for w in weights],
            "dtypes": [str(getattr(w.dtype, "name", w.dtype)) for w in weights],
            "optimizer": type(optimizer).__name__ if optimizer is not None else None}


def _built(model: Any) -> bool:
    """Whether ``model`` and every layer in it have their variables."""
    layers = getattr(model, "_flatten_layers", None)
    if callable(layers):
        return all(getattr(layer, "built", True) for layer in layers())
    return bool(getattr(model, "built", True))


def _scope(model: Any) -> Any:
    """The scope of ``model``'s strategy (where its variables are made), else no scope."""
    scope = getattr(getattr(model, "distribute_strategy", None), "scope", None)
    return scope() if callable(scope) else contextlib.nullcontext()


_GLOBAL_SEED = "global_seed"  # Keras 3's global seed generator's state, in rank-R.npz


def _unsaved_values(model: Any) -> dict[str, Any]:
    """What a save keeps beside the model's file, per rank: the values of :func:`_unsaved`
    (``v0``...) and the state of Keras 3's global seed generator, where one is made (a GAN's
    noise drawn without a seed draws from it)."""
    import numpy as np

    found = {f"v{i}": np.array(v.numpy()) for i, v in enumerate(_unsaved(model))}
    generator = random_draws.global_seed_generator()
    if generator is not None:
        found[_GLOBAL_SEED] = np.array(generator.state.numpy())
    return found


def _unsaved(model: Any) -> list[Any]:
    """The model's variables that ``model.save`` leaves out: its random generators' states."""
    return keras2.random_states(model)
