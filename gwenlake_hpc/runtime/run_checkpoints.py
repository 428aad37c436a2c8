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
- retention (``keep=``), and with a node-local first level (``checkpoint.local_dir``) the hand-over of each
  sealed local checkpoint to the copier (:class:`~gwenlake_hpc.stores.checkpoints.levels.SharedCopier`), which
  copies it to the shared level and applies retention on both; the bounded wait for that copy at an eviction;
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
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from ..base.errors import CheckpointError, ConfigError
from ..stores.checkpoints import BackgroundWriter, BufferPool, Checkpoint, CheckpointStore, PendingCheckpoint
from ..stores.checkpoints import rank_state_name
from ..stores.checkpoints.levels import SharedCopier
from .distributed import Dist
from .heartbeat import CHECKPOINT, STEP
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
        copier: with a node-local first level, the copier to the shared level (then ``store`` is the local
            level's store); None: checkpoints are sealed on ``store``, the shared level, directly.

    Attributes:
        writer: the background writer (one write in flight).
        buffers: host buffers reused by asynchronous snapshots.
        latest: the newest sealed checkpoint of this process, or None (set by the background writer too).
        last_step: the step of the last ``run.checkpoint()`` block that completed, or None.
    """

    def __init__(self, store: CheckpointStore, dist: Dist, times: StepTimes, tracker: Any, scratch: Path,
                 latest: Checkpoint | None, copier: SharedCopier | None = None):
        self.store = store
        self.copier = copier
        #: ``time.monotonic()`` past which nothing waits for the copier any more (an eviction's grace); None: no bound
        self.copy_deadline: float | None = None
        self.dist = dist
        self.times = times
        self.tracker = tracker
        self.scratch = scratch
        self.latest: Checkpoint | None = latest
        self.last_step: int | None = None
        self.last_write_s: float | None = None  # the newest background write's seconds (job.eval_every=auto)
        self.writer = BackgroundWriter()
        self.buffers = BufferPool()
        self._in_block = False
        self._prepared: list[dict[str, Any]] = []  # parts given to run.prepare_checkpoint
        self._reserved = False
        self.heartbeat: Any = None  # the Run's (runtime.heartbeat.Heartbeat), marks the checkpoint blocks

    def prepare(self, parts: dict[str, Any], now: bool) -> None:
        """Record the parts of one state file (``run.prepare_checkpoint``); reserve now when ``now`` (the
        loop's first step is done), else at :meth:`reserve_ahead`."""
        self._prepared.append(parts)
        if now:
            self._reserved = False
            self.reserve_ahead()

    def reserve_ahead(self) -> None:
        """Allocate the host memory of the first asynchronous checkpoint in the background, once.

        Plain state files (rank 0 only: the other ranks' are discarded, never snapshotted): buffers sized by
        :func:`~gwenlake_hpc.stores.checkpoints.state.state_file_size` of the parts given to
        ``run.prepare_checkpoint``, else by the ``save_state`` files of the checkpoint this run resumed from.
        Sharded states (every rank): the host copies of each rank's shards of the parts given to
        ``run.prepare_checkpoint`` (DCP's stager, cached by source tensor). Nothing when neither is known or a
        checkpoint of this process already made its buffers. Pinned memory when the training uses CUDA
        (``torch.cuda.is_initialized()``), on its current device.
        """
        if self._reserved or self.last_step is not None or "torch" not in sys.modules:
            return
        self._reserved = True
        sizes: list[int] = []
        states: list[dict[str, Any]] = []
        if self._prepared:
            # torch: only trainings that use it get here
            from ..stores.checkpoints.state import sharded_staging_state, state_file_size

            for parts in self._prepared:
                staged = sharded_staging_state(**parts)
                if staged is not None:
                    states.append(staged)
                elif self.dist.is_main:
                    size = state_file_size(**parts)
                    sizes += [size] if size is not None else []
        elif self.latest is not None and self.dist.is_main:
            files = self.latest.manifest.get("files", {})
            sizes = [int(e["size"]) for name, e in sorted(files.items())
                     if "/" not in name and name.endswith(".safetensors") and e.get("verify") == "on_load"]
        if not sizes and not states:
            return
        import torch

        pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.buffers.reserve(sizes, pinned, torch.cuda.current_device() if pinned else None, tuple(states))

    def wait(self, raise_error: bool = True) -> Checkpoint | None:
        """Block until the checkpoint being written in the background (if any) is sealed; return
        :attr:`latest`. Raises CheckpointError as ``Run.wait_for_checkpoint``."""
        self.writer.wait(raise_error)
        copier = self.copier
        if copier is not None:
            left = None if self.copy_deadline is None else self.copy_deadline - time.monotonic()
            copier.wait(left)
            if raise_error:
                copier.raise_if_failed()
        return self.latest

    def where(self) -> str:
        """Which level the newest checkpoint is on, in words (for the log at the end of a start)."""
        ck, copier = self.latest, self.copier
        if ck is None:
            return "none"
        if copier is None:
            return str(ck.path)
        shared = copier.shared_step
        if shared is not None and shared >= ck.step:
            return f"step {ck.step} on both levels ({copier.shared.root / ck.path.name})"
        import socket

        return (f"step {ck.step} sealed on the node-local level ({socket.gethostname()}:{ck.path}); its copy to the "
                "shared level was not done within checkpoint.shared_wait_s (it goes on while this process ends), "
                f"so the shared level's newest may stay {'step ' + str(shared) if shared is not None else 'none'}: a "
                "start on this node resumes from the local one, a start on another node from the shared one")

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
        heartbeat = self.heartbeat
        if heartbeat is not None:
            heartbeat.phase(CHECKPOINT)  # the hang watchdog's longer bound holds while the block runs
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
            ended = time.perf_counter()
            self.times.checkpoint_s += ended - max(started, self.times.window_start)
            self.times.checkpoint_total_s += ended - started
            if heartbeat is not None:
                heartbeat.phase(STEP)

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
        job = self._sealer(pending, keep)
        if asynchronous:
            self.writer.submit(self._in_background(job, pending.step))
        else:
            job()

    def _sealer(self, pending: PendingCheckpoint, keep: int | None) -> Callable[[], Checkpoint]:
        """The sealing of ``pending`` (rank 0): the tracker's points made durable, the seal, retention."""
        make_durable = getattr(self.tracker, "make_durable", None) if self.dist.is_main else None

        def job() -> Checkpoint:
            if make_durable is not None:
                make_durable(timeout_s=5.0)
            copier = self.copier
            if copier is not None:
                copier.raise_if_failed()  # a failed copy stops the run as a failed write does
            ck = pending.seal()
            self.latest = ck
            if copier is not None:
                copier.submit(ck, keep)  # to the shared level; retention on both levels after the copy
            elif keep is not None:
                try:
                    self.store.retain(int(keep), newest=ck.step)
                except OSError as exc:  # the new checkpoint is sealed: an old one left behind is no failure
                    log.warning("checkpoint %s is sealed, but an older one could not be deleted (keep=%s): %s",
                                ck.path.name, keep, exc)
            return ck

        return job

    def _in_background(self, job: Callable[[], Checkpoint | None], step: int) -> Callable[[], Checkpoint | None]:
        """``job`` as the background writer runs it: a failed write is a CheckpointError naming the step, the
        error and the newest usable checkpoint."""
        previous = self.latest

        def background() -> Checkpoint | None:
            began = time.perf_counter()
            try:
                ck = job()
                self.last_write_s = time.perf_counter() - began
                return ck
            except OSError as exc:
                raise CheckpointError(
                    f"the checkpoint of step {step} could not be written: {exc} "
                    f"(errno {exc.errno}); the newest usable checkpoint is "
                    f"{previous.path if previous else 'none'}") from exc

        return background

    @contextlib.contextmanager
    def _checkpoint_multi(self, step: int, keep: int | None, asynchronous: bool, state: Callable[[], dict[str, Any]],
                          metrics: RunMetrics, log_breakdown: bool) -> Iterator[CheckpointWriter]:
        """The checkpoint protocol of a multi-task run (every rank enters it at the same step).

        Every rank waits for its previous background work; rank 0 opens the partial directory and tells the
        others its name; every rank writes its own state (RNG, data position) into it, the user's files of ranks
        other than 0 go to a discarded scratch folder, except the shards of a sharded ``save_state`` (FSDP2,
        DTensor), which every rank writes into rank 0's partial folder and reports (sizes, digests) to rank 0;
        once all ranks report success, rank 0 records the shards in the manifest and seals it. Asynchronous, a
        sharded state is only staged in the block; each rank's background writer then writes its shards, and
        the report, the seal and its outcome go over the writer's own process group (:meth:`_sharded_job`).
        A failure on any rank aborts the checkpoint on all of them; a failed background seal fails every rank
        at its next step.
        """
        dist, rank = self.dist, self.dist.rank
        pending = self._begin_multi(step, asynchronous)
        writer = CheckpointWriter(pending)
        error: BaseException | None = None
        try:
            yield writer
            if rank:
                full = state()
                mine = {k: full[k] for k in ("rng", "rng_epoch_start", "data_position", "step", "epoch")
                        if k in full}
                # Into rank 0's partial folder, which rank 0 seals once every rank reported: a plain write,
                # no fsync in the loop (rank 0's seal hashes and fsyncs it with the checkpoint's other files).
                target = pending.sharded_target(pending.dir / rank_state_name(rank))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(mine, sort_keys=True))
        except BaseException as exc:  # still take part in the vote, then re-raise
            error = exc
        # One vote: did a rank fail, how many sharded writes did each leave to the background writer, and did
        # every rank's sharded save_state calls go to the same paths with the same parts?
        deferred = pending.deferred if error is None else 0
        calls = "\n".join(pending.sharded_calls)
        sign = zlib.crc32(calls.encode())
        failed, most, least, high, low = dist.maxima([error is not None, deferred, -deferred, sign, -sign])
        if not failed and (most != -least or high != -low):
            what = (f"staged {deferred} sharded state(s)" if most != -least else
                    f"saved its sharded state(s) as {calls or 'nothing'}")
            other = (f"staged {most if deferred != most else -least}" if most != -least else "did otherwise")
            error = CheckpointError(
                f"rank {rank} {what} in the checkpoint of step {step}, another rank {other}: save_state of a "
                "sharded state is a collective, every rank calls it with the same path and parts")
            failed = True
        if failed:
            pending.abort()
            raise error if error is not None else CheckpointError(
                f"rank {rank}: the checkpoint of step {step} was not sealed (another rank failed in its "
                "`with run.checkpoint()` block; see its log)")
        if most:
            self._sharded_job(pending, step, keep, state, writer.metrics, metrics, log_breakdown)
        else:
            self._seal_multi(pending, step, keep, asynchronous, state, writer.metrics, metrics, log_breakdown)
        self.last_step = step

    def _begin_multi(self, step: int, asynchronous: bool) -> PendingCheckpoint:
        """Every rank waits for its background work in flight; rank 0 opens the partial directory, the others
        a scratch checkpoint that writes shards into it. Two collectives; raises on every rank when one failed.
        """
        dist, rank = self.dist, self.dist.rank
        error: BaseException | None = None
        pending = None
        try:
            self.writer.wait()  # at most one in flight; raises the previous one's error
            if dist.is_main:
                pending = self.store.begin(step, buffers=self.buffers if asynchronous else None)
        except BaseException as exc:  # tell the others before raising
            error = exc
        name = dist.broadcast(pending.dir.name if pending else None)
        if dist.any(error is not None or name is None):
            if pending is not None:
                pending.abort()
            if error is not None:
                raise error
            raise CheckpointError(f"rank {rank}: the checkpoint of step {step} could not start (another rank's "
                                  "previous checkpoint failed to write; see its log)")
        if pending is None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            pending = PendingCheckpoint(self.store, step, scratch=self.scratch, shared=self.store.root / name,
                                        buffers=self.buffers if asynchronous else None)
        return pending

    def _seal_multi(self, pending: PendingCheckpoint, step: int, keep: int | None, asynchronous: bool,
                    state: Callable[[], dict[str, Any]], block_metrics: dict[str, float], metrics: RunMetrics,
                    log_breakdown: bool) -> None:
        """A checkpoint with nothing left to write: rank 0 gathers the shards the ranks wrote in the block,
        seals (in the background when ``asynchronous``) and tells the others."""
        dist, rank = self.dist, self.dist.rank
        shards = dist.gather(pending.shards())
        sealed, error = None, None
        if not dist.is_main:
            pending.abort()  # the scratch folder: nothing in it is kept
        else:
            pending.metrics = {k: float(v) for k, v in block_metrics.items()}
            try:
                for r, files in enumerate(shards[1:], start=1):
                    pending.add_shards(files, r)
                pending.prepare(state())
                if block_metrics:
                    metrics.log(block_metrics, None, None, step)
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

    def _sharded_job(self, pending: PendingCheckpoint, step: int, keep: int | None,
                     state: Callable[[], dict[str, Any]], block_metrics: dict[str, float], metrics: RunMetrics,
                     log_breakdown: bool) -> None:
        """An asynchronous checkpoint whose sharded states were staged in the block: every rank's background
        writer writes its shards (DCP, over the writer's own gloo group), reports them to rank 0, which seals
        once every rank succeeded, and learns the outcome; the loop goes on meanwhile.

        A rank whose write fails, or that learns rank 0 could not seal, fails at its next step (every rank: the
        outcome is one broadcast). A kill of any rank before rank 0's rename leaves a partial directory,
        never a checkpoint that counts.
        """
        dist, rank = self.dist, self.dist.rank
        group = dist.background()  # made at the first such checkpoint, by every rank (a collective)
        pending.close()  # later save_state calls no longer land here
        seal = None
        if dist.is_main:
            pending.metrics = {k: float(v) for k, v in block_metrics.items()}
            pending.prepare(state())
            if block_metrics:
                metrics.log(block_metrics, None, None, step)
            if log_breakdown:  # with the points the seal makes durable (see _seal)
                metrics.log_times(step, during_step=True)
            seal = self._sealer(pending, keep)

        def job() -> Checkpoint | None:
            error: BaseException | None = None
            try:
                pending.wait_staged()
            except BaseException as exc:  # a failed copy: no rank enters DCP's collectives
                error = exc
            if not group.any(error is not None):
                try:
                    pending.write_deferred(group.group)  # DCP's collectives; its errors reach every rank
                except BaseException as exc:  # still take part in the report, then raise
                    error = exc
            failed = group.any(error is not None)
            shards = None if failed else group.gather(pending.shards())
            sealed = None
            if seal is not None and not failed:
                try:
                    for r, files in enumerate(shards[1:], start=1):
                        pending.add_shards(files, r)
                    sealed = seal().path.name
                except BaseException as exc:
                    error = exc
            name = group.broadcast(sealed)
            if name is None or not dist.is_main:
                pending.abort()  # rank 0's partial directory (not sealed), or a scratch folder
            if error is not None:
                raise error
            if name is None:
                raise CheckpointError(f"rank {rank}: the checkpoint of step {step} was not sealed (another rank "
                                      "failed writing its part; see its log)")
            if not dist.is_main:
                self.latest = self.store.open(name)
            return self.latest

        self.writer.submit(self._in_background(job, step))
