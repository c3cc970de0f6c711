"""Quiet by default: TensorFlow's start-up noise off on every rank, warnings and errors kept.

Every TensorFlow process prints the same lines at start-up, whatever it does: oneDNN's notice,
the CPU feature guard, absl's "All log messages before absl::InitializeLog()" (twice), and on
GPU builds the cuDNN/cuFFT/cuBLAS "Unable to register factory" errors and TF-TRT's warning.
Some of them ignore ``TF_CPP_MIN_LOG_LEVEL``. Times 8 ranks per node, they bury what matters.

- :func:`quiet_env` sets ``TF_CPP_MIN_LOG_LEVEL=1`` (TensorFlow's C++ INFO off; warnings and
  errors stay) where the user set neither it nor ``TFDIST_VERBOSE=1``: ``tfdist launch`` and
  :func:`tfdist.init` (before TensorFlow loads) apply it.
- :func:`is_noise` names the start-up lines that remain; ``tfdist launch`` drops them from the
  workers' output, and :func:`import_tensorflow` drops them while ``tfdist.init`` imports
  TensorFlow, through a separate filter process that outlives a crash of this one, so no
  message is lost.
- :func:`quiet_other_ranks` keeps the Python warnings of Keras and TensorFlow, which every rank
  repeats, to the chief.

``TFDIST_VERBOSE=1``, or a ``TF_CPP_MIN_LOG_LEVEL`` of your own, turns all of it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from tfdist.settings import resolve

__all__ = ["NOISE", "NOISE_WITHOUT_GPUS", "Noise", "filtered_stderr", "import_tensorflow",
           "is_noise", "quiet_env", "quiet_other_ranks", "wanted"]

logger = logging.getLogger("tfdist")

# Each pattern is searched in one line of output, whatever its prefix (absl's "I0000 ..." or
# TensorFlow's older "2024-01-01 ...: I tensorflow/core/...").
NOISE = (
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are "
               r"written to STDERR$"),
    re.compile(r"port\.cc:\d+\] oneDNN custom operations are on\."),
    re.compile(r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use "
               r"available CPU instructions"),
    re.compile(r"^To enable the following instructions: .*, in other operations, rebuild "
               r"TensorFlow with the appropriate compiler flags\.$"),
    re.compile(r"\] Unable to register cu(DNN|FFT|BLAS) factory: Attempting to register "
               r"factory for plugin cu(DNN|FFT|BLAS) when one has already been registered$"),
    re.compile(r"\] computation placer already registered\. Please check linkage and avoid "
               r"linking the same target more than once\.$"),
    re.compile(r"TF-TRT Warning: Could not find TensorRT$"),
    # tf.data and the distributed iterator, at every epoch's end or on a generator's input:
    # warnings about nothing that went wrong.
    re.compile(r"dataset\.cc:\d+\] Input of GeneratorDatasetOp::Dataset will not be optimized "
               r"because the dataset does not implement the AsGraphDefInternal"),
    re.compile(r"local_rendezvous\.cc:\d+\] Local rendezvous is aborting with status: "
               r"(CANCELLED: GetNextFromShard was cancelled|OUT_OF_RANGE: End of sequence)$"),
    re.compile(r"^\t \[\[\{\{node MultiDeviceIteratorGetNextFromShard\}\}\]\]$"),
)


# A GPU build of TensorFlow on a node without NVIDIA devices, from TensorFlow 2.22 on: at import
# (at INFO, whatever TF_CPP_MIN_LOG_LEVEL says) and at the first device query (an error, with its
# status's source trace below it). On a node with GPU device files the same lines say something
# is wrong (no driver loaded, no device usable): there they stay.
NOISE_WITHOUT_GPUS = (
    re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not "
               r"be used\.$"),
    re.compile(r"cuda_platform\.cc:\d+\] failed call to cuInit: .*\(303\)$"),
)
# The noise whose status's source trace follows it, and the trace's lines (up to a blank line).
_TRACED = (NOISE_WITHOUT_GPUS[1],)
_TRACE = (re.compile(r"^=== Source Location Trace: ===\s*$"),
          re.compile(r"^\s*[\w./+-]+:\d+\s*$"), re.compile(r"^\s*$"))


def is_noise(line: str, without_gpus: bool = False) -> bool:
    """Whether ``line`` (without its newline) is one of TensorFlow's start-up lines (pure); with
    ``without_gpus``, on a node without NVIDIA devices (:data:`NOISE_WITHOUT_GPUS` too)."""
    line = line.rstrip("\r\n")
    return any(pattern.search(line) for pattern in _patterns(without_gpus))


def _patterns(without_gpus: bool) -> tuple[re.Pattern[str], ...]:
    return NOISE + NOISE_WITHOUT_GPUS if without_gpus else NOISE


class Noise:
    """The noise of one stream of lines: :func:`is_noise`, and the lines that belong to a
    dropped one (a status's source trace after it). ``without_gpus``: see :func:`is_noise`;
    by default this node's (:func:`tfdist.devices.node_gpus`)."""

    def __init__(self, without_gpus: bool | None = None) -> None:
        if without_gpus is None:
            from tfdist.devices import node_gpus

            without_gpus = node_gpus() == 0
        self.patterns = _patterns(without_gpus)
        self._in_trace = False  # the lines before were noise whose trace may go on

    def drops(self, line: str) -> bool:
        """Whether ``line`` (without its newline) is noise; call once per line, in order."""
        line = line.rstrip("\r\n")
        if self._in_trace and any(pattern.search(line) for pattern in _TRACE):
            self._in_trace = bool(line.strip())  # a blank line ends the trace
            return True
        dropped = any(pattern.search(line) for pattern in self.patterns)
        self._in_trace = dropped and any(pattern.search(line) for pattern in _TRACED)
        return dropped


def wanted(env: Mapping[str, str]) -> bool:
    """Whether tfdist quiets a process with environment ``env`` (pure): ``TFDIST_VERBOSE`` if
    set, else only where the user did not set ``TF_CPP_MIN_LOG_LEVEL``.

    Raises:
        ConfigError: ``TFDIST_VERBOSE`` is neither 1 nor 0.
    """
    verbose = resolve("verbose", environ=env)
    return "TF_CPP_MIN_LOG_LEVEL" not in env if verbose is None else not verbose


def quiet_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``TF_CPP_MIN_LOG_LEVEL=1`` (unless set) and ``TFDIST_VERBOSE=0`` added
    where :func:`wanted`, so that the processes it starts stay quiet too (pure)."""
    if not wanted(env):
        return dict(env)
    return {**env, "TF_CPP_MIN_LOG_LEVEL": env.get("TF_CPP_MIN_LOG_LEVEL", "1"),
            "TFDIST_VERBOSE": "0"}


# The filter process: copies stdin to stderr line by line, leaving out the noise. It imports
# nothing of tfdist's (it starts in ~20 ms) and ends when every writer has closed the pipe, the
# process that started it included, even if that one died.
_FILTER = r"""
import re, sys
noise, traced, trace = ([re.compile(p) for p in group.split("\n")] for group in sys.argv[1:4])
out, in_trace = sys.stderr.buffer, False
for raw in sys.stdin.buffer:
    line = raw.decode("utf-8", "replace").rstrip("\r\n")
    if in_trace and any(p.search(line) for p in trace):
        in_trace = bool(line.strip())
        continue
    dropped = any(p.search(line) for p in noise)
    in_trace = dropped and any(p.search(line) for p in traced)
    if not dropped:
        out.write(raw)
        out.flush()
"""


@contextlib.contextmanager
def filtered_stderr() -> Iterator[None]:
    """Drops :func:`is_noise` lines written to file descriptor 2 (by any library, C++ included)
    while the block runs.

    A child process does the filtering, so a crash in the block still gets every line out.
    """
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to filter
        yield
        return
    try:
        groups = ["\n".join(p.pattern for p in group)
                  for group in (Noise().patterns, _TRACED, _TRACE)]
        child = subprocess.Popen([sys.executable, "-c", _FILTER, *groups],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=saved,
                                 close_fds=True)
    except OSError as error:  # no filter is better than no start
        os.close(saved)
        logger.debug("tfdist: start-up output unfiltered: %s", error)
        yield
        return
    assert child.stdin is not None
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer here is gone: the filter drains and ends
        os.close(saved)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a thread of the block still holds the pipe
            logger.debug("tfdist: the start-up output filter is still running")


def import_tensorflow() -> Any:
    """``import tensorflow``, quietly where :func:`wanted` (see the module's docstring)."""
    if "tensorflow" in sys.modules or not wanted(os.environ):
        import tensorflow as tf

        return tf
    os.environ.update(quiet_env(os.environ))
    with filtered_stderr():
        import tensorflow as tf

        # The first device query prints the rest of a GPU build's start-up lines (TensorFlow
        # 2.22: cuInit's failure on a node without GPUs); it starts no runtime.
        tf.config.list_physical_devices("GPU")
    return tf


def quiet_other_ranks(is_chief: bool) -> None:
    """On a rank other than the chief, where :func:`wanted`: Python warnings from Keras and
    TensorFlow and other libraries' INFO logs are left to the chief, which prints the same;
    tfdist's own warnings and errors stay."""
    if is_chief or not wanted(os.environ):
        return
    import warnings

    for module in ("keras", "tf_keras", "tensorflow", "absl", "tensorflow_datasets"):
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    for name in ("", "absl"):
        other = logging.getLogger(name)
        other.setLevel(max(other.getEffectiveLevel(), logging.WARNING))
    tfdist_logger = logging.getLogger("tfdist")
    if tfdist_logger.level == logging.NOTSET:
        tfdist_logger.setLevel(logging.WARNING)


class _OwnLines(logging.StreamHandler):  # type: ignore[type-arg]
    """tfdist's own lines, as they are, where the script configured no logging: with a handler
    on the root logger (``logging.basicConfig``, absl's ``app.run``) the script's handlers print
    them instead, so nothing is printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_own_lines(is_chief: bool) -> None:
    """Shows tfdist's status lines (start-up, batch, throughput, preemption) in any script: on
    the chief its INFO lines, on the other ranks its warnings and errors. A level the script set
    on the ``tfdist`` logger stays. Once per process."""
    tfdist_logger = logging.getLogger("tfdist")
    if not any(isinstance(handler, _OwnLines) for handler in tfdist_logger.handlers):
        handler = _OwnLines(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        tfdist_logger.addHandler(handler)
    if tfdist_logger.level == logging.NOTSET:
        tfdist_logger.setLevel(logging.INFO if is_chief else logging.WARNING)
