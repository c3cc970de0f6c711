"""tf.data iterators freed on tfdist's thread (tfdist.keras.iterators): the freeing thread
and its exit
wait on plain Python objects, the per-device rule as a table, and one real process each way
(tests/workers/iterator_free_worker.py). That Keras's epochs on 2 MWMS workers are freed there
and train the same weights: tests/test_multiworker.py. What it saves:
benchmarks/epoch_start.py (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
from helpers import ROOT, WORKERS, clean_env

from tfdist.keras import iterators


class Held:
    """Stands for an iterator's resource: notes the thread it is dropped on."""

    def __init__(self, dropped_on: list[str], hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        weakref.finalize(self, lambda: (time.sleep(hold_s),
                                        dropped_on.append(threading.current_thread().name)))


def test_what_is_handed_over_is_dropped_on_the_freeing_thread():
    freer, dropped_on = iterators._Freer(), []
    freer.hand_over(Held(dropped_on), None)
    assert freer.close(5.0)
    assert dropped_on == ["tfdist-iterator-free"]
    assert freer.counts() == (0, 1)


def test_the_caller_does_not_wait_for_a_slow_free():
    freer, dropped_on = iterators._Freer(), []
    started = time.monotonic()
    freer.hand_over(Held(dropped_on, hold_s=0.5))
    assert time.monotonic() - started < 0.25  # the half second is the freeing thread's
    assert freer.counts()[0] == 1
    assert freer.close(5.0) and dropped_on == ["tfdist-iterator-free"]


def test_at_exit_the_wait_is_bounded_and_later_frees_are_the_callers():
    freer, dropped_on = iterators._Freer(), []
    freer.hand_over(Held(dropped_on, hold_s=0.6))
    assert not freer.close(0.05)  # still freeing: exit goes on without it
    freer.hand_over(Held(dropped_on))  # closed: dropped by the caller, here
    here = threading.current_thread().name
    assert dropped_on == [here]
    assert freer.close(5.0) and dropped_on == [here, "tfdist-iterator-free"]


def test_a_forked_child_frees_on_a_thread_of_its_own():
    freer, dropped_on = iterators._Freer(), []
    freer.hand_over(Held(dropped_on, hold_s=0.5))  # the parent's thread is busy at the fork
    child = os.fork()
    if child == 0:  # the child: no freeing thread was copied, and the lock may be held
        freer._reset()  # what os.register_at_fork does for tfdist's own
        freer.hand_over(Held([]))
        os._exit(0 if freer.close(5.0) else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert freer.close(5.0) and dropped_on == ["tfdist-iterator-free"]


class Dataset:
    def __init__(self, *inputs: object, name: str = "MapDataset") -> None:
        self._found = list(inputs)
        self.__class__ = type(name, (type(self),), {})

    def _inputs(self) -> list[object]:
        return self._found


class Unsaying(Dataset):
    def _inputs(self) -> list[object]:
        raise TypeError("cannot say")


@pytest.mark.parametrize(("dataset", "feeds"), [
    (Dataset(Dataset(name="TensorSliceDataset")), False),  # a user's pipeline
    (Dataset(name="_ReincarnatedPerDeviceGenerator"), True),  # a multi-device iterator's part
    (Dataset(Dataset(name="_PerDeviceGenerator"), name="_PrefetchDataset"), True),  # prefetched
    (Dataset(Dataset(), Dataset(name="_PerDeviceGenerator"), name="ZipDataset"), False),  # two
    (Unsaying(), True),  # cannot tell: left to TensorFlow
])
def test_a_multi_device_iterators_parts_are_left_to_tensorflow(dataset, feeds):
    assert iterators._feeds_a_device(dataset) is feeds


def _worker(free: str) -> tuple[dict, dict]:
    env = clean_env()
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TFDIST_ITERATOR_FREE=free)
    done = subprocess.run([sys.executable, str(WORKERS / "iterator_free_worker.py")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found, left = [json.loads(line) for line in done.stdout.splitlines()
                   if line.startswith("{")]
    return found, left


def test_plain_iterators_made_eagerly_are_freed_on_tfdists_thread():
    found, left = _worker("thread")
    assert found["backend"] == "single"
    assert found["start"] == 0
    assert found["dropped"] == 1  # an epoch's iterator, dropped on the main thread
    assert found["loop"] == 2  # a custom loop's
    assert found["traced"] == found["loop"]  # made while tracing: TensorFlow's
    assert found["multi_device"] == found["traced"]  # a multi-device iterator's: TensorFlow's
    assert found["fit"] - found["multi_device"] >= 3  # fit's, at least one an epoch
    assert left == {"pending_at_exit": 0}  # the last one, handed over at exit, was waited for


def test_with_tensorflows_way_every_free_stays_where_tensorflow_does_it():
    found, left = _worker("tensorflow")
    assert {key: value for key, value in found.items() if key != "backend"} == dict.fromkeys(
        ("start", "dropped", "loop", "traced", "multi_device", "fit"), 0)
    assert left == {"pending_at_exit": 0}
