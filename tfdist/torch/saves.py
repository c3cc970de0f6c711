"""The torch shim's ``dist.save``, atomic, and in the background where asked.

:func:`write_atomically` is what every save does on the chief: ``torch.save`` into a temporary
file beside the target, flushed to the disk (fsync), renamed over the target, and the folder
flushed, so the file is the whole new state or the whole previous one, at any moment a kill
comes (a rename is atomic; without the fsyncs a node that fails after the rename can leave an
empty file under the new name).

:class:`BackgroundSaves` (``TFDIST_BACKGROUND_SAVES=1``, or ``dist.save(..., background=True)``)
splits it in two: on the training thread, a copy of the state's tensors in host memory
(:func:`host_copy`: into the same host tensors at every save of the same shapes, so the pages
are not faulted in again, pinned where CUDA is there); on the writer thread
(:class:`tfdist.background.Writer`, one save in flight, below the training threads' priority),
:func:`write_atomically`, without the zip records' checksums (torch's CRC-32 took 0.68 s of the
0.75 s of processor time a 300 MB save cost, on processors the training shares). The step waits
for the copy, and for the previous write only when the
disk is slower than the saves. :meth:`BackgroundSaves.wait` waits for the write in flight and
raises its error: ``dist.exit_preempted`` and the end of ``tfdist.torch.distributed()`` call
it, so the final save at a signal, at the walltime or at the end is on the disk before the
process exits.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import torch

from tfdist import background, walltime

__all__ = ["BackgroundSaves", "host_copy", "write_atomically"]


def host_copy(obj: Any, reuse: dict[tuple[Any, ...], torch.Tensor] | None = None,
              where: tuple[Any, ...] = ()) -> tuple[Any, dict[tuple[Any, ...], torch.Tensor]]:
    """``obj`` (tensors in dicts, lists and tuples; anything else kept as it is) with every
    tensor copied to host memory, and those host tensors by their place in ``obj``: the next
    copy of a state of the same shapes (``reuse``) copies into them instead of new memory."""
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    reuse = reuse or {}

    def copy(value: Any, place: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            found = reuse.get(place)
            source = value.detach()
            if (found is None or found.shape != source.shape or found.dtype != source.dtype
                    or found.layout != source.layout or not source.is_contiguous()):
                found = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                    pin_memory=source.is_cuda)
            found.copy_(source, non_blocking=source.is_cuda)
            made[place] = found
            return found
        if isinstance(value, dict):
            return type(value)((k, copy(v, (*place, k))) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            items = [copy(v, (*place, i)) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    copied = copy(obj, where)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return copied, made


def write_atomically(obj: Any, target: str, *, checksum: bool = True) -> None:
    """``torch.save(obj)`` to ``target``: a temporary file beside it, fsynced, renamed over it,
    the folder fsynced. The target is the whole new file or the previous one. Without
    ``checksum`` the zip records' CRC-32 is not computed (where torch has the setting): most of
    the processor time of a save (0.68 s of 0.75 s for 300 MB here); the file loads the same."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    # Beside the target, so the rename is atomic; open() keeps the umask's permissions.
    temporary = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file, _checksums(checksum):
            torch.save(obj, file)
            _durable(file)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    background.fsync_dir(folder)


_setting = threading.Lock()


@contextlib.contextmanager
def _checksums(on: bool) -> Any:
    """torch's ``compute_crc32`` setting set to ``on`` while a save runs (it is the process's:
    a ``torch.save`` another thread starts meanwhile is written without the checksum too)."""
    settings: Any = None
    with contextlib.suppress(ImportError):  # a torch without the setting: as it is
        from torch.utils.serialization import config as settings
    config = getattr(settings, "save", None)
    if on or config is None or not hasattr(config, "compute_crc32"):
        yield
        return
    with _setting:
        before = config.compute_crc32
        config.compute_crc32 = False
        try:
            yield
        finally:
            config.compute_crc32 = before


def _durable(file: Any) -> None:
    """Flushes ``file`` to the disk: the rename after it must not make an empty file the state."""
    file.flush()
    os.fsync(file.fileno())


class BackgroundSaves:
    """The chief's saves written on its writer thread, one in flight (see the module)."""

    def __init__(self) -> None:
        self.writer = background.Writer()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def save(self, obj: Any, target: str) -> float:
        """Copies ``obj``'s tensors to host memory and writes it to ``target`` in the
        background; the seconds the step waited for the previous write."""
        waited = self.writer.wait()  # the host tensors are free again; a failed write raises
        copied, self._buffers = host_copy(obj, self._buffers)

        def job() -> None:
            started = time.monotonic()
            write_atomically(copied, target, checksum=False)
            walltime.record_save(time.monotonic() - started)  # the margin follows the saves

        self.writer.submit(job)
        return waited

    def wait(self) -> None:
        """Waits for the write in flight; raises its error."""
        self.writer.wait()
