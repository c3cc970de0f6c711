"""What do safety saves cost? The example's training with and without TFDIST_CHECKPOINT_EVERY.

    .venv/bin/python benchmarks/safety_saves.py [--rounds 5] [--epochs 6] [--every 2s]

Both variants run examples/keras_train.py on 2 workers under `tfdist launch` with a model_dir
(so both have the epoch backups and the once-a-second preemption agreement); ``on`` adds
``TFDIST_CHECKPOINT_EVERY``, a save of the exact state at an agreed step that often and at each
epoch's end. Runs alternate (off, on, off, ...) so that machine noise hits both alike. Per run:
the wall time of epochs 2.. (from the meter's ``throughput.jsonl``: the first epoch traces), the
safety saves made and how long each took (the chief's log line). Prints each round, then the
median ratio on/off of the epochs' time with its spread, and the median time of one save.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAVE_LINE = re.compile(r"tfdist: safety save after step \d+ of epoch \d+.* \((\d+\.\d+) s;")


def run_once(every: str | None, epochs: int, data_dir: str) -> tuple[float, list[float]]:
    """One run: the seconds of epochs 2.., and the seconds of each safety save."""
    with tempfile.TemporaryDirectory(prefix="tfdist-safety-") as model_dir:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.pop("TFDIST_CHECKPOINT_EVERY", None)
        if every:
            env["TFDIST_CHECKPOINT_EVERY"] = every
        cmd = [sys.executable, "-m", "tfdist", "launch", "-n", "2",
               str(ROOT / "examples" / "keras_train.py"), f"--epochs={epochs}",
               "--batch_size=64", f"--model_dir={model_dir}", f"--data_dir={data_dir}"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode:
            raise SystemExit(f"the run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        records = [json.loads(line) for line in
                   Path(model_dir, "throughput.jsonl").read_text().splitlines()]
    seconds = sum(r["epoch_s"] for r in records if r.get("event") == "epoch" and r["epoch"] > 0)
    saves = [float(s) for s in SAVE_LINE.findall(done.stdout + done.stderr)]
    return seconds, saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--every", default="2s", help="TFDIST_CHECKPOINT_EVERY of the `on` runs")
    parser.add_argument("--data_dir", default=str(ROOT / ".cache" / "tensorflow_datasets"))
    args = parser.parse_args()
    ratios, all_saves = [], []
    for round_ in range(1, args.rounds + 1):
        off, _ = run_once(None, args.epochs, args.data_dir)
        on, saves = run_once(args.every, args.epochs, args.data_dir)
        ratios.append(on / off)
        all_saves += saves
        print(f"round {round_}: epochs 2-{args.epochs}: off {off:.2f} s, on {on:.2f} s "
              f"(ratio {on / off:.3f}), {len(saves)} safety saves, median "
              f"{statistics.median(saves) if saves else float('nan'):.3f} s", flush=True)
    print(f"safety saves every {args.every}: time of epochs 2-{args.epochs} on/off, median "
          f"{statistics.median(ratios):.3f} (spread {min(ratios):.3f}-{max(ratios):.3f}); "
          f"one save: median {statistics.median(all_saves) if all_saves else float('nan'):.3f} "
          f"s over {len(all_saves)}")


if __name__ == "__main__":
    main()
