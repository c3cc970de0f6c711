"""Where the ranks that do not write put what they must write anyway.

Under MultiWorkerMirroredStrategy every worker runs a save (it may run collectives), but only the
chief's copy is kept: the others write into a private scratch folder that is thrown away.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

__all__ = ["remove_scratch_dirs", "scratch_dir"]

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
