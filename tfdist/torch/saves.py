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
:func:`write_atomically` into a page-aligned :class:`Memory` kept from save to save, without the
zip records' checksums (torch's CRC-32 took 0.68 s of the 0.75 s of processor time a 300 MB save
cost, on processors the training shares), then to the disk with direct I/O. The step waits for
the copy (0.065 s for 1.1 GB here, benchmarks/torch_saves.py; a run's first save allocates the
host copy), and for the previous write only when the disk is slower than the saves.
:meth:`BackgroundSaves.wait` waits for the write in flight and raises its error:
``dist.exit_preempted`` and the end of ``tfdist.torch.distributed()`` call it, so the final save
at a signal, at the walltime or at the end is on the disk before the process exits.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from typing import Any

import torch

from tfdist import background, walltime
from tfdist.keras import snapshot

__all__ = ["BackgroundSaves", "Memory", "host_copy", "write_atomically"]


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


def write_atomically(obj: Any, target: str, *, checksum: bool = True,
                     memory: Memory | None = None) -> None:
    """``torch.save(obj)`` to ``target``: a temporary file beside it, fsynced, renamed over it,
    the folder fsynced. The target is the whole new file or the previous one. Without
    ``checksum`` the zip records' CRC-32 is not computed (where torch has the setting): most of
    the processor time of a save (0.68 s of 0.75 s for 300 MB here); the file loads the same.
    With ``memory`` the file is made there first and written with direct I/O where the file
    system takes it (:func:`tfdist.keras.snapshot.write_bytes`): 0.03 s of processor time for
    1.1 GB where the page cache took seconds of the processors the training shares."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    # Beside the target, so the rename is atomic; open() keeps the umask's permissions.
    temporary = os.path.join(folder, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with _checksums(checksum):
            if memory is None:
                with open(temporary, "wb") as file:
                    torch.save(obj, file)
                    _durable(file)
            else:
                memory.rewind()
                torch.save(obj, memory)  # type: ignore[arg-type]  # a binary file
                snapshot.write_bytes(temporary, memory.aligned())
                os.truncate(temporary, memory.size)  # the direct write's whole pages, cut
                with open(temporary, "rb+") as file:
                    _durable(file)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    background.fsync_dir(folder)


class Memory(io.RawIOBase):
    """A file in one page-aligned buffer of host memory (:func:`tfdist.keras.snapshot.host_buffer`,
    its pages populated by the kernel), kept from save to save: ``torch.save`` writes into it,
    then the buffer goes to the disk whole."""

    def __init__(self, size: int = snapshot.ALIGN) -> None:
        super().__init__()
        self.buffer = snapshot.host_buffer(size)
        self.size = 0

    def rewind(self) -> None:
        self.size = 0

    def reserve(self, size: int) -> None:
        """Room for ``size`` bytes before a save (one buffer, not one grown by doubling)."""
        if size > len(self.buffer):
            self._grow(size)

    def _grow(self, size: int) -> None:
        bigger = snapshot.host_buffer(-(-size // snapshot.ALIGN) * snapshot.ALIGN)
        bigger[:self.size] = self.buffer[:self.size]
        self.buffer.close()
        self.buffer = bigger

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        end = self.size + len(view)
        if end > len(self.buffer):
            self._grow(max(2 * len(self.buffer), end))
        self.buffer[self.size:end] = view
        self.size = end
        return len(view)

    def tell(self) -> int:
        return self.size

    def aligned(self) -> memoryview:
        """The file's bytes, to the next page boundary (what direct I/O writes)."""
        return memoryview(self.buffer)[:-(-self.size // snapshot.ALIGN) * snapshot.ALIGN]


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
        self._memory: Memory | None = None

    def save(self, obj: Any, target: str) -> float:
        """Copies ``obj``'s tensors to host memory and writes it to ``target`` in the
        background; the seconds the step waited for the previous write."""
        waited = self.writer.wait()  # the host tensors are free again; a failed write raises
        copied, self._buffers = host_copy(obj, self._buffers)
        tensors = sum(t.numel() * t.element_size() for t in self._buffers.values())

        def job() -> None:
            started = time.monotonic()
            if self._memory is None:
                self._memory = Memory()
            self._memory.reserve(tensors + (4 << 20))  # the tensors and the zip's own records
            write_atomically(copied, target, checksum=False, memory=self._memory)
            walltime.record_save(time.monotonic() - started)  # the margin follows the saves

        self.writer.submit(job)
        return waited

    def wait(self) -> None:
        """Waits for the write in flight; raises its error."""
        self.writer.wait()
