"""Host buffers reused by the snapshots of successive asynchronous checkpoints, one per state file.

Responsibilities:

- hand each snapshot of a checkpoint the next buffer in order (:meth:`BufferPool.take`; :meth:`BufferPool.reset`
  when a checkpoint begins), so that a long training allocates its host memory once, not at every checkpoint;
- allocate them ahead, off the loop, in a background thread, when their sizes are known before the first
  checkpoint (:meth:`BufferPool.reserve`: sized from the checkpoint a run resumed from, or from
  ``run.prepare_checkpoint``), as pinned memory on the training's CUDA device when it uses one;
- stage sharded states (FSDP2, DTensor: :meth:`BufferPool.stage`) through one DCP ``DefaultStager`` kept for
  the whole run, whose host copies are cached by source storage and so reused by every later checkpoint;
  made ahead, off the loop, by :meth:`BufferPool.reserve` too. The copy runs in DCP's staging thread while
  the loop goes on; the guard (:func:`wait_for_staging`, run first by every optimizer ``step()`` while a copy
  is in flight) keeps the weights from changing under it.

The buffers themselves (:class:`~.tensorfile.HostBuffer`) are :mod:`.tensorfile`'s; torch is imported by the
first checkpoint, not by commands such as ``status``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Mapping

from ...base.waits import waiting_for

if TYPE_CHECKING:
    from .tensorfile import HostBuffer

log = logging.getLogger("gwenlake_hpc.checkpoints")

#: Host copies of sharded states still being made (by DCP's staging thread), oldest first.
_IN_FLIGHT: list[Future] = []
_GUARD: list[Any] = []  # the global optimizer pre-hook's handle, once registered


def wait_for_staging() -> None:
    """Block until every host copy of a sharded state started by :meth:`BufferPool.stage` is complete (what
    an optimizer's ``step()`` does first while one is in flight; call it before changing a sharded model's
    weights in place by other means). A failed copy is not raised here: its write raises it."""
    while _IN_FLIGHT:
        future = _IN_FLIGHT[0]
        try:
            future.exception()
        finally:
            if _IN_FLIGHT and _IN_FLIGHT[0] is future:
                _IN_FLIGHT.pop(0)


def _guard_optimizer_steps() -> None:
    """Make every optimizer's ``step()`` of this process wait for the host copies in flight (once)."""
    if not _GUARD:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GUARD.append(register_optimizer_step_pre_hook(lambda _opt, _args, _kwargs: wait_for_staging()))


class BufferPool:
    """Host buffers reused by the snapshots of successive asynchronous checkpoints (one per state file)."""

    def __init__(self) -> None:
        self.buffers: list[HostBuffer] = []
        self._next = 0
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None
        self._stager: Any = None  # DCP's DefaultStager of sharded states, made by the first stage

    def _sharded_stager(self) -> Any:
        if self._stager is None:
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Staged in DCP's staging thread (use_async_staging): the loop goes on at once and the next
            # optimizer step waits for the copy (see stage). Pinned memory and non-blocking copies on a
            # staging stream when the training uses CUDA.
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=cuda))
            _guard_optimizer_steps()
        return self._stager

    def stage(self, state: Mapping[str, Any]) -> Future:
        """Start a host copy of the sharded state dict ``state`` (DTensors keep their placements, each local
        shard copied; the other values deep-copied); returns the Future of the copy.

        The copy runs in DCP's staging thread while the loop goes on: the next ``step()`` of any optimizer of
        this process waits for it first (a global optimizer pre-hook), and so do :func:`wait_for_staging`,
        the next :meth:`stage` and the write. On CUDA the work already queued on the current stream is waited
        for first, so the copy reads the values of the step just done. The copies are cached by source
        storage: the next checkpoint of the same tensors copies into the same memory, allocating nothing.

        Raises (from the Future's ``result()``):
            RuntimeError, AssertionError: DCP's stager failed (out of host memory, an unsupported value).
        """
        self.wait_reserved()
        wait_for_staging()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the staging stream must see this step's results
        future = self._sharded_stager().stage(dict(state))
        _IN_FLIGHT.append(future)
        return future

    def close(self) -> None:
        """Free the sharded states' host copies (DCP's stager); the buffers go with the pool."""
        self.wait_reserved()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def reserve(self, sizes: list[int], pinned: bool, device: int | None = None,
                states: tuple[Mapping[str, Any], ...] = ()) -> None:
        """Allocate the host memory of the next checkpoint's snapshots in a background thread: buffer ``i`` holds
        at least ``sizes[i]`` bytes (pinned memory when ``pinned``, made on CUDA ``device``: the current device
        is a per-thread setting), and the host copies of the sharded state dicts ``states`` are made (their
        values are thrown away: the next :meth:`stage` copies the tensors again, into the same memory). The
        next :meth:`reset`, :meth:`take` or :meth:`stage` waits for it; a failure there is logged and the
        snapshot allocates as it would have."""
        self.wait_reserved()
        from .tensorfile import HostBuffer  # torch: loaded by the first checkpoint, not by `status`

        while len(self.buffers) < len(sizes):
            self.buffers.append(HostBuffer())
        targets = list(zip(self.buffers, sizes))
        # The staging thread makes the sharded states' host copies (their values are thrown away, so no
        # optimizer step waits for them); the next stage() is queued behind them there.
        for state in states:
            self._sharded_stager().stage(dict(state))

        def allocate() -> None:
            try:
                if device is not None:
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
            with waiting_for(thread):  # a hang's verdict names this thread, not the join
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
