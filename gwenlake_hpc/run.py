"""The Run: a thin owner of the training loop.

It numbers steps, feeds batches, fast-forwards on a resume without reading the skipped data, turns a stop
request into an ordinary end of loop between two steps, writes atomic checkpoints that carry its own state
(asynchronously by default: the loop waits only for a copy of the state), and forwards metrics to tracking
without slowing the loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .checkpoints import (BackgroundWriter, BufferPool, Checkpoint, CheckpointStore, PendingCheckpoint,
                         rank_state_name)
from .checkpoints.writer import async_default
from . import rules
from .distributed import Dist
from .errors import CheckpointError, ConfigError, NonFiniteError
from .progress import Progress
from .rng import rng_state, set_rng_state, shield_workers
from .signals import StopRequest
from .tracking.metric_tags import run_tag, tagged_series

log = logging.getLogger("gwenlake_hpc.run")


# --- the checkpoint handle users see -------------------------------------------------------------------------

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



def _length_of(batches: Any) -> int | None:
    """``len(batches)``, or None when unknown: no ``__len__``, or one that raises ``TypeError`` (a torch DataLoader
    over an ``IterableDataset`` without ``__len__``)."""
    if batches is None or not hasattr(batches, "__len__"):
        return None
    try:
        return len(batches)
    except TypeError:
        return None

class Run:
    """Owns the loop of one training; passed to the decorated function as ``run``.

    Built by the job (``gwenlake_hpc.job``), not by user code.

    Args:
        run_dir: the run directory on the shared filesystem.
        run_key: the run's key (checkpoints of another key are never read).
        steps: total steps, or None when ``epochs`` sets the length.
        epochs: number of epochs over the batches given to :meth:`steps`, or None.
        eval_every: a step that is a multiple of it has ``at_eval`` true.
        seed: the run's seed (batch order is a function of seed and epoch).
        tracker: a ``gwenlake_hpc.tracking`` Tracker or NullTracker.
        stop: the StopRequest the signal handlers set.
        resume: ``"auto"`` (resume from the newest complete checkpoint) or ``"never"``.
        progress: Progress mode (``auto``, ``bar``, ``lines``, ``off``) and ``progress_every_s``.
        dist: this process's place in a multi-task run (:func:`gwenlake_hpc.distributed.setup`); default
            a single process.
        checkpoint_async: default of ``run.checkpoint(sync=...)``; None reads ``GWENLAKE_CHECKPOINT_ASYNC``
            (on unless it is ``0``, ``false``, ``no`` or ``off``).
        on_nonfinite: ``stop``: :meth:`log` of a NaN or infinite loss (a metric whose name contains
            ``loss``) raises :class:`NonFiniteError`; ``warn``: a warning, once per metric.

    Attributes read by user code: ``resumed``, ``resume_path``, ``start_step``, ``step``, ``epoch``,
    ``at_eval``, ``stopping``, ``evicted``, ``total_steps``, ``run_dir``, ``seed``, ``rank``, ``world_size``,
    ``local_rank``, ``is_main``.

    In a multi-task run every rank runs the same loop: with ``Input(...).batches()`` each rank reads its own
    contiguous shard of every epoch (``len(batches) // world_size`` batches a rank, the remainder dropped),
    a stop request seen by any rank ends the loop of all ranks after the same step, rank 0 alone writes
    the checkpoint files, logs and commits, and every rank's RNG and data position are saved in the one
    atomic checkpoint, so a resumed run continues exactly where it stopped.
    """

    def __init__(self, *, run_dir: Path, run_key: str, steps: int | None, epochs: int | None, eval_every: int,
                 seed: int, tracker: Any, stop: StopRequest, resume: str = "auto", progress: str = "auto",
                 progress_every_s: float = 30.0, dist: Dist | None = None, checkpoint_async: bool | None = None,
                 on_nonfinite: str = "stop"):
        rules.whole_number("job.steps", steps, 0)
        rules.whole_number("job.epochs", epochs)
        rules.whole_number("job.eval_every", "null" if eval_every is None else eval_every)
        self.run_dir = Path(run_dir)
        self.run_key = run_key
        self.seed = seed
        self.eval_every = int(eval_every)
        self.epochs = epochs
        self._steps_setting = steps
        self.total_steps: int | None = steps
        self.tracker = tracker
        self._stop = stop
        self.dist = dist or Dist()
        self.rank, self.world_size, self.local_rank = self.dist.rank, self.dist.world_size, self.dist.local_rank
        self._progress_mode = progress if self.dist.is_main else "off"
        self._progress_every_s = progress_every_s
        rules.choice("job.resume", resume, ("auto", "never"))
        self.store = CheckpointStore(self.run_dir / "checkpoints", run_key)
        # Where a rank other than 0 puts its (discarded) checkpoint files; its Output is a sibling folder.
        self._scratch = self.run_dir / ".ranks" / f"rank-{self.rank:05d}" / "checkpoint"
        latest = None
        if self.dist.is_main:
            removed = self.store.clean_partials()
            if removed:
                log.info("removed %d partial checkpoint(s) left by an interrupted writer", len(removed))
            latest = self.store.latest() if resume == "auto" else None
            if resume == "never" and self.store.complete():
                raise ConfigError(f"job.resume=never but {self.store.root} already holds checkpoints of this "
                                  "run; nothing is deleted: move them away or use job.resume=auto")
        # Rank 0 alone chooses (and may set aside damaged ones); every rank resumes from its choice.
        name = self.dist.broadcast(latest.path.name if latest else None)
        if not self.dist.is_main and name is not None:
            latest = self.store.open(name)
            if latest is None:
                raise RuntimeError(f"rank {self.rank}: checkpoint {name} chosen by rank 0 is not readable here; "
                                   "is the run directory on a filesystem shared by all nodes?")
        self._resumed_from: Checkpoint | None = latest
        self._run_state = self._own_state(latest) if latest else None
        self.start_step = latest.step if latest else 0
        self.step = self.start_step
        self.epoch = 0
        self.at_eval = False
        self.stopping = False
        self.evicted = False
        self.latest_checkpoint: Checkpoint | None = latest
        self._checkpoint_step: int | None = None
        self._iterated = False
        self._summary: dict[str, float] = {}
        self._tagged_series: dict[str, dict[str, str]] = {}  # series -> its tags (recorded on the run already)
        self._progress: Progress | None = None
        self.checkpoint_async = async_default() if checkpoint_async is None else bool(checkpoint_async)
        rules.choice("job.on_nonfinite", on_nonfinite, ("stop", "warn"))
        self._on_nonfinite = on_nonfinite
        self._warned_nonfinite: set[str] = set()
        self._writer = BackgroundWriter()
        self._buffers = BufferPool()
        self._in_checkpoint = False
        # Seconds since the last evaluation: waiting for input, the whole step (checkpoint and tracking
        # included), blocked in run.checkpoint(), in run.log(). See _log_times.
        self._times = dict.fromkeys(("input", "step", "checkpoint", "tracking"), 0.0)
        self._steps_timed = 0

    @property
    def is_main(self) -> bool:
        """True on rank 0 (always in a single-process run): the rank that writes, logs and commits."""
        return self.dist.is_main

    def _own_state(self, ck: Checkpoint) -> dict[str, Any]:
        """This rank's state from a checkpoint: rank 0's is the Run state, the others' their rank files."""
        state = ck.run_state()
        if self.rank == 0 and state.get("world_size", 1) == self.world_size:
            return state
        mine = ck.rank_state(self.rank) if self.rank else state
        if mine is None or state.get("world_size", 1) != self.world_size:
            log.warning("checkpoint %s was written by %s rank(s), this run has %d: rank %d's RNG is re-seeded "
                        "and the data shards differ, so the resumed run is not identical to an uninterrupted one",
                        ck.path.name, state.get("world_size", 1), self.world_size, self.rank)
            seed_everything(self.seed + self.rank)
            return {**state, "rng": rng_state()}
        return {**state, **mine}

    # -- resume facts ------------------------------------------------------------------------------------------
    @property
    def resumed(self) -> bool:
        """True when a complete checkpoint of this run was found and the loop continues after it."""
        return self._resumed_from is not None

    @property
    def resume_path(self) -> Path | None:
        """Directory of the newest complete checkpoint (load your files from it), or None."""
        return self._resumed_from.path if self._resumed_from else None

    @property
    def loop_started(self) -> bool:
        """True once :meth:`steps` was iterated."""
        return self._iterated

    @property
    def stop_requested(self) -> bool:
        """True once a termination signal (or another stop request) arrived."""
        return self._stop.requested

    def steps_for(self, rows: int, batch_size: int, drop_last: bool = False) -> int:
        """Steps this run takes over ``rows`` rows in batches of ``batch_size``.

        ``ceil(rows / batch_size)`` (``floor`` with ``drop_last``) batches per epoch, divided by
        ``world_size`` (rounded down) in a multi-task run, times ``epochs`` (1 when the run is set by
        ``steps``). Useful for LR schedules that need the total length.
        """
        per_epoch = rows // batch_size if drop_last else math.ceil(rows / batch_size)
        if self.world_size > 1:
            per_epoch //= self.world_size
        return per_epoch * (self.epochs or 1)

    # -- the loop ----------------------------------------------------------------------------------------------
    def _sharded(self, batches: Any) -> bool:
        return self.world_size > 1 and hasattr(batches, "epoch") and hasattr(batches, "__len__")

    def _resolve_total(self, batches: Any) -> tuple[int, int | None]:
        per_epoch = _length_of(batches)
        if per_epoch == 0:
            raise ConfigError("run.steps(): the batches are empty (0 batches per epoch)")
        if per_epoch is not None and self._sharded(batches):
            per_epoch //= self.world_size
            if per_epoch == 0:
                raise ConfigError(f"run.steps(): {_length_of(batches)} batches per epoch cannot be shared by "
                                  f"{self.world_size} ranks; use a smaller batch_size or fewer tasks")
        if self._steps_setting is not None:
            total = self._steps_setting
        elif self.epochs is not None:
            if per_epoch is None:
                raise ConfigError("job.epochs is set but run.steps() got batches of unknown length; "
                                  "set job.steps instead")
            total = self.epochs * per_epoch
        elif per_epoch is not None:
            total = per_epoch
        else:
            raise ConfigError("the training length is unknown: set job.steps or job.epochs")
        return total, per_epoch

    def _batch_stream(self, batches: Any, per_epoch: int | None, start: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(epoch, batch)`` from global batch index ``start`` on, forever."""
        if batches is None:
            while True:
                yield 0, None
        if hasattr(batches, "epoch") and per_epoch:
            # gwenlake Batches: the data position is computed, skipped batches are never read. A rank of a
            # multi-task run reads its own contiguous shard of each epoch's order.
            epoch, pos = divmod(start, per_epoch)
            shard = self.rank * per_epoch if self._sharded(batches) else 0
            while True:
                it = batches.epoch(epoch, start=shard + pos, seed=self.seed)
                for _ in range(per_epoch - pos):
                    yield epoch, next(it)
                epoch, pos = epoch + 1, 0
        # Any other re-iterable (a list, a DataLoader): skipping means reading.
        if start:
            log.warning("resuming at batch %d of a plain iterable: the skipped batches are read and dropped; "
                        "use Input(...).batches() to resume without reading them", start)
        epoch, pos = (divmod(start, per_epoch) if per_epoch else (0, start))
        while True:
            produced = 0
            for i, b in enumerate(batches):
                produced += 1
                if i < pos:
                    continue
                yield epoch, b
            if produced == 0:
                raise ConfigError("run.steps(): the batches yielded nothing")
            if per_epoch is None and pos >= produced:
                pos -= produced
            else:
                pos = 0
            epoch += 1

    def steps(self, batches: Iterable[Any] | None = None) -> Iterator[tuple[int, Any]]:
        """Iterate the training: yields ``(step, batch)`` for steps ``start_step + 1 .. total``.

        Args:
            batches: ``Input(...).batches(...)`` (resumable without reading skipped data; epochs repeat with a
                new order), any re-iterable of batches (repeated over epochs; a resume reads the skipped
                ones), or None (the batch is None, for trainings that make their own data).

        Before each step ``at_eval`` is fixed: true at multiples of ``eval_every``, at the last step, and when
        a stop request arrived before the step was yielded (that step is then the last, with ``stopping``).
        A stop request that arrives during step k ends the loop after k when k wrote a checkpoint, else after
        one more step k+1 yielded with ``at_eval`` and ``stopping`` true. After such an end ``evicted`` is true.

        Raises:
            ConfigError: the length is unknown (no steps/epochs and no ``len``), or the batches are empty.
            RuntimeError: iterated a second time.
        """
        if self._iterated:
            raise RuntimeError("run.steps() can be iterated once per training")
        self._iterated = True
        total, per_epoch = self._resolve_total(batches)
        self.total_steps = total
        shield_workers(batches)
        was = (self._run_state or {}).get("world_size", 1)
        if self._run_state is not None and self._steps_setting is None and was != self.world_size:
            # An epoch is len(batches) // world_size steps: another number of ranks changes the run's length.
            raise ConfigError(f"this run's checkpoints were written by {was} rank(s) and this job has "
                              f"{self.world_size}: with job.epochs the number of steps depends on it; run it with "
                              f"{was} task(s), or set job.steps, or start a new run (job.model=...)")
        if self._run_state is not None:
            set_rng_state(self._run_state["rng"])
        if self.resumed:
            log.info("resuming from step %d (%s)", self.start_step, self.resume_path)
        elif self.is_main:  # say where it looked: a mistyped paths.runs_root would otherwise start over silently
            log.info("no checkpoint of this run in %s: training from step 0", self.store.root)
        if self.start_step >= total:
            if self.start_step > total:
                log.warning("checkpoint at step %d is beyond the %d steps asked for: nothing to train",
                            self.start_step, total)
            return
        self._progress = Progress(total, self.start_step, self._progress_mode, self._progress_every_s)
        stream = self._batch_stream(batches, per_epoch, self.start_step)
        step = self.start_step
        try:
            while step < total:
                self._writer.raise_if_failed()  # a failed background write fails the run at the next step
                self._stop.check_handlers()  # a library's own SIGTERM handler must not swallow an eviction
                # One decision for all ranks (a collective in a multi-task run): a stop request seen by any
                # rank stops every rank after the same step.
                final = self._agree_on_stop()
                if final and step > self.start_step and self._checkpoint_step == step:
                    self.evicted = True  # the step just done wrote its checkpoint: end here
                    break
                step += 1
                t_input = time.perf_counter()
                epoch, batch = next(stream)
                self.step, self.epoch = step, epoch
                self.stopping = final
                self.at_eval = final or step % self.eval_every == 0 or step == total
                t_step = time.perf_counter()
                self._times["input"] += t_step - t_input
                yield step, batch
                self._times["step"] += time.perf_counter() - t_step
                self._steps_timed += 1
                if self.at_eval:
                    self._log_times(step)
                self._progress.update(step)
                if final:
                    self.evicted = True
                    if self._checkpoint_step != step:
                        log.warning("stopped at step %d without a checkpoint of it: write one when run.at_eval "
                                    "is true, or the work since the last checkpoint is redone", step)
                    break
        except KeyboardInterrupt:
            raise  # a second Ctrl-C: at once, without waiting for a write in flight (its partial is cleaned later)
        except BaseException:
            self._writer.wait(raise_error=False)  # the checkpoint in flight is still sealed; the error wins
            raise
        else:
            self.wait_for_checkpoint()  # the final (eviction) checkpoint is sealed before the loop ends
        finally:
            self.at_eval = self.stopping = False
            if self._progress is not None:
                self._progress.close()
            if self.evicted:
                log.warning("stop requested (%s): loop ended after step %d", self._stop.reason, self.step)

    def interruptible(self) -> Any:
        """A block in which a stop signal raises :class:`gwenlake_hpc.signals.StopInterrupt` at once (see
        :meth:`StopRequest.interrupting`); used by short fits, which have nothing to save half-way."""
        return self._stop.interrupting()

    def _agree_on_stop(self) -> bool:
        """Whether any rank was asked to stop; a rank that was not records the other's reason (for its log)."""
        if not self.dist.enabled:
            return self._stop.requested
        stop = self._stop
        # One collective carries who stopped and why: signal number (0: a request without a signal), then rank.
        mine = ((int(stop.signum or 0) + 1) << 20) + self.dist.rank if stop.requested else 0
        agreed = self.dist.max(mine)
        if agreed and not stop.requested:
            signum, rank = (agreed >> 20) - 1, agreed & ((1 << 20) - 1)
            why = signal.Signals(signum).name if signum > 0 else "a stop request"
            stop.request(f"{why} on rank {rank}")
        return bool(agreed)

    # -- metrics ------------------------------------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int | None = None, tags: Mapping[str, Any] | None = None) -> None:
        """Record metric values for a step (default: the current step); never blocks on tracking.

        A NaN or infinite value of a loss (a name containing ``loss``) ends the run (``job.on_nonfinite=stop``,
        the default) before the step's checkpoint can hold diverged weights; other metrics only warn.

        Args:
            metrics: name -> number (Python float/int, numpy scalar or one-element tensor; note that reading
                a CUDA tensor synchronises the device).
            step: the step the values belong to (default: the ``step`` or ``epoch`` tag, else ``run.step``).
            tags: qualifiers from the vocabulary ``split``, ``class``, ``threshold``, ``optimizer``,
                ``model_version`` (others warn once); each combination is a series of its own, named with the
                tags sorted: ``auc/class:churn/split:test``, its tags also recorded as the run tag
                ``gwenlake.metric_tags.<series>``. ``step``/``epoch`` give the x-axis instead (see
                :mod:`gwenlake_hpc.tracking.metric_tags`).

        Raises:
            ValueError: a bad tag name, or a ``step``/``epoch`` tag that is not a whole number.
            NonFiniteError: a NaN or infinite loss with ``job.on_nonfinite=stop``.
        """
        tag_step = None
        if tags:  # the plain path (every step, no tags) does no naming work
            series_of, tag_step = self._tagged_names(metrics, tags)
            values = {series_of[k]: float(v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        else:
            values = {k: float(v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        step = int(step) if step is not None else tag_step if tag_step is not None else self.step
        for k, v in values.items():
            if not math.isfinite(v):
                self._non_finite(k, v, step)
        self._summary.update(values)
        if self._progress is not None and "loss" in values:
            self._progress.loss = values["loss"]
        t0 = time.perf_counter()
        self.tracker.log_metrics(values, step)
        self._times["tracking"] += time.perf_counter() - t0

    def _tagged_names(self, metrics: Mapping[str, Any], tags: Mapping[str, Any]) -> tuple[dict[str, str], int | None]:
        """Series name of each metric under ``tags`` and the step the tags give; records a new series' tags on
        the run once. Raises ValueError (see :meth:`log`)."""
        series_of: dict[str, str] = {}
        tag_step, naming = None, {}
        for k in metrics:
            series_of[k], tag_step, naming = tagged_series(k, tags)
            seen = self._tagged_series.get(series_of[k])
            if seen is not None and seen != naming:  # "a/b" and "a_b" would merge, and points be lost
                raise ValueError(f"metric {k!r}: tags {naming} and {seen} both make the series "
                                 f"{series_of[k]!r} (characters MLflow refuses become '_'): tell them apart")
        for k in metrics:
            if series_of[k] not in self._tagged_series:
                self._tagged_series[series_of[k]] = naming
                if self.is_main:
                    self.tracker.set_tags(dict([run_tag(series_of[k], naming)]))
        return series_of, tag_step

    def _log_times(self, step: int) -> None:
        """Log where the steps since the last evaluation spent their time, in seconds per step.

        ``time/input`` waiting for the next batch, ``time/compute`` the step itself minus what follows,
        ``time/checkpoint`` inside ``run.checkpoint()`` blocks (snapshot or write, and whatever the block
        does), ``time/tracking`` inside ``run.log()``. Logged at each evaluation step (rank 0), not part of
        :meth:`summary`: a user sees at a glance whether input, model, checkpoints or tracking is the limit.
        """
        n = max(self._steps_timed, 1)
        t = self._times
        compute = max(t["step"] - t["checkpoint"] - t["tracking"], 0.0)
        values = {"time/input": t["input"] / n, "time/compute": compute / n, "time/checkpoint": t["checkpoint"] / n,
                  "time/tracking": t["tracking"] / n}
        if self.is_main:
            self.tracker.log_metrics(values, step)
        self._times = dict.fromkeys(t, 0.0)
        self._steps_timed = 0

    def _non_finite(self, key: str, value: float, step: int) -> None:
        """A metric is NaN or infinite: stop on a loss (unless ``warn``), warn once otherwise.

        Raises:
            NonFiniteError: a loss, with ``on_nonfinite="stop"``; the message names metric, step, the
                newest checkpoint (kept) and the setting that lets the run go on.
        """
        if "loss" in key.lower() and self._on_nonfinite == "stop":
            ck = self.wait_for_checkpoint(raise_error=False)
            raise NonFiniteError(
                f"metric {key!r} is {value} at step {step}: the training diverged or its data holds NaN; the "
                f"newest checkpoint ({ck.path if ck else 'none'}) is kept. Lower the learning rate or clean the "
                "data, or set job.on_nonfinite=warn to go on anyway")
        if key not in self._warned_nonfinite:
            self._warned_nonfinite.add(key)
            log.warning("metric %r is %s at step %d (and may be again: warned once)", key, value, step)

    def summary(self) -> dict[str, float]:
        """The latest value of every metric logged in this process, plus ``step`` (the last step done).

        Waits for a checkpoint still being written (its metrics are part of the summary).
        """
        self.wait_for_checkpoint()
        return {**self._summary, "step": float(self.step)}

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The Run's own state saved in every checkpoint."""
        return {
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
        started = time.perf_counter()
        try:
            # The block's own code (the user's save_state calls, an evaluation) counts as checkpoint time too:
            # what the loop is blocked by.
            yield from self._checkpoint(keep, asynchronous)
        finally:
            self._in_checkpoint = False
            self._times["checkpoint"] += time.perf_counter() - started

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
                mine = {k: state[k] for k in ("rng", "data_position", "step", "epoch")}
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


#: The Run whose training function is running in this process (set by the job around the call).


# the helpers of the current run and of the RNG, re-exported where users and the job found them
from .current import active, checkpoint, current_run, last_checkpoint_path, log_metrics, log_rollout  # noqa: E402,F401
from .rng import ShieldedWorkerInit, seed_everything  # noqa: E402,F401
