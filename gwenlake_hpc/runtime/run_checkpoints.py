"""The Run's checkpoints: what ``with run.checkpoint() as ck`` does, writing one atomically, in the background by
default.

:class:`RunCheckpoints` is an object the Run builds in its ``__init__`` and delegates ``run.checkpoint()`` and
``run.wait_for_checkpoint()`` to (the loop is in :mod:`gwenlake_hpc.runtime.run`, metrics in
:mod:`gwenlake_hpc.runtime.run_metrics`). The files and their sealing are the checkpoint store's
(:mod:`gwenlake_hpc.stores.checkpoints`). It owns:

- the background writer (at most one checkpoint in flight; a failed write fails the run at the next step)
  and the reused host buffers of asynchronous snapshots, allocated in the background after the loop's first
  step when their sizes are known (``run.prepare_checkpoint``, or the checkpoint resumed from);
- the Run's own state in each checkpoint (step, data position, RNG: ``run.state_dict()``, asked for when the
  block ends);
- the order "points durable, then seal" (the tracker's ``make_durable``), and the step's time breakdown logged
  before the seal;
- retention (``keep=``);
- the step of the last checkpoint and the newest sealed one (``run.latest_checkpoint``);
- the time spent in checkpoint blocks, added to the Run's :class:`~.timing.StepTimes`;
- the protocol of a multi-task run (rank 0 writes and seals, the others add their own state).

It holds neither the Run nor its metrics: the Run's state and metrics are arguments of each block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..base.errors import CheckpointError, ConfigError
from ..base.fsutil import write_atomic
from ..stores.checkpoints import BackgroundWriter, BufferPool, Checkpoint, CheckpointStore, PendingCheckpoint
from ..stores.checkpoints import rank_state_name
from .distributed import Dist
from .run_metrics import RunMetrics
from .timing import StepTimes

log = logging.getLogger("gwenlake_hpc.run")


class CheckpointWriter:
    """What ``with run.checkpoint() as ck`` gives: a place for files and for metrics.

    Attributes:
        step: the step being checkpointed (steps completed).
        dir: the (temporary) directory the files go to until the block ends.
        metrics: set it to a dict of floats (e.g. ``{"test_auc": 0.84}``): stored in the manifest and logged
            to tracking at this step.
    """

    def __init__(self, pending: PendingCheckpoint):
        self._pending = pending
        self.step = pending.step
        self.dir = pending.dir
        self.metrics: dict[str, float] = {}

    def path(self, name: str) -> Path:
        """Path for file ``name`` in the checkpoint; see :meth:`PendingCheckpoint.path`.

        On ranks other than 0 of a multi-task run the path is in a scratch folder of that rank that is
        discarded (``save_state`` writes nothing there): rank 0's files are the checkpoint (the model and
        optimizer state are the same on every rank); each rank's own RNG and data position are saved in it
        by the Run. A sharded state (FSDP2, DTensor) is the exception: ``save_state`` of it on every rank
        writes each rank's shards at the same path of rank 0's checkpoint, one DCP folder.
        """
        return self._pending.path(name)


class RunCheckpoints:
    """The checkpoints of one Run (see the module's docstring for what it owns).

    Args:
        store: the run's checkpoint store (``<run dir>/checkpoints``).
        dist: this process's place in a multi-task run.
        times: the Run's time accumulators; checkpoint blocks add their seconds to ``checkpoint_s``.
        tracker: the run's tracker; its ``make_durable(timeout_s=)`` (if any) runs before each seal on rank 0.
        scratch: where a rank other than 0 puts its (discarded) checkpoint files.
        latest: the checkpoint the Run resumed from, or None.

    Attributes:
        writer: the background writer (one write in flight).
        buffers: host buffers reused by asynchronous snapshots.
        latest: the newest sealed checkpoint of this process, or None (set by the background writer too).
        last_step: the step of the last ``run.checkpoint()`` block that completed, or None.
    """

    def __init__(self, store: CheckpointStore, dist: Dist, times: StepTimes, tracker: Any, scratch: Path,
                 latest: Checkpoint | None):
        self.store = store
        self.dist = dist
        self.times = times
        self.tracker = tracker
        self.scratch = scratch
        self.latest: Checkpoint | None = latest
        self.last_step: int | None = None
        self.writer = BackgroundWriter()
        self.buffers = BufferPool()
        self._in_block = False
        self._prepared: list[dict[str, Any]] = []  # parts given to run.prepare_checkpoint
        self._reserved = False

    def prepare(self, parts: dict[str, Any], now: bool) -> None:
        """Record the parts of one state file (``run.prepare_checkpoint``); reserve now when ``now`` (the
        loop's first step is done), else at :meth:`reserve_ahead`."""
        self._prepared.append(parts)
        if now:
            self._reserved = False
            self.reserve_ahead()

    def reserve_ahead(self) -> None:
        """Allocate the host buffers of the first asynchronous checkpoint in the background, once (rank 0: the
        other ranks' plain state files are discarded, never snapshotted).

        Sized by :func:`~gwenlake_hpc.stores.checkpoints.state.state_file_size` of the parts given to
        ``run.prepare_checkpoint``, else by the ``save_state`` files of the checkpoint this run resumed from;
        nothing when neither is known or a checkpoint of this process already made its buffers. Pinned memory
        when the training uses CUDA (``torch.cuda.is_initialized()``), on its current device.
        """
        if self._reserved or not self.dist.is_main or self.last_step is not None or "torch" not in sys.modules:
            return
        self._reserved = True
        if self._prepared:
            from ..stores.checkpoints.state import state_file_size  # torch: only trainings that use it get here

            sizes = [n for n in (state_file_size(**p) for p in self._prepared) if n is not None]
        elif self.latest is not None:
            files = self.latest.manifest.get("files", {})
            sizes = [int(e["size"]) for name, e in sorted(files.items())
                     if "/" not in name and name.endswith(".safetensors") and e.get("verify") == "on_load"]
        else:
            sizes = []
        if not sizes:
            return
        import torch

        pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.buffers.reserve(sizes, pinned, torch.cuda.current_device() if pinned else None)

    def wait(self, raise_error: bool = True) -> Checkpoint | None:
        """Block until the checkpoint being written in the background (if any) is sealed; return
        :attr:`latest`. Raises CheckpointError as ``Run.wait_for_checkpoint``."""
        self.writer.wait(raise_error)
        return self.latest

    @contextlib.contextmanager
    def checkpoint(self, step: int, keep: int | None, asynchronous: bool, state: Callable[[], dict[str, Any]],
                   metrics: RunMetrics, log_breakdown: bool) -> Iterator[CheckpointWriter]:
        """The block of ``run.checkpoint()`` at ``step`` (see there).

        Args:
            step: the Run's current step (steps completed).
            keep: how many complete checkpoints to keep (None: all).
            asynchronous: write and seal in the background.
            state: gives the Run's own state (``run.state_dict``) when the block ends.
            metrics: the Run's metrics: the block's ``ck.metrics`` are logged through them, and the step's
                breakdown before the seal (an argument, not a field: the metrics hold :meth:`wait`, and a
                cycle between the two would keep the host buffers alive after the Run until a GC pass).
            log_breakdown: log the step's time breakdown before the seal (an evaluation step of the loop).

        Raises:
            ConfigError: ``keep`` < 1, a nested block, or a second block at the same step.
            CheckpointError: the previous background write failed (path and errno in the message).
        """
        if keep is not None and int(keep) < 1:
            raise ConfigError(f"run.checkpoint(keep={keep}): keep must be at least 1 (or None to keep all)")
        if self._in_block:
            raise ConfigError("run.checkpoint() blocks cannot be nested: write every file of the step in one block")
        if self.last_step == step:
            raise ConfigError(f"run.checkpoint() was already called at step {step}: one checkpoint a step "
                              "(write every file of the step in one block)")
        self._in_block = True
        started = self.times.block_start = time.perf_counter()
        try:
            # The block's own code (the user's save_state calls, an evaluation) counts as checkpoint time too:
            # what the loop is blocked by.
            if self.dist.enabled:
                with self._checkpoint_multi(step, keep, asynchronous, state, metrics, log_breakdown) as writer:
                    yield writer
            else:
                yield from self._checkpoint(step, keep, asynchronous, state, metrics, log_breakdown)
        finally:
            self._in_block = False
            self.times.checkpoint_s += time.perf_counter() - max(started, self.times.window_start)

    def _checkpoint(self, step: int, keep: int | None, asynchronous: bool, state: Callable[[], dict[str, Any]],
                    metrics: RunMetrics, log_breakdown: bool) -> Iterator[CheckpointWriter]:
        self.writer.wait()  # at most one in flight; raises the previous one's error
        pending = self.store.begin(step, buffers=self.buffers if asynchronous else None)
        writer = CheckpointWriter(pending)
        try:
            yield writer
            pending.metrics = {k: float(v) for k, v in writer.metrics.items()}
            pending.prepare(state())
        except BaseException:
            pending.abort()
            raise
        if writer.metrics:
            metrics.log(writer.metrics, None, None, step)
        self._seal(pending, keep, asynchronous, metrics if log_breakdown else None)
        self.last_step = step

    def _seal(self, pending: PendingCheckpoint, keep: int | None, asynchronous: bool,
              breakdown: RunMetrics | None) -> None:
        """Make the points logged so far durable, seal ``pending`` and apply retention: in the background
        writer, or here when synchronous. ``breakdown``: the metrics that log the step's time breakdown first.

        The points come first: a checkpoint sealed before the points it covers are on disk would let a
        SIGKILL lose them for good (the resumed run does not replay steps at or before its checkpoint).
        """
        if breakdown is not None:
            # This step's breakdown goes with the points the seal makes durable: logged after the seal, a kill
            # could lose it for good (the resumed run starts after this step).
            breakdown.log_times(pending.step, during_step=True)
        make_durable = getattr(self.tracker, "make_durable", None) if self.dist.is_main else None

        def job() -> Checkpoint:
            if make_durable is not None:
                make_durable(timeout_s=5.0)
            ck = pending.seal()
            self.latest = ck
            if keep is not None:
                try:
                    self.store.retain(int(keep), newest=ck.step)
                except OSError as exc:  # the new checkpoint is sealed: an old one left behind is no failure
                    log.warning("checkpoint %s is sealed, but an older one could not be deleted (keep=%s): %s",
                                ck.path.name, keep, exc)
            return ck

        if asynchronous:
            step = pending.step
            previous = self.latest

            def background() -> Checkpoint:
                try:
                    return job()
                except OSError as exc:
                    raise CheckpointError(
                        f"the checkpoint of step {step} could not be written: {exc} "
                        f"(errno {exc.errno}); the newest usable checkpoint is "
                        f"{previous.path if previous else 'none'}") from exc

            self.writer.submit(background)
        else:
            job()

    @contextlib.contextmanager
    def _checkpoint_multi(self, step: int, keep: int | None, asynchronous: bool, state: Callable[[], dict[str, Any]],
                          metrics: RunMetrics, log_breakdown: bool) -> Iterator[CheckpointWriter]:
        """The checkpoint protocol of a multi-task run (every rank enters it at the same step).

        Rank 0 waits for its previous background seal, opens the partial directory and tells the others its
        name; every rank writes its own state (RNG, data position) into it, the user's files of ranks other
        than 0 go to a discarded scratch folder, except the shards of a sharded ``save_state`` (FSDP2,
        DTensor), which every rank writes into rank 0's partial folder and reports (sizes, digests) to rank 0;
        once all ranks report success, rank 0 records the shards in the manifest, seals it (in the
        background when asynchronous) and tells the others. A failure on any rank aborts the checkpoint on all
        of them; a failed background seal of rank 0 fails every rank at the next checkpoint.
        """
        dist, rank = self.dist, self.dist.rank
        error: BaseException | None = None
        pending = None
        if dist.is_main:
            try:
                self.writer.wait()
                pending = self.store.begin(step, buffers=self.buffers if asynchronous else None)
            except BaseException as exc:  # tell the others before raising
                error = exc
        name = dist.broadcast(pending.dir.name if pending else None)
        if error is not None:
            raise error
        if name is None:
            raise CheckpointError(f"rank {rank}: rank 0 could not start the checkpoint of step {step} "
                                  "(its previous checkpoint failed to write; see its log)")
        partial = self.store.root / name
        if pending is None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            pending = PendingCheckpoint(self.store, step, scratch=self.scratch, shared=partial)
        writer = CheckpointWriter(pending)
        try:
            yield writer
            if rank:
                full = state()
                mine = {k: full[k] for k in ("rng", "rng_epoch_start", "data_position", "step", "epoch")
                        if k in full}
                # Into rank 0's partial folder, which rank 0 seals (manifest, rename) once every rank reported.
                write_atomic(partial / rank_state_name(rank), json.dumps(mine, sort_keys=True))
        except BaseException as exc:  # still take part in the vote, then re-raise
            error = exc
        failed = dist.any(error is not None)
        # Each rank's sharded files (written, fsynced and hashed by save_state), for rank 0's manifest.
        shards = None if failed else dist.gather(pending.shards())
        sealed = None
        if not dist.is_main:
            pending.abort()  # the scratch folder: nothing in it is kept
        else:
            if failed:
                pending.abort()
            else:
                pending.metrics = {k: float(v) for k, v in writer.metrics.items()}
                try:
                    for r, files in enumerate(shards[1:], start=1):
                        pending.add_shards(files, r)
                    pending.prepare(state())
                    if writer.metrics:
                        metrics.log(writer.metrics, None, None, step)
                    self._seal(pending, keep, asynchronous, metrics if log_breakdown else None)
                    sealed = f"step-{step:09d}"
                except BaseException as exc:
                    pending.abort()
                    error = exc
        name = dist.broadcast(sealed)
        if error is not None:
            raise error
        if name is None:
            raise CheckpointError(f"rank {rank}: the checkpoint of step {step} was not sealed "
                                  "(another rank failed writing its part; see its log)")
        if not dist.is_main and not asynchronous:
            self.latest = self.store.open(name)
        self.last_step = step
