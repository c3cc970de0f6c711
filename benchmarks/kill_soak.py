"""Does a SIGKILL during a background save ever lose the last complete state?

    .venv/bin/python benchmarks/kill_soak.py [--kills 50] [--mb 200] [--seed S]

A Keras 3 model of Dense layers (weights plus Adam's state about ``--mb`` MB, with Dropout)
trains 3 epochs of 40 steps on 2 workers under `tfdist launch`, with a model_dir,
``TFDIST_BACKGROUND_SAVES=1`` and a save every 0.5 s of training. The same command is started
again and again, each time SIGKILLed (every rank's process group, then the launcher: no handler
runs) at a random moment while a background save is being written (a partial folder
``.preempted.partial-N`` is in model_dir; which save and the moment within it drawn from the
seed). After each kill the newest complete state must be there and load: its ``state.json``,
its index, and ``variables.bin`` holding every byte the index names. A job killed until it
ends (each run resumes from the last kill's state) must end with weights and optimizer state
bit-identical to an uninterrupted run's: every resume was exact. Jobs follow each other until
``--kills`` kills. Prints each kill (the save it landed in, the state found) and each job's
end; exits 1 on a state missing or damaged, or a final digest that differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 1024  # each hidden layer WIDTH x WIDTH: 1 M weights, 12.6 MB with Adam's two slots
STEPS, EPOCHS = 40, 3


def worker(out: str, model_dir: str, layers: int) -> None:
    """One rank's training; the chief writes the final digest and the steps it trained."""
    import numpy as np

    import tfdist

    with tfdist.strategy_scope() as dist:
        import keras

        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((WIDTH,)),
                                  *[keras.layers.Dense(WIDTH, activation="relu")
                                    for _ in range(layers)],
                                  keras.layers.Dropout(0.2), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    rows = 8 * dist.num_replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows * STEPS, WIDTH)).astype("float32")
    y = rng.normal(size=(rows * STEPS, 1)).astype("float32")
    trained = [0]

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            trained[0] += 1

    model.fit(x, y, batch_size=rows, epochs=EPOCHS, verbose=0,
              callbacks=dist.callbacks(Count(), model_dir=model_dir, tensorboard=False))
    from tfdist.sync import digest, model_variables

    if dist.is_chief:
        Path(out).write_text(json.dumps({
            "digest": digest(model_variables(model, include_optimizer=True)),
            "steps": trained[0]}))


def _command(out: str, model_dir: str, layers: int) -> list[str]:
    return [sys.executable, "-m", "tfdist", "launch", "-n", "2", __file__, "--worker", out,
            model_dir, str(layers)]


def _env(background: bool) -> dict[str, str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if background:
        env.update(TFDIST_BACKGROUND_SAVES="1", TFDIST_CHECKPOINT_EVERY="0.5s")
    return env


def _partial(model_dir: str) -> str | None:
    try:
        return next((n for n in os.listdir(model_dir) if n.startswith(".preempted.partial-")),
                    None)
    except FileNotFoundError:
        return None


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (Linux's /proc): the launcher's workers."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{name}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(name))
    return found


def _gone(group: int, timeout_s: float = 60) -> None:
    """Waits until every process of the killed ``group`` has ended: one inside a write ends
    when the write does (the next run would find model_dir held by a live process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def run_or_kill(out: str, model_dir: str, layers: int, rng: random.Random | None,
                timeout_s: float = 600) -> str | None:
    """Runs the command once. With ``rng``: waits for a background save to be in flight
    (skipping a random 1-3 of them: the first save of a new job has none before it), and
    SIGKILLs every process a random 0-50 ms into it; the partial folder it was in. None where
    the run ended first (its final result in ``out``)."""
    log = open(out + ".log", "w")  # noqa: SIM115 (closed below, after the process)
    launch = subprocess.Popen(_command(out, model_dir, layers), cwd=ROOT,
                              env=_env(True), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    skip = 1 + rng.randrange(3) if rng else None
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while launch.poll() is None and time.monotonic() < deadline:
            found = _partial(model_dir) if skip is not None else None
            if found and found not in seen:
                seen.add(found)
                if len(seen) > (skip or 0):
                    time.sleep(rng.uniform(0, 0.05) if rng else 0)
                    workers = _children(launch.pid)
                    for pid in workers:  # each in a session of its own: its group
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGKILL)
                    os.killpg(launch.pid, signal.SIGKILL)
                    launch.wait()
                    for pid in workers:
                        _gone(pid)
                    return found
            time.sleep(0.002)
        if launch.returncode != 0:
            log.close()
            tail = Path(out + ".log").read_text()[-3000:]
            raise SystemExit(f"the run failed (exit {launch.returncode}) or took over "
                             f"{timeout_s:.0f} s: {' '.join(_command(out, model_dir, layers))}"
                             f"\n{tail}")
        return None
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait()
        log.close()


def check_state(model_dir: str) -> dict:
    """The newest complete state in ``model_dir``, read as a resume reads it; raises where it
    is missing or damaged."""
    from tfdist import preemption
    from tfdist.keras import snapshot

    states = preemption.read_states(model_dir)
    if not states:
        raise SystemExit(f"no complete state in {model_dir}: {sorted(os.listdir(model_dir))}")
    state = states[0]
    index = os.path.join(state["path"], snapshot.FILE)
    if not os.path.exists(index):  # saved before the first background save: Keras's file
        raise SystemExit(f"{state['path']} has no {snapshot.FILE}: {os.listdir(state['path'])}")
    arrays = snapshot._read(index)  # every byte the index names, or ValueError
    if not arrays:
        raise SystemExit(f"{index} names no arrays")
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--mb", type=int, default=200, help="weights + Adam's state, in MB")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    layers = max(1, round(args.mb * 1e6 / (WIDTH * WIDTH * 4 * 3)))
    print(f"seed {seed} (--seed {seed} replays the moments); {layers} layers of {WIDTH}x{WIDTH},"
          f" {EPOCHS} epochs of {STEPS} steps, 2 workers", flush=True)
    with tempfile.TemporaryDirectory(prefix="tfdist-kill-soak-", dir=ROOT) as folder:
        straight = os.path.join(folder, "straight.json")
        subprocess.run(_command(straight, os.path.join(folder, "straight"), layers), cwd=ROOT,
                       env=_env(False), capture_output=True, check=True)
        alone = json.loads(Path(straight).read_text())
        kills, jobs, started = 0, 0, time.monotonic()
        while kills < args.kills:  # a job killed until it ends; another while kills remain
            jobs += 1
            model_dir, out = os.path.join(folder, f"m{jobs}"), os.path.join(folder, f"{jobs}.json")
            while kills < args.kills and (partial := run_or_kill(out, model_dir, layers, rng)):
                kills += 1
                state = check_state(model_dir)
                print(f"kill {kills} (job {jobs}): SIGKILL in {partial}; the state found: epoch "
                      f"{state['epoch'] + 1} step {state['step']}, complete and loadable",
                      flush=True)
            if not os.path.exists(out):
                run_or_kill(out, model_dir, layers, None)  # the last kill's job, to its end
            resumed = json.loads(Path(out).read_text())
            same = resumed["digest"] == alone["digest"]
            print(f"job {jobs} ended: its final weights and optimizer state "
                  f"{'bit-identical to' if same else 'DIFFER from'} the uninterrupted run's "
                  f"({resumed['digest']} against {alone['digest']})", flush=True)
            if not same:
                raise SystemExit(1)
        print(f"{kills} SIGKILLs during background writes, {jobs} job(s), "
              f"{time.monotonic() - started:.0f} s: every time a complete, loadable state, and "
              "every job's end bit-identical to the uninterrupted run", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
