"""The Run's checkpoints: ``with run.checkpoint() as ck`` writes one atomically, in the background by default.

A mixin of :class:`gwenlake_hpc.runtime.run.Run` (its other halves: the loop in :mod:`gwenlake_hpc.runtime.run`, metrics in
:mod:`gwenlake_hpc.runtime.run_metrics`). The files and their sealing are the checkpoint store's
(:mod:`gwenlake_hpc.stores.checkpoints`); this module adds the Run's own state to each checkpoint (step, data
position, RNG), the order "points durable, then seal", retention, one checkpoint in flight, and the protocol
of a multi-task run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from ..stores.checkpoints import Checkpoint, PendingCheckpoint, rank_state_name
from ..base.errors import CheckpointError, ConfigError
from .rng import rng_state

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
        by the Run.
        """
        return self._pending.path(name)


class RunCheckpoints:
    """Checkpoints of a :class:`gwenlake_hpc.runtime.run.Run` (mixed into it; not used on its own)."""

    latest_checkpoint: Checkpoint | None
    step: int
    at_eval: bool
    _times: dict[str, float]
    _window_start: float
    _t_block: float
    _epoch_rng: dict[str, Any] | None

    def state_dict(self) -> dict[str, Any]:
        """The Run's own state saved in every checkpoint (``rng_epoch_start`` only over a plain iterable)."""
        state = {
            "run_key": self.run_key,
            "step": self.step,
            "epoch": self.epoch,
            "data_position": {"epoch": self.epoch, "next_global_batch": self.step, "rank": self.rank,
                              "world_size": self.world_size},
            "seed": self.seed,
            "world_size": self.world_size,
            "total_steps": self.total_steps,
            "rng": rng_state(),
            "tracking_run_id": getattr(self.tracker, "run_id", None),
            "time": time.time(),
        }
        if self._epoch_rng is not None:  # the RNG states the current pass began with: see Run._batch_stream
            state["rng_epoch_start"] = self._epoch_rng
        return state

    def wait_for_checkpoint(self, raise_error: bool = True) -> Checkpoint | None:
        """Block until the checkpoint being written in the background (if any) is sealed.

        Called by the Run at the end of the loop (so an evicted run exits only once its final checkpoint is
        sealed), by :meth:`summary` and by the job before it commits the model.

        Returns:
            The newest sealed checkpoint of this process (:attr:`latest_checkpoint`), or None.

        Raises:
            CheckpointError: the background write failed (the message names the path and errno); the
                previous checkpoint stays the newest usable one. Raised at every later call (the run cannot
                go on without checkpoints); with ``raise_error=False`` it is logged instead.
        """
        self._writer.wait(raise_error)
        return self.latest_checkpoint

    @contextlib.contextmanager
    def checkpoint(self, keep: int | None = None, sync: bool | None = None) -> Iterator[CheckpointWriter]:
        """Write a checkpoint of the current step, atomically.

        Put your files at ``ck.path(name)`` inside the block (``save_state(ck.path("state.safetensors"),
        ...)``); set ``ck.metrics`` to attach metrics. When the block ends normally the Run adds its own state
        (step, data position, RNG states), every file is fsynced, a manifest with each file's size and digest
        is written and the directory renamed into place ("sealed"); then all but the newest ``keep`` complete
        checkpoints of this run are deleted (None keeps all). If the block raises, nothing is kept.

        Asynchronous (the default, see ``checkpoint_async``): ``save_state`` inside the block only copies the
        tensors into a reused host buffer, and the block returns at once; a background thread writes, seals
        and applies ``keep``. The snapshot holds the values of the moment it was taken, so the next step may
        change the model right away. At most one checkpoint is in flight: the next ``run.checkpoint()`` first
        waits for the previous one. A checkpoint counts for resume only once sealed; the loop's end (eviction
        included), :meth:`summary` and the job's commit wait for it. Files written by other means inside the
        block are written there and then, as in a synchronous checkpoint.

        Args:
            keep: how many complete checkpoints to keep (None: all).
            sync: True writes and seals before the block returns; None uses the Run's default.

        Raises:
            ConfigError: ``keep`` < 1, or a bad file name.
            CheckpointError: the previous background write failed (path and errno in the message).
        """
        if keep is not None and int(keep) < 1:
            raise ConfigError(f"run.checkpoint(keep={keep}): keep must be at least 1 (or None to keep all)")
        asynchronous = self.checkpoint_async if sync is None else not sync
        if self._in_checkpoint:
            raise ConfigError("run.checkpoint() blocks cannot be nested: write every file of the step in one block")
        if self._checkpoint_step == self.step:
            raise ConfigError(f"run.checkpoint() was already called at step {self.step}: one checkpoint a step "
                              "(write every file of the step in one block)")
        self._in_checkpoint = True
        started = self._t_block = time.perf_counter()
        try:
            # The block's own code (the user's save_state calls, an evaluation) counts as checkpoint time too:
            # what the loop is blocked by.
            yield from self._checkpoint(keep, asynchronous)
        finally:
            self._in_checkpoint = False
            self._times["checkpoint"] += time.perf_counter() - max(started, self._window_start)

    def _checkpoint(self, keep: int | None, asynchronous: bool) -> Iterator[CheckpointWriter]:
        if self.dist.enabled:
            with self._checkpoint_multi(keep, asynchronous) as writer:
                yield writer
        else:
            self._writer.wait()  # at most one in flight; raises the previous one's error
            pending = self.store.begin(self.step, buffers=self._buffers if asynchronous else None)
            writer = CheckpointWriter(pending)
            try:
                yield writer
                pending.metrics = {k: float(v) for k, v in writer.metrics.items()}
                pending.prepare(self.state_dict())
            except BaseException:
                pending.abort()
                raise
            if writer.metrics:
                self.log(writer.metrics)
            self._seal(pending, keep, asynchronous)
            self._checkpoint_step = self.step

    def _seal(self, pending: PendingCheckpoint, keep: int | None, asynchronous: bool) -> None:
        """Make the points logged so far durable, seal ``pending`` and apply retention: in the background
        writer, or here when synchronous.

        The points come first: a checkpoint sealed before the points it covers are on disk would let a
        SIGKILL lose them for good (the resumed run does not replay steps at or before its checkpoint).
        """
        if self.at_eval and self.loop_started:
            # This step's breakdown goes with the points the seal makes durable: logged after the seal, a kill
            # could lose it for good (the resumed run starts after this step).
            self._log_times(self.step, during_step=True)
        make_durable = getattr(self.tracker, "make_durable", None) if self.is_main else None

        def job() -> Checkpoint:
            if make_durable is not None:
                make_durable(timeout_s=5.0)
            ck = pending.seal()
            self.latest_checkpoint = ck
            if keep is not None:
                try:
                    self.store.retain(int(keep), newest=ck.step)
                except OSError as exc:  # the new checkpoint is sealed: an old one left behind is no failure
                    log.warning("checkpoint %s is sealed, but an older one could not be deleted (keep=%s): %s",
                                ck.path.name, keep, exc)
            return ck

        if asynchronous:
            step = pending.step
            previous = self.latest_checkpoint

            def background() -> Checkpoint:
                try:
                    return job()
                except OSError as exc:
                    raise CheckpointError(
                        f"the checkpoint of step {step} could not be written: {exc} "
                        f"(errno {exc.errno}); the newest usable checkpoint is "
                        f"{previous.path if previous else 'none'}") from exc

            self._writer.submit(background)
        else:
            job()

    @contextlib.contextmanager
    def _checkpoint_multi(self, keep: int | None, asynchronous: bool) -> Iterator[CheckpointWriter]:
        """The checkpoint protocol of a multi-task run (every rank enters it at the same step).

        Rank 0 waits for its previous background seal, opens the partial directory and tells the others its
        name; every rank writes its own state (RNG, data position) into it, the user's files of ranks other
        than 0 go to a discarded scratch folder; once all ranks report success, rank 0 seals it (in the
        background when asynchronous) and tells the others. A failure on any rank aborts the checkpoint on all
        of them; a failed background seal of rank 0 fails every rank at the next checkpoint.
        """
        error: BaseException | None = None
        pending = None
        if self.dist.is_main:
            try:
                self._writer.wait()
                pending = self.store.begin(self.step, buffers=self._buffers if asynchronous else None)
            except BaseException as exc:  # tell the others before raising
                error = exc
        name = self.dist.broadcast(pending.dir.name if pending else None)
        if error is not None:
            raise error
        if name is None:
            raise CheckpointError(f"rank {self.rank}: rank 0 could not start the checkpoint of step {self.step} "
                                  "(its previous checkpoint failed to write; see its log)")
        partial = self.store.root / name
        if pending is None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            pending = PendingCheckpoint(self.store, self.step, scratch=self._scratch)
        writer = CheckpointWriter(pending)
        try:
            yield writer
            if self.rank:
                state = self.state_dict()
                mine = {k: state[k] for k in ("rng", "rng_epoch_start", "data_position", "step", "epoch")
                        if k in state}
                target = partial / rank_state_name(self.rank)
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "w") as fh:
                    json.dump(mine, fh, sort_keys=True)
                    fh.flush()
                    os.fsync(fh.fileno())
        except BaseException as exc:  # still take part in the vote, then re-raise
            error = exc
        failed = self.dist.any(error is not None)
        sealed = None
        if not self.dist.is_main:
            pending.abort()  # the scratch folder: nothing in it is kept
        else:
            if failed:
                pending.abort()
            else:
                pending.metrics = {k: float(v) for k, v in writer.metrics.items()}
                try:
                    pending.prepare(self.state_dict())
                    if writer.metrics:
                        self.log(writer.metrics)
                    self._seal(pending, keep, asynchronous)
                    sealed = f"step-{self.step:09d}"
                except BaseException as exc:
                    pending.abort()
                    error = exc
        name = self.dist.broadcast(sealed)
        if error is not None:
            raise error
        if name is None:
            raise CheckpointError(f"rank {self.rank}: the checkpoint of step {self.step} was not sealed "
                                  "(another rank failed writing its part; see its log)")
        if not self.dist.is_main and not asynchronous:
            self.latest_checkpoint = self.store.open(name)
        self._checkpoint_step = self.step
