"""Runs in each task of an srun step: who TensorFlow's stock resolver and tfdist say it is.

Prints one line, ``probe: {JSON}``, with this task's real host and SLURM_PROCID, tfdist's
detection (``python -m tfdist env --json``, run first: the stock resolver overwrites
CUDA_VISIBLE_DEVICES) and the stock ``tf.distribute.cluster_resolver.SlurmClusterResolver``'s
answer: its worker list and the address it gives this task, or the error it raises. No server
is started, so a wrong answer shows here instead of as a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def main() -> None:
    record: dict[str, object] = {
        "host": socket.gethostname(), "procid": int(os.environ["SLURM_PROCID"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-m", "tfdist", "env", "--json"], capture_output=True,
                         text=True, timeout=60, check=False)
    record["tfdist"] = (json.loads(out.stdout) if out.returncode == 0
                        else {"error": out.stderr[-2000:]})
    import tensorflow as tf

    try:
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        workers = resolver.cluster_spec().as_dict()["worker"]
        record["stock"] = {"task_type": resolver.task_type, "task_id": resolver.task_id,
                           "workers": workers, "address": workers[resolver.task_id]}
    except Exception as err:  # the defects under test raise ValueError, RuntimeError...
        record["stock"] = {"error": f"{type(err).__name__}: {err}"}
    print("probe:", json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
