"""The one room for tfdist's changes to Keras, TensorFlow and Horovod internals (pure).

A patch replaces an attribute of a library's class or module (its owner) by a wrapper of the
original. Every patch tfdist may apply is a row of :data:`INVENTORY`: what it replaces, its
installer (``"module:function"``, imported only when it runs), its phase, when and why it
applies; :func:`apply` is the one way to install one (once per process and attribute: a second
call does nothing) and :func:`scoped` the one way to install one for a block. Nothing is
patched when a module is imported, but ``sys.excepthook`` by ``import tfdist``
(``own-error-line``: Python's own hook for it, chained).

What a launch is (:class:`Where`, built by :func:`where`) decides which rows apply
(:func:`planned`; ``TFDIST_SKIP_PATCHES`` leaves rows out), and the rows' phase when each is
installed:

- :data:`IMPORT`, at ``import tfdist`` (``own-error-line``), or when TensorFlow's context
  module is imported, before the runtime starts (:mod:`tfdist.autostart`, armed by ``import
  tfdist``).
- :data:`START`, right after the engine starts: :func:`install` (called by
  :func:`tfdist.backends.create`) runs each planned row's installer, in the inventory's order.
- :data:`CREATE`, while MultiWorkerMirroredStrategy is created, and undone after:
  :func:`creating`.
- :data:`CALL`, inside another patch's wrapper, for that call only (``arrays-shuffle-seed``).
- :data:`LAZY`, by another patch's wrapper the first time it is needed; it stays
  (``iterator-free-thread`` on Keras 3 on JAX, once TensorFlow is loaded).

A row's installer installs exactly its row's attributes and decides nothing: the conditions are
the row's ``applies``, so what a process installs (:func:`installed`) is what the inventory
plans for it. The exceptions are explicit: a later phase's row is installed only when its call
comes (its wrapper asks :func:`planned_here`), and an installer whose target this library
version lacks logs it and installs nothing.

The nesting rule: rows that replace the same attribute nest in the inventory's order, a later row's
wrapper around an earlier one's (its installer runs later and wraps what it finds). That holds on
every backend: ``keras.Model.fit`` is wrapped by ``keras3-step-logs`` (on Keras 3's
``TensorFlowTrainer``, which ``Model`` inherits it from) or ``keras2-step-results``, then
``arrays-one-order`` (MWMS) or ``horovod-fit`` (Horovod), then ``user-writers`` outermost;
``compile`` by ``horovod-fit``, then ``compile-without-xla``; ``sys.excepthook`` by
``own-error-line``, then ``failure-line``, then ``timeout-line``. Insert a new row where its wrapper
must sit.

A user who sees Keras behave oddly under tfdist reads this table first (``tfdist env`` prints
the rows that apply to the launch): every wrapper defers to the original outside the case it
names.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tfdist import verify as verify_protocol
from tfdist.backend_facts import JAX, TF, TORCH, Backend
from tfdist.keras.versions import AFFECTED, legacy_keras_requested

__all__ = ["CALL", "CREATE", "IMPORT", "INVENTORY", "LAZY", "PHASES", "START", "Patch", "Where",
           "apply", "creating", "install", "installed", "markdown_table", "plan", "planned",
           "planned_here", "rebinding", "scoped", "undo", "where"]

IMPORT = "import"  # at import tfdist, or when TensorFlow's context module is (tfdist.autostart)
START = "start"  # right after the engine starts: install(), in the inventory's order
CREATE = "create"  # while MultiWorkerMirroredStrategy is created, undone after: creating()
CALL = "call"  # inside another patch's wrapper, for that call only
LAZY = "lazy"  # by another patch's wrapper the first time it is needed; it stays
PHASES = (IMPORT, START, CREATE, CALL, LAZY)


@dataclass(frozen=True)
class Where:
    """What a launch is, for the inventory's conditions (pure: no framework imported); built by
    :func:`where`, the same way for a running process and for ``tfdist env``."""

    backend: Backend  # the chosen backend's row (tfdist.backend_facts)
    keras3: bool  # tf.keras (or Keras on JAX) is Keras 3, not tf_keras / Keras 2
    tensorflow: tuple[int, int]  # TensorFlow's version, (0, 0) when absent
    several_processes: bool
    gpus: bool  # the process drives GPUs
    keras: tuple[int, int] = (0, 0)  # the keras package's version
    legacy_keras: bool = False  # TF_USE_LEGACY_KERAS=1 asks for tf_keras
    keras3_imported: bool = False  # Keras 3 is imported (beside tf_keras, with legacy_keras)
    eager_record_lost: bool = False  # TensorFlow's eager context lost its record (keras2.py)
    cpu_replicas: int = 1  # TFDIST_CPU_REPLICAS
    collective_timeout: float | None = None  # TFDIST_COLLECTIVE_TIMEOUT, seconds
    skip: frozenset[str] = frozenset()  # TFDIST_SKIP_PATCHES (and the old per-patch switches)
    verify: bool = False  # a run started by `tfdist verify` (TFDIST_VERIFY_DIR)


@dataclass(frozen=True)
class Patch:
    """One patch tfdist may apply.

    Attributes:
        key: its name in this table (``apply``'s first argument, ``TFDIST_SKIP_PATCHES``'s).
        target: what it replaces, as ``module.Class.attribute`` (several attributes: ``/``).
        installer: ``"module:function"`` that installs it. A :data:`START` row's takes
            ``(where, handle)``; a :data:`CREATE` row's takes ``(where, settings)`` and returns
            a context manager; a :data:`CALL` or :data:`LAZY` row's is called by the wrapper
            that needs it.
        when: in words, when it is installed.
        reason: why: the defect or gap it works around, and what the wrapper does.
        applies: whether it is installed for a launch (:class:`Where`).
        phase: when it is installed (:data:`PHASES`), or a function of the launch that says.
    """

    key: str
    target: str
    installer: str
    when: str
    reason: str
    applies: Callable[[Where], bool]
    phase: str | Callable[[Where], str] = START

    @property
    def by(self) -> str:
        """The tfdist module that installs it (its installer's)."""
        return self.installer.partition(":")[0]

    def phase_in(self, where: Where) -> str:
        """Its phase for a launch like ``where``."""
        return self.phase if isinstance(self.phase, str) else self.phase(where)


def _mwms_backend(w: Where) -> bool:
    """MultiWorkerMirroredStrategy, in any number of processes."""
    row = w.backend
    return row.framework == TF and row.crosses_processes and not row.horovod


def _mwms(w: Where) -> bool:
    """MultiWorkerMirroredStrategy over several processes."""
    return _mwms_backend(w) and w.several_processes


def _replicas_in_one_process(w: Where) -> bool:
    """A tf.distribute strategy over the devices of one process (MirroredStrategy)."""
    row = w.backend
    return (row.framework == TF and not row.crosses_processes
            and row.devices_per_process == "several")


def _horovod(w: Where) -> bool:
    return w.backend.framework == TF and w.backend.horovod


def _jax_processes(w: Where) -> bool:
    """Keras 3 on JAX over several processes."""
    return w.several_processes and w.backend.framework == JAX


# When tfdist.keras.keras3's fixes of Keras 3's multi-worker fit are installed.
_KERAS3_FIX = ("MWMS, Keras 3 (a release in tfdist.keras.versions.AFFECTED); the wrappers act "
               "on several workers")


def _keras3_fix(w: Where) -> bool:
    return _mwms_backend(w) and w.keras3 and AFFECTED[0] <= w.keras < AFFECTED[1]


def _iterator_free_phase(w: Where) -> str:
    # Keras 3 on JAX reads TensorFlow only for a tf.data input: installed when one is made.
    return LAZY if w.backend.framework == JAX else START


_TRAINER = "keras.src.backend.tensorflow.trainer"

# The order is the nesting (the module's docstring): a later row wraps an earlier one's
# attribute. Rows of one room stay together where no nesting asks otherwise.
INVENTORY: tuple[Patch, ...] = (
    Patch("own-error-line", "sys.excepthook", "tfdist.uncaught:install",
          "every process, at import tfdist",
          "tfdist's own errors (a setting, the order of the script's calls, the model_dir) say "
          "the fix in one line; left uncaught, Python prints its traceback around it on every "
          "rank and exits 1, which a restart or requeue retries. The hook prints the line once "
          "and exits 78 (tfdist.uncaught); every other error goes on to the hooks before it",
          lambda w: True, IMPORT),
    Patch("first-op-start", "tensorflow.python.eager.context.Context.ensure_initialized",
          "tfdist.autostart:arm",
          "MWMS or Horovod over several processes, when TensorFlow's context module is "
          "imported (import tfdist arms it)",
          "multi-worker collectives and Horovod's GPU pinning can only be configured before "
          "TensorFlow's runtime starts, at its first op; a script that makes its data or model "
          "before strategy_scope() would stop with InitOrderError. The first op that starts the "
          "runtime runs tfdist.init() first, with the environment's settings",
          lambda w: w.several_processes and w.backend.framework == TF, IMPORT),
    Patch("eager-record", "tensorflow.python.eager.context.Context._context_switches",
          "tfdist.keras.keras2:install_eager_record",
          "every TensorFlow backend, where TensorFlow's eager context lost its record "
          "(TensorFlow 2.14 and older imported inside absl's app.run); first, before anything "
          "imports Keras 2",
          "TensorFlow <= 2.14 loses its record of being eager when imported inside app.run, "
          "and Keras 2 then builds graph placeholders instead of KerasTensors; the record the "
          "context would have made is put back",
          lambda w: w.backend.framework == TF and w.eager_record_lost),
    Patch("mwms-cpu-replicas",
          "tensorflow.python.distribute.collective_all_reduce_strategy."
          "CollectiveAllReduceExtended._initialize_local_devices",
          "tfdist.backends.mwms:cpu_replicas_while_created",
          "MWMS on CPUs with TFDIST_CPU_REPLICAS > 1, while the strategy is created",
          "TensorFlow gives a CPU worker one replica whatever logical CPUs exist; the stand-in "
          "for several GPUs per worker gives it one per logical CPU",
          lambda w: _mwms_backend(w) and not w.gpus and w.cpu_replicas > 1, CREATE),
    Patch("mwms-heartbeat", "tensorflow.python.eager.context.Context."
          "configure_coordination_service", "tfdist.backends.mwms:heartbeat_while_created",
          "MWMS on several workers, while the strategy is created",
          "MWMS starts TensorFlow's coordination service with its 10 s heartbeat timeout, "
          "which declares a rank starved of CPU crashed; the wrapper passes "
          "TFDIST_HEARTBEAT_TIMEOUT (30 s by default) where the call sets none",
          _mwms, CREATE),
    Patch("keras3-symbolic-build", f"{_TRAINER}.TensorFlowTrainer._maybe_symbolic_build",
          "tfdist.keras.keras3:install_symbolic_build", _KERAS3_FIX,
          "keras#20585: Keras averages the first batch over the replicas to learn its shapes, "
          "which the collective all-reduce cannot do for a nested batch; one local replica's "
          "batch gives the same shapes", _keras3_fix),
    Patch("keras3-reduce-per-replica", f"{_TRAINER}.reduce_per_replica",
          "tfdist.keras.keras3:install_reduce_per_replica", _KERAS3_FIX,
          "keras#20585: Keras reduces scalar losses and metrics over axis 0, which fails on "
          "several workers; means them over the replicas as one worker does (and, unless a "
          "callback reads them, keeps each step's logs each worker's own: TFDIST_STEP_LOGS)",
          _keras3_fix),
    Patch("keras3-steps-per-execution", f"{_TRAINER}.TensorFlowTrainer._make_function",
          "tfdist.keras.keras3:install_steps_per_execution", _KERAS3_FIX,
          "compile(steps_per_execution=N) draws batches inside a tf.cond that a multi-worker "
          "iterator's end-of-data collective cannot run in; runs the N steps unrolled",
          _keras3_fix),
    Patch("keras3-epoch-chunks", f"{_TRAINER}.TFEpochIterator._enumerate_iterator",
          "tfdist.keras.keras3:install_epoch_chunks", _KERAS3_FIX,
          "tells the unrolled steps how many steps the epoch has left (its last, shorter chunk)",
          _keras3_fix),
    Patch("keras3-step-logs", f"{_TRAINER}.TensorFlowTrainer.fit/evaluate",
          "tfdist.keras.keras3:install_step_logs", _KERAS3_FIX,
          "decides per fit/evaluate whether each step's logs are averaged over the workers (a "
          "collective per step) or each worker's own, from the callbacks that read them; "
          "before fit's first step, refuses gradient_accumulation_steps (it fails upstream) "
          "and warns that clipping applies to each replica's gradients; refuses a compiled "
          "metric object made outside the scope (its state would stay each worker's own)",
          _keras3_fix),
    Patch("keras3-loss-scaling", "keras.src.losses.loss.scale_loss_for_distribution/"
          "unscale_loss_for_distribution/reduce_values, "
          "keras.src.metrics.reduction_metrics.Mean/Sum.update_state, "
          f"{_TRAINER}.TensorFlowTrainer._make_function/_compute_loss, "
          "tensorflow.GradientTape.gradient",
          "tfdist.keras.loss_scaling:install_loss_scaling",
          "Keras 3 under MWMS on several workers or MirroredStrategy",
          "Keras divides a loss object's mean by the replicas for their gradients' sum; a "
          "custom train_step that logs that value (returned, or fed to a Mean tracker) logs "
          "1/N of one process's loss: the very tensor Keras scaled is logged unscaled. A "
          "loss whose call() returns one number is left unscaled by Keras (N times the "
          "gradient): scaled like the others, with one warning. fit scales by each replica's "
          "share of the batch's rows, not 1/N (a global batch that does not divide: 17 and "
          "16 rows weighed 1:1), and weighs each step's logs by the rows each replica "
          "counted. A custom train_step's gradient of a mean of its own over the rows (the "
          "VAE, WGAN-GP) is scaled by the replica's share too; a sum over the rows, or a mean "
          "the step divides by the replicas, is left alone",
          lambda w: w.keras3 and w.backend.framework == TF and not w.backend.horovod
          and (w.several_processes or _replicas_in_one_process(w))),
    Patch("keras2-loss-objects", "tf_keras.src.losses.Loss.__call__/_get_reduction, "
          "tf_keras.src.metrics.base_metric.Reduce.update_state, "
          "tensorflow.GradientTape.gradient",
          "tfdist.keras.loss_scaling:install_keras2_loss_objects",
          "tf_keras under MWMS on several workers or MirroredStrategy",
          "tf_keras refuses a keras.losses object with its default reduction called outside "
          "compile under any strategy (a custom train_step's loss: the DCGAN, distillation): "
          "computes it as Keras 3 does, the replica's mean over the replicas (the summed "
          "gradient is the global batch's mean), and a Mean or Sum tracker fed that very "
          "tensor gets the unscaled mean. A custom train_step's gradient of a mean of its "
          "own over the rows (the VAE) is divided by the replicas in fit's step",
          lambda w: not w.keras3 and w.backend.framework == TF and not w.backend.horovod
          and (w.several_processes or _replicas_in_one_process(w))),
    Patch("keras3-global-draws", "keras.src.backend.tensorflow.random.normal/uniform/"
          f"truncated_normal/dropout, {_TRAINER}.TensorFlowTrainer._make_function, "
          "keras.src.random.seed_generator.global_seed_generator, "
          "tensorflow.random.normal/uniform/truncated_normal (a warning only)",
          "tfdist.keras.random_draws:install_global_draws",
          "Keras 3 under MWMS or Horovod on several processes, or MirroredStrategy (acts "
          "for 2 to 8 replicas, one per process)",
          "each replica draws Dropout's mask, noise and a random layer's per-row values for "
          "its own rows with the seed one process uses for the whole batch, so every replica "
          "gets the first rows' values; each draws the global batch's values and keeps its "
          "own rows: one process's draw. Keras's global seed generator (a draw without a "
          "seed), kept per thread, is one for every replica's thread",
          lambda w: w.keras3 and w.backend.framework == TF
          and (w.several_processes or _replicas_in_one_process(w))),
    Patch("keras2-told-draws", "tf_keras.src.backend.RandomGenerator.random_normal/"
          "random_uniform/truncated_normal/dropout, tensorflow.random.normal/uniform/"
          "truncated_normal (a warning only)",
          "tfdist.keras.random_draws:install_keras2_told_draws",
          "tf_keras under MWMS or Horovod on several processes, or MirroredStrategy",
          "tf_keras draws Dropout's mask, noise and tf.random values in a training step per "
          "replica, with each graph's seeds (one process: one set for the global batch); "
          "the first such draw in fit's step gets one warning on the chief with the measured "
          "size and the fix (Keras 3)",
          lambda w: not w.keras3 and w.backend.framework == TF
          and (w.several_processes or _replicas_in_one_process(w))),
    Patch("mixed-keras", f"{_TRAINER}.TensorFlowTrainer.fit/evaluate/predict",
          "tfdist.keras.checks:install_mixed_keras",
          "MWMS or Horovod on several processes, TF_USE_LEGACY_KERAS=1 and Keras 3 imported "
          "before tfdist.init",
          "a Keras 3 model under a tf_keras strategy fails deep inside TensorFlow (or under "
          "Horovod trains without averaging); raises one error naming the fix instead",
          lambda w: ((_mwms(w) or (_horovod(w) and w.several_processes)) and w.legacy_keras
                     and w.keras3_imported)),
    Patch("keras2-step-results", "tf_keras.src.engine.training.reduce_per_replica, "
          "tf_keras.src.engine.training.Model.fit/evaluate/train_on_batch/test_on_batch",
          "tfdist.keras.step_results:install_keras2_step_results",
          "MWMS on several workers, tf_keras (Keras 2)",
          "tf_keras sums what each replica's step returns over the replicas ('auto' is 'sum' "
          "off TPUs): per-step logs, a custom step's values and train_on_batch/test_on_batch "
          "results are the replicas' sum; means them, as Keras 3 does",
          lambda w: _mwms(w) and not w.keras3),
    Patch("predict-on-batch", "keras.Model.predict_on_batch",
          "tfdist.keras.step_results:install_predict_on_batch",
          "MWMS on several workers, Keras 3",
          "Keras 3 gives every replica the whole batch and concatenates them all (each row "
          "once per replica); runs the batch through the model once, on this worker",
          lambda w: _mwms(w) and w.keras3),
    Patch("predict-empty-replica", f"{_TRAINER}.TensorFlowTrainer.predict_step",
          "tfdist.keras.step_results:install_predict_empty_replica",
          "MWMS on several workers, Keras 3, on the CPU",
          "a replica whose share of a predict batch is empty (fewer rows than replicas: "
          "predict(x[:1])) runs the model on no rows, and TensorFlow's oneDNN convolution "
          "(on by default on x86 CPUs) then fails in the graph ('input depth must be evenly "
          "divisible by filter depth: 1 vs 16', TensorFlow 2.21, an AVX-512 CPU); runs such a "
          "replica's model on one row of zeros and returns none of it",
          lambda w: _mwms(w) and w.keras3 and not w.gpus),
    Patch("epoch-results", "keras.Model._get_metrics_result_or_logs "
          "(tf_keras: _validate_and_get_metrics_result)",
          "tfdist.keras.step_results:install_epoch_results",
          "MWMS or Horovod on several processes",
          "under Horovod each rank's metrics hold its own examples: the epoch's, validation's "
          "and evaluate's results are read from the metrics' states summed over the ranks, a "
          "custom step's own values averaged over them; on both backends, a metric of yours "
          "(whose state is added over the workers) is named once on the chief",
          lambda w: _mwms(w) or (_horovod(w) and w.several_processes)),
    Patch("input-end-check",
          "tensorflow.python.distribute.input_lib.DistributedDataset.build",
          "tfdist.backends.mwms_input:install_input_end_check", "MWMS on several workers",
          "drops the per-step collective that asks whether every worker still has a batch, "
          "only for a dataset split by DATA with a constant batch (every worker gets as many "
          "batches); every other dataset keeps it", _mwms),
    Patch("host-input-iterator",
          "tensorflow.python.distribute.collective_all_reduce_strategy."
          "CollectiveAllReduceExtended._experimental_distribute_dataset",
          "tfdist.backends.mwms_input:install_host_input_iterator",
          "MWMS on several CPU workers (the wrapper acts where a worker has one replica)",
          "a worker whose one replica is its CPU reads a distributed dataset through a plain "
          "tf.data iterator, as TensorFlow's host-placed per-replica input does, instead of a "
          "multi-device iterator that copies to no device and costs 0.1-1 s an epoch to make "
          "and free", lambda w: _mwms(w) and not w.gpus),
    Patch("arrays-one-order", "keras.Model.fit",
          "tfdist.keras.fit_inputs:install_arrays_one_order", "MWMS on several workers",
          "Keras shuffles fit's arrays with each worker's own random state, so the workers split "
          "different permutations (rows trained twice an epoch, others never); with shuffle on, "
          "the arrays become one dataset shuffled the same way on every worker (one seed), "
          "split by DATA; an uneven last batch of arrays and a generator are named once, and "
          "use_multiprocessing's forked loaders become threads", _mwms),
    Patch("arrays-shuffle-seed", "tensorflow.python.data.util.random_seed.get_seed",
          "tfdist.keras.fit_inputs:fixed_shuffle_seed",
          "while fit's shuffled arrays become one dataset, inside the wrapper of "
          "arrays-one-order (MWMS), horovod-fit (Horovod) or jax-inputs-by-rank (Keras 3 on "
          "JAX), several processes",
          "a shuffle's seed is paired with the process's global seed, which scripts often set "
          "per rank; the two seeds of that one shuffle are fixed, so every rank draws the same "
          "permutation each epoch",
          lambda w: _mwms(w) or (_horovod(w) and w.several_processes) or _jax_processes(w),
          CALL),
    Patch("sequence-one-order",
          "keras.src.trainers.data_adapters.py_dataset_adapter.random, "
          "tf_keras.src.engine.data_adapter.random, tf_keras.src.utils.data_utils.random",
          "tfdist.keras.fit_inputs:install_sequence_one_order",
          "several processes: MWMS, Horovod, Keras 3 on JAX",
          "Keras shuffles a PyDataset's (Sequence's) batches with Python's random, which each "
          "rank seeds its own way, so the ranks split different batches at one step (rows "
          "trained three times an epoch, others once); the shuffle draws from one seeded "
          "stream, the same on every rank",
          lambda w: _mwms(w) or (_horovod(w) and w.several_processes) or _jax_processes(w)),
    Patch("generator-copies", "tensorflow.data.Dataset.from_generator",
          "tfdist.keras.fit_inputs:install_generator_copies", "MWMS on several workers",
          "TensorFlow takes a generator's numpy arrays without copying them, and once MWMS has "
          "split a global batch, an op of the step may write its result into a replica's part "
          "in place: into the arrays a PyDataset, Sequence or generator returned views of "
          "(seen: a worker's labels overwritten in epoch 1, so epoch 2 trained on other "
          "labels, in about 4 runs of 10). Each element a generator yields is copied first",
          _mwms),
    Patch("horovod-fit", "keras.Model.compile (where it is defined)/fit/predict, "
          f"{_TRAINER}.TensorFlowTrainer._maybe_symbolic_build",
          "tfdist.horovod.fit:install_horovod_fit",
          "backend horovod (predict: several processes; the symbolic build: Keras 3)",
          "Model.fit behaves as under MWMS: compile wraps the optimizer so gradients are "
          "averaged, fit splits arrays, PyDatasets and generators by rank and broadcasts rank "
          "0's initial state, predict "
          "on a dataset dist.shard split returns every row in order, and Keras 3 builds the "
          "model before the first step", _horovod),
    Patch("compile-without-xla", "keras.Model.compile (where it is defined: Keras 3's Trainer)",
          "tfdist.keras.checks:install_compile_without_xla",
          "MWMS on several CPU workers; Horovod",
          "XLA cannot compile the step's all-reduce there (no XLA collectives for CPU devices, "
          "b/194942685; Horovod's ops are not XLA ops): compile(jit_compile=True) trains "
          "without XLA, with one warning",
          lambda w: (_mwms(w) and not w.gpus) or _horovod(w)),
    Patch("keras3-input-position", f"{_TRAINER}.TFEpochIterator.__init__/_get_iterator",
          "tfdist.keras.input_position:install_keras3", "Keras 3, every TensorFlow backend",
          "counts the iterators fit makes, so a preempted fit resumes at the batch it stopped "
          "at instead of the epoch's start; the distributed iterator Keras makes at an epoch's "
          "end only to drop it unread at the next epoch's start is a stand-in that draws the "
          "same shuffle seeds without a multi-device iterator (input_position.SeedsOnly)",
          lambda w: w.backend.framework == TF and w.keras3),
    Patch("keras2-input-position",
          "tf_keras.src.engine.data_adapter.DataHandler.__init__/enumerate_epochs, "
          "tf_keras.src.engine.training.Model._maybe_load_initial_counters_from_ckpt",
          "tfdist.keras.input_position:install_keras2",
          "tf_keras (Keras 2), every TensorFlow backend",
          "the same for tf_keras: where the stopped fit's input stood, and the step counters "
          "it resumes with", lambda w: w.backend.framework == TF and not w.keras3),
    Patch("fit-input-wait",
          f"{_TRAINER}.TensorFlowTrainer.make_train_function (tf_keras: "
          "tf_keras.src.engine.training.Model.make_train_function), "
          "tensorflow.python.distribute.input_lib._SingleWorkerDatasetIteratorBase."
          "get_next_as_list/get_next_as_optional_list, "
          "tensorflow.python.data.ops.iterator_ops.OwnedIterator._next_internal/"
          "get_next_as_optional",
          "tfdist.keras.input_wait:install_timing", "every TensorFlow backend",
          "fit reads each step's batch inside the step's graph, where no callback can time it; "
          "while Keras traces its train function, this worker's read of the batch gets a clock "
          "read before and after, added to one variable the throughput meter reads at each "
          "epoch's end (the per-rank profile's input wait, the input advice)",
          lambda w: w.backend.framework == TF),
    Patch("iterator-free-thread",
          "tensorflow.python.data.ops.iterator_ops.OwnedIterator._create_iterator",
          "tfdist.keras.iterators:install_free_thread",
          "every TensorFlow backend; Keras 3 on JAX lazily, by jax-input-position's wrapper "
          "once an epoch's input is made with TensorFlow loaded",
          "freeing an autotuned tf.data iterator can wait for its autotuning thread's next "
          "pass (a race in TensorFlow: the cancellation wakes it before the iterator is marked "
          "cancelled; up to 60 s), and Keras frees the last epoch's iterator on the training "
          "thread at every epoch's start; a plain iterator made eagerly is freed on a thread of "
          "tfdist's own instead (a multi-device iterator's are left to TensorFlow)",
          lambda w: w.backend.framework in (TF, JAX), _iterator_free_phase),
    Patch("user-writers", "keras.Model.fit", "tfdist.keras.writers:install_user_writers",
          "several processes, every TensorFlow backend",
          "the ModelCheckpoint, BackupAndRestore, CSVLogger and TensorBoard a script passes "
          "straight to fit would all write one path from every rank; routes them as "
          "dist.callbacks() does (the chief writes; a backup folder per rank), and refuses "
          "checkpoints passed on some ranks only where a save runs collectives; before the "
          "first step, refuses a BatchNormalization model whose last batch leaves a replica "
          "no rows (its statistics, then every weight, would be NaN)",
          lambda w: w.several_processes and w.backend.framework == TF),
    Patch("save-once", "keras.Model.save/save_weights, tensorflow.saved_model.save, "
          "tensorflow.train.Checkpoint.write/save, tensorflow.train.CheckpointManager.save",
          "tfdist.keras.writers:install_save_once", "several processes, every TensorFlow backend",
          "model.save, save_weights, tf.saved_model.save or a tf.train.Checkpoint on every rank "
          "would write one path from every rank at once (an h5 lock, MergeV2Checkpoints "
          "errors); the chief writes it (a file or SavedModel folder atomically), the others "
          "a scratch copy that is removed (MWMS: the save runs collectives; a Checkpoint: its "
          "numbering) or nothing (Horovod). MWMS, outside fit: "
          "the ranks' paths compared first (a path per rank is written by its rank) and no "
          "rank returns before every file is written",
          lambda w: w.several_processes and w.backend.framework == TF),
    Patch("jax-input-position", "keras.src.backend.jax.trainer.JAXEpochIterator.__init__/"
          "_get_iterator", "tfdist.keras.input_position:install_jax", "Keras 3 on JAX",
          "counts the iterators fit draws from, so a preempted fit resumes at the batch it "
          "stopped at, with the order the stopped run saw, instead of the epoch's start; "
          "times each batch's arrival (the throughput meter's input wait)",
          lambda w: w.backend.framework == JAX),
    Patch("jax-rank0-values", "keras.src.backend.jax.distribution_lib.distribute_tensor, "
          "keras.src.backend.jax.core.should_shard_at_init",
          "tfdist.jax.patches:install_rank0_values", "Keras 3 on JAX, several processes",
          "JAX stops with a raw AssertionError when a variable's value differs between "
          "processes (a model seeded per rank), and a large variable is made by a jitted "
          "initializer with each process's own seed; an eager placement takes rank 0's value "
          "(one broadcast), and every variable is made that way",
          _jax_processes),
    Patch("jax-inputs-by-rank", "keras.Model.fit/evaluate/predict",
          "tfdist.jax.patches:install_inputs_by_rank", "Keras 3 on JAX, several processes",
          "Keras refuses in-memory arrays on several processes (or, without its auto-shard, "
          "would read every row on every rank); arrays become one dataset of global batches, "
          "fit's shuffled the same way on every rank, of which each rank reads its part; "
          "fit's validation arrays likewise; a PyDataset or a generator (read whole on every "
          "rank: one process's numbers for twice the work) gives each rank its part of every "
          "batch, and its loader processes become threads",
          _jax_processes),
    Patch("jax-predict-every-row", "keras.src.backend.jax.trainer.JAXTrainer."
          "make_predict_function", "tfdist.jax.patches:install_predict_every_row",
          "Keras 3 on JAX, several processes",
          "predict cannot read a batch whose rows lie on several processes (a RuntimeError); "
          "each batch's outputs are gathered from every process in rank order, so every rank "
          "gets every row, as from one process",
          _jax_processes),
    Patch("verify-record", "keras.Model.fit/evaluate/predict",
          "tfdist.verify.record:install_record",
          "the runs `tfdist verify` starts (TFDIST_VERIFY_DIR), every Keras backend",
          "records each fit step's logs and weights, evaluate's and predict's results and, at "
          "the end, every model's weights, for the comparison with one process; changes "
          "nothing the script computes (fit stops after TFDIST_VERIFY_STEPS steps)",
          lambda w: w.verify and w.backend.framework in (TF, JAX)),
    Patch("failure-line", "sys.excepthook", "tfdist.failures:install_failure_line",
          "MWMS and Horovod, in any number of processes (torch's backends install it too)",
          "after an uncaught error, one line naming the failed or stopped peer's rank, host "
          "and step, which the framework's own error does not name",
          lambda w: w.backend.crosses_processes and w.backend.framework in (TF, TORCH)),
    Patch("timeout-line", "sys.excepthook", "tfdist.timeouts:install_timeout_line",
          "MWMS with TFDIST_COLLECTIVE_TIMEOUT",
          "after a collective timed out, one line saying which collective waited how long and "
          "what to raise", lambda w: _mwms_backend(w) and w.collective_timeout is not None),
)

_BY_KEY = {patch.key: patch for patch in INVENTORY}
# The one marker: a replacement carries (key, original), so a patch is found also under a later
# wrapper (two patches of sys.excepthook chain). A replacement that takes no attribute (an
# object of a slotted class) is marked here instead.
_MARK = "__tfdist_patch__"
_marks: dict[int, tuple[str, Any]] = {}
_installed: list[Patch] = []
# key -> what apply() replaced: (owner, attribute, replacement, original), for undo()
_applied: dict[str, list[tuple[Any, str, Any, Any]]] = {}


def apply(key: str, owner: Any, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replaces ``owner.name`` by ``wrap(original)``, unless this patch is in place already.

    Args:
        key: the patch's row in :data:`INVENTORY`.
        owner: the class, module or object that holds the attribute.
        name: the attribute.
        wrap: makes the replacement from the original.

    Returns:
        Whether it replaced the attribute now (False: this patch is in place already, also
        under a later wrapper).

    Raises:
        KeyError: ``key`` is not in the inventory (every patch must be).
    """
    patch = _BY_KEY[key]
    original = getattr(owner, name)
    if _in_place(original, key):
        return False
    replacement = wrap(original)
    _mark(replacement, key, original)
    setattr(owner, name, replacement)
    _applied.setdefault(key, []).append((owner, name, replacement, original))
    if patch not in _installed:
        _installed.append(patch)
    return True


def undo(key: str) -> None:
    """Puts back what row ``key`` replaced where its wrapper is still the outermost, and
    forgets the row: an :data:`IMPORT` row armed before :func:`tfdist.init` chose a backend
    that does not plan it (``init(backend="single")`` in a launch of several processes)."""
    for owner, name, replacement, original in _applied.pop(key, []):
        if getattr(owner, name, None) is replacement:
            setattr(owner, name, original)
    _installed[:] = [patch for patch in _installed if patch.key != key]


def _mark(replacement: Any, key: str, original: Any) -> None:
    try:
        setattr(replacement, _MARK, (key, original))
    except (AttributeError, TypeError):
        _marks[id(replacement)] = (key, original)


def _in_place(value: Any, key: str) -> bool:
    """Whether ``value`` is this patch's replacement, or wraps it."""
    for _ in range(64):  # a chain of wrappers is short; a cycle cannot hang
        mark = getattr(value, _MARK, None)
        mark = mark if isinstance(mark, tuple) else _marks.get(id(value))
        if mark is None:
            return False
        if mark[0] == key:
            return True
        value = mark[1]
    return False


@contextlib.contextmanager
def scoped(key: str, owner: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """:func:`apply` for the block only: the original is back when it ends."""
    patch = _BY_KEY[key]
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    if patch not in _installed:
        _installed.append(patch)
    try:
        yield
    finally:
        setattr(owner, name, original)


def rebinding(original: Callable[..., Any],
              change: Callable[[inspect.BoundArguments], None]) -> Callable[..., Any]:
    """A replacement of the method ``original`` that lets ``change`` edit its bound arguments
    (``arguments`` holds each by name, defaults left out) before calling it; a call whose
    arguments do not bind goes to ``original`` unchanged, whose own error then says why."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)
        change(bound)
        return original(*bound.args, **bound.kwargs)

    return method


def installed() -> list[Patch]:
    """The patches this process applied (scoped ones too), in the order first applied."""
    return list(_installed)


def planned(where: Where, phase: str | None = None) -> list[Patch]:
    """The patches tfdist applies for a launch like ``where`` (of ``phase`` only, if given), in
    the inventory's order; ``where.skip`` (``TFDIST_SKIP_PATCHES``) leaves rows out."""
    return [patch for patch in INVENTORY if patch.key not in where.skip and patch.applies(where)
            and (phase is None or patch.phase_in(where) == phase)]


def install(where: Where, handle: Any) -> list[Patch]:
    """Installs the :data:`START` rows planned for ``where``, in the inventory's order, each by
    its installer (``installer(where, handle)``), and keeps ``where`` as this process's plan
    (:func:`plan`) for the rows of later phases. Returns the rows."""
    _plan[:] = [where]
    armed = [p for p in _installed if p.phase_in(where) == IMPORT and p not in planned(where)]
    for patch in armed:  # armed at TensorFlow's import for a backend init did not choose
        undo(patch.key)
    rows = planned(where, START)
    for patch in rows:
        _installer(patch)(where, handle)
    return rows


@contextlib.contextmanager
def creating(where: Where, settings: Mapping[str, Any]) -> Iterator[None]:
    """While the block runs (MultiWorkerMirroredStrategy's creation), the :data:`CREATE` rows
    planned for ``where`` are in place, in the inventory's order (each installer's context
    manager, made from ``(where, settings)``: the settings of :func:`tfdist.init`)."""
    _plan[:] = [where]
    with contextlib.ExitStack() as stack:
        for patch in planned(where, CREATE):
            stack.enter_context(_installer(patch)(where, settings))
        yield


def plan() -> Where | None:
    """The launch this process installed its patches for (:func:`install`), if it did."""
    return _plan[0] if _plan else None


def planned_here(key: str) -> bool:
    """Whether this process's plan holds row ``key``: the wrapper that installs a
    :data:`CALL` or :data:`LAZY` row asks first. True where no plan was made (a script that
    calls an installer itself).

    Raises:
        KeyError: ``key`` is not in the inventory.
    """
    patch = _BY_KEY[key]
    return not _plan or patch in planned(_plan[0])


def is_planned(key: str) -> bool:
    """Whether this process's plan holds row ``key`` (False where no plan was made)."""
    return bool(_plan) and _BY_KEY[key] in planned(_plan[0])


# The row whose fit weighs each replica's loss by its rows (an uneven split is one process's).
ROWS_WEIGHTED = "keras3-loss-scaling"

_plan: list[Where] = []


def _installer(patch: Patch) -> Callable[..., Any]:
    module, _, name = patch.installer.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def where(backend: Backend, versions: Mapping[str, str], environ: Mapping[str, str],
          settings: Mapping[str, Any], *, several_processes: bool, gpus: bool,
          imported: Collection[str] | None = None,
          eager_record_lost: bool | None = None) -> Where:
    """A launch's :class:`Where`, without importing a framework: the one way to build one, for a
    running process (:func:`tfdist.backends.where_here`) and for ``tfdist env``.

    Args:
        backend: the chosen backend's row.
        versions: installed versions, package -> version (``tfdist doctor``'s).
        environ: the environment variables (``TF_USE_LEGACY_KERAS``).
        settings: :func:`tfdist.init`'s settings (:func:`tfdist.strategy.resolve_settings`):
            ``cpu_replicas``, ``collective_timeout``, ``skip_patches``.
        several_processes: the launch has more than one process.
        gpus: this process drives GPUs.
        imported: the modules the process imported (``sys.modules``); None before it starts
            (``tfdist env``): a script may import any.
        eager_record_lost: whether TensorFlow's eager context lost its record
            (:func:`tfdist.keras.keras2.eager_record_lost`); None before the process starts:
            where it can be lost (TensorFlow 2.14 and older).
    """
    legacy = legacy_keras_requested(environ)
    keras = _major_minor(versions.get("keras", ""))
    tensorflow = _major_minor(versions.get("tensorflow", ""))
    lost = (0, 0) < tensorflow < (2, 15) if eager_record_lost is None else eager_record_lost
    return Where(backend, keras3=keras >= (3, 0) and not legacy, tensorflow=tensorflow,
                 several_processes=several_processes, gpus=gpus, keras=keras,
                 legacy_keras=legacy,
                 keras3_imported=keras >= (3, 0) and (imported is None or "keras" in imported),
                 eager_record_lost=lost, cpu_replicas=settings.get("cpu_replicas") or 1,
                 collective_timeout=settings.get("collective_timeout"),
                 skip=frozenset(settings.get("skip_patches") or ()),
                 verify=bool(environ.get(verify_protocol.DIR)))


def _major_minor(version: str) -> tuple[int, int]:
    major, minor, *_ = [int("".join(c for c in part if c.isdigit()) or 0)
                        for part in f"{version}.0.0".split(".")]
    return major, minor


def markdown_table() -> str:
    """docs/architecture.md's table of the inventory, one row per patch, in its order."""
    rows = ["| patch | replaces | installed by | phase: when |", "|---|---|---|---|"]
    for patch in INVENTORY:
        phase = patch.phase if isinstance(patch.phase, str) else f"{START}/{LAZY}"
        rows.append(f"| `{patch.key}` | `{patch.target}` | `{patch.installer}` | "
                    f"{phase}: {patch.when} |")
    return "\n".join(rows)
