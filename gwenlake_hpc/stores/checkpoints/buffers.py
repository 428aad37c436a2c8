"""Host buffers reused by the snapshots of successive asynchronous checkpoints, one per state file.

Responsibilities:

- hand each snapshot of a checkpoint the next buffer in order (:meth:`BufferPool.take`; :meth:`BufferPool.reset`
  when a checkpoint begins), so that a long training allocates its host memory once, not at every checkpoint;
- allocate them ahead, off the loop, in a background thread, when their sizes are known before the first
  checkpoint (:meth:`BufferPool.reserve`: sized from the checkpoint a run resumed from, or from
  ``run.prepare_checkpoint``), as pinned memory on the training's CUDA device when it uses one.

The buffers themselves (:class:`~.tensorfile.HostBuffer`) are :mod:`.tensorfile`'s; torch is imported by the
first checkpoint, not by commands such as ``status``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tensorfile import HostBuffer

log = logging.getLogger("gwenlake_hpc.checkpoints")


class BufferPool:
    """Host buffers reused by the snapshots of successive asynchronous checkpoints (one per state file)."""

    def __init__(self) -> None:
        self.buffers: list[HostBuffer] = []
        self._next = 0
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    def reserve(self, sizes: list[int], pinned: bool, device: int | None = None) -> None:
        """Allocate the buffers of the next checkpoint's snapshots in a background thread: buffer ``i`` holds at
        least ``sizes[i]`` bytes (pinned memory when ``pinned``, made on CUDA ``device``: the current device is
        a per-thread setting). The next :meth:`reset` or :meth:`take` waits for it; a failure there is logged
        and the snapshot allocates as it would have."""
        self.wait_reserved()
        from .tensorfile import HostBuffer  # torch: loaded by the first checkpoint, not by `status`

        while len(self.buffers) < len(sizes):
            self.buffers.append(HostBuffer())
        targets = list(zip(self.buffers, sizes))

        def allocate() -> None:
            try:
                if pinned and device is not None:
                    import torch

                    torch.cuda.set_device(device)
                for buf, size in targets:
                    buf.reserve(int(size), pinned)
            except BaseException as exc:  # noqa: BLE001 - reported by wait_reserved, in the caller's thread
                self._reserve_error = exc

        self._reserving = threading.Thread(target=allocate, name="gwenlake-host-buffers", daemon=True)
        self._reserving.start()

    def wait_reserved(self) -> None:
        """Wait for a :meth:`reserve` in progress (nothing when none)."""
        thread, self._reserving = self._reserving, None
        if thread is not None:
            thread.join()
        if self._reserve_error is not None:
            log.warning("host buffers for asynchronous checkpoints could not be allocated ahead: %s; the next "
                        "checkpoint allocates them", self._reserve_error)
            self._reserve_error = None

    def reset(self) -> None:
        """A new checkpoint starts: its snapshots reuse the buffers in order."""
        self.wait_reserved()
        self._next = 0

    def take(self) -> HostBuffer:
        self.wait_reserved()
        if self._next == len(self.buffers):
            from .tensorfile import HostBuffer  # torch: loaded by the first checkpoint, not by `status`

            self.buffers.append(HostBuffer())
        self._next += 1
        return self.buffers[self._next - 1]
