"""How long does freeing a tf.data iterator block its caller, tf.data autotuning on and off?

    .venv/bin/python benchmarks/iterator_free.py [--rounds 8] [--read 0.2 2.6] [--busy 2]

One process, no tfdist: an iterator of ``range -> map(AUTOTUNE) -> batch -> prefetch(AUTOTUNE)``
is read for ``--read`` seconds, then dropped (Keras drops the last epoch's iterator this way
at every epoch's start, on the training thread), and the drop is timed. The variants alternate:
``autotune`` (TensorFlow's default) and ``no-autotune`` (``options.autotune.enabled = False``).

What it shows (docs/performance.md, "Each epoch's start and end"): with autotuning on, some
drops block for the rest of the autotuning thread's current wait. That thread optimizes 10 ms
after the first read, then after 20, 40, 80 ... ms (doubling, at most 60 s), and the iterator's
free joins it.
The free's cancellation wakes it before TensorFlow marks the iterator cancelled, so it can go
back to sleep until its next deadline. ``remainder`` is that deadline's distance from the drop,
computed from the schedule (optimizing takes about a millisecond here, so the schedule drifts a
little). A drop that blocks about ``remainder`` lost that race; one that takes milliseconds won it.
How often it is lost depends on the load: ``--busy N`` runs N processes that spin on the CPU
meanwhile, as a second worker on the same cores does.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

PERIOD_MIN_MS, PERIOD_MAX_MS = 10, 60_000
STALL_MS = 20  # a drop slower than this (and the no-autotune median) is counted as blocked


def remainder_ms(read_ms: float) -> float:
    """From ``read_ms`` after the first read to autotuning's next deadline (pure)."""
    deadline, period = 0.0, PERIOD_MIN_MS
    while deadline <= read_ms:
        deadline += period
        period = min(period * 2, PERIOD_MAX_MS)
    return deadline - read_ms


def drop(tf: object, autotune: bool, read_s: float) -> tuple[float, float]:
    """Reads a new iterator for ``read_s`` and drops it: (ms read, ms the drop took)."""
    data = tf.data.Dataset.range(10**12).map(lambda x: x * 2,  # type: ignore[attr-defined]
                                             num_parallel_calls=tf.data.AUTOTUNE)
    data = data.batch(8).prefetch(tf.data.AUTOTUNE)  # type: ignore[attr-defined]
    if not autotune:
        options = tf.data.Options()  # type: ignore[attr-defined]
        options.autotune.enabled = False
        data = data.with_options(options)
    iterator = iter(data)
    next(iterator)  # starts autotuning's thread
    first = time.perf_counter()
    while time.perf_counter() - first < read_s:
        next(iterator)
    dropped = time.perf_counter()
    del iterator
    done = time.perf_counter()
    return (dropped - first) * 1e3, (done - dropped) * 1e3


def spin() -> None:
    """Keeps one core busy until killed."""
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--read", type=float, nargs="+", default=[0.2, 2.6],
                        help="seconds each iterator is read before it is dropped")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        measure(args)
    finally:
        for spinner in spinners:
            spinner.kill()


def measure(args: argparse.Namespace) -> None:
    """Each ``--read`` length's rounds, then its medians."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    for read_s in args.read:
        drops: dict[str, list[float]] = {"autotune": [], "no-autotune": []}
        for r in range(args.rounds):
            order = ("autotune", "no-autotune") if r % 2 == 0 else ("no-autotune", "autotune")
            for variant in order:
                read_ms, took = drop(tf, variant == "autotune", read_s)
                drops[variant].append(took)
                print(f"read {read_s:4.1f} s  round {r + 1}  {variant:11s} drop {took:8.1f} ms"
                      f"  (remainder {remainder_ms(read_ms):7.1f} ms)", flush=True)
        calm = statistics.median(drops["no-autotune"])
        for variant, took in drops.items():
            blocked = [t for t in took if t > max(STALL_MS, 2 * calm)]
            print(f"read {read_s:4.1f} s  {variant:11s} drop median {statistics.median(took):7.1f}"
                  f" ms ({min(took):.1f}..{max(took):.1f}), {len(blocked)} of {len(took)} blocked",
                  flush=True)


if __name__ == "__main__":
    main()
