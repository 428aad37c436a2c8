"""The Run: a thin owner of the training loop, composed of the objects it builds.

The :class:`Run` itself owns:

- the loop (:meth:`Run.steps`): step numbering, ``at_eval``, the batches fed from the resume point (fast-forward
  without reading the skipped data when it can), a stop request turned into an ordinary end of loop between two
  steps, agreed by every rank (:func:`~.distributed.agree_on_stop`);
- the resume facts: the checkpoint chosen at start (``resumed``, ``resume_path``, ``start_step``);
- its own state saved in every checkpoint (:meth:`Run.state_dict`: step, data position, RNG); the public API.

It builds, in ``__init__``, and owns a :class:`~.timing.StepTimes` (the ``time/*`` accumulators, shared), and:

- a :class:`~.run_resume.RunResume`: the checkpoint levels (shared, node-local, the copier between them), the
  checkpoint chosen at start and this rank's state in it, checked and restored as the loop begins;
- a :class:`~.run_metrics.RunMetrics`: ``run.log``, non-finite losses, the breakdown, ``run.summary()``;
- a :class:`~.run_checkpoints.RunCheckpoints`: ``run.checkpoint()`` (asynchronous by default: the loop waits
  only for a copy of the state), ``run.wait_for_checkpoint()``, ``run.latest_checkpoint``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping

from ..base import rules
from ..stores.checkpoints import Checkpoint, CheckpointStore
from ..stores.checkpoints.levels import DEFAULT_SHARED_WAIT_S
from ..stores.checkpoints.resume import RESUME_CHOICES
from ..stores.checkpoints.writer import async_default
from .distributed import Dist, agree_on_stop
from .heartbeat import DONE
from .interval import AUTO, DEFAULT_MAX_INTERVAL_S, DEFAULT_MTBF_H, AutoInterval
from .feed import batch_stream, resolve_total, warn_persistent_workers
from .progress import Progress
from .ranks import DEFAULT_FACTOR, RankSpeeds
from .rng import rng_state, shield_workers
from .run_checkpoints import CheckpointWriter, RunCheckpoints  # noqa: F401 (CheckpointWriter re-exported)
from .run_metrics import RunMetrics
from .run_resume import RunResume
from .signals import StopRequest
from .timing import StepTimes

log = logging.getLogger("gwenlake_hpc.run")


class Run:
    """Owns the loop of one training; passed to the decorated function as ``run``.

    Built by the job (``gwenlake_hpc.job.execute``), not by user code.

    Args:
        run_dir: the run directory on the shared filesystem.
        run_key: the run's key (checkpoints of another key are never read).
        steps: total steps, or None when ``epochs`` sets the length.
        epochs: number of epochs over the batches given to :meth:`steps`, or None.
        eval_every: a step that is a multiple of it has ``at_eval`` true; ``"auto"``: the steps between two
            are chosen from the run's measurements (:mod:`.interval`, with ``mtbf_s`` and ``max_eval_interval_s``).
        seed: the run's seed (batch order is a function of seed and epoch).
        tracker: a ``gwenlake_hpc.stores.tracking`` Tracker or NullTracker.
        stop: the StopRequest the signal handlers set.
        resume: ``"auto"`` (resume from the newest complete checkpoint) or ``"never"``.
        progress: Progress mode (``auto``, ``bar``, ``lines``, ``off``) and ``progress_every_s``.
        dist: this process's place in a multi-task run (:func:`gwenlake_hpc.runtime.distributed.setup`); default
            a single process.
        checkpoint_async: default of ``run.checkpoint(sync=...)``; None reads ``GWENLAKE_CHECKPOINT_ASYNC``
            (on unless it is ``0``, ``false``, ``no`` or ``off``).
        on_nonfinite: ``stop``: :meth:`log` of a NaN or infinite loss (a metric whose name contains
            ``loss``) raises :class:`NonFiniteError`; ``warn``: a warning, once per metric.
        heartbeat: a :class:`~.heartbeat.Heartbeat` the hang watchdog reads (a beat at the start of every step,
            checkpoint blocks marked), or None.
        slow_rank_factor: ``job.slow_rank_factor``: a rank slower than the median by this factor for several
            evaluations in a row is warned about (:mod:`.ranks`; 0: no warning).
        on_loop_start: called once with the loop's first step (``start_step + 1``) when :meth:`steps` begins,
            before that step's batch is read (the job records it in ``run.json``); None: nothing.
        ledger: this start's :class:`~.ledger.StartLedger` (rank 0), fed at every step; None: none.
        mtbf_s: with ``eval_every="auto"``, gives the mean seconds between unannounced interruptions.
        max_eval_interval_s: with ``eval_every="auto"``, the longest interval between two evaluations.
        local_dir: the run's folder on a node-local first level of checkpoints
            (:func:`~gwenlake_hpc.stores.checkpoints.levels.local_root` of ``checkpoint.local_dir``), or None: every
            checkpoint is sealed in ``<run_dir>/checkpoints`` directly. Not used (a log line says so) when the
            ranks run on several nodes.
        shared_wait_s: ``checkpoint.shared_wait_s``: seconds after a stop signal (or a failure) during which the
            end of the loop waits for the copy of the newest local checkpoint to the shared level.

    Attributes read by user code: ``resumed``, ``resume_path``, ``start_step``, ``step``, ``epoch``,
    ``at_eval``, ``stopping``, ``evicted``, ``total_steps``, ``run_dir``, ``seed``, ``rank``, ``world_size``,
    ``local_rank``, ``is_main``, ``latest_checkpoint``.

    Metrics and checkpoints are objects the Run owns (see the module's docstring).

    In a multi-task run every rank runs the same loop: with ``Input(...).batches()`` each rank reads its own
    contiguous shard of every epoch (``len(batches) // world_size`` batches a rank, the remainder dropped),
    a stop request seen by any rank ends the loop of all ranks after the same step, rank 0 alone writes
    the checkpoint files, logs and commits, and every rank's RNG and data position are saved in the one
    atomic checkpoint, so a resumed run continues exactly where it stopped. A sharded state (FSDP2, DTensor)
    is the exception to "rank 0 alone writes": every rank writes its shards into that checkpoint
    (:mod:`gwenlake_hpc.stores.checkpoints.sharded`).

    Another number of ranks than the checkpoint's: under ``job.steps`` the run resumes (a sharded state is
    resharded by ``load_state``); the RNG states of the checkpoint's ranks are not used, every rank is
    re-seeded with ``seed + rank`` (``seed_everything``) and a warning says the run is not identical to an
    uninterrupted one. Under ``job.epochs`` it is refused (:meth:`steps` raises ConfigError): an epoch's length
    depends on the number of ranks.

    The data position (``Input(...).batches()``) is a global sample count, saved as the ``data`` of every
    checkpoint; on another number of ranks the new ranks split what the interrupted epoch has left
    (:class:`~.feed.PlanStream` says what is skipped when the global batch size changes too).
    """

    def __init__(self, *, run_dir: Path, run_key: str, steps: int | None, epochs: int | None, eval_every: int | str,
                 seed: int, tracker: Any, stop: StopRequest, resume: str = "auto", progress: str = "auto",
                 progress_every_s: float = 30.0, dist: Dist | None = None, checkpoint_async: bool | None = None,
                 on_nonfinite: str = "stop", heartbeat: Any = None, slow_rank_factor: float = DEFAULT_FACTOR,
                 on_loop_start: Callable[[int], None] | None = None, ledger: Any = None,
                 mtbf_s: Callable[[], float] | None = None, max_eval_interval_s: float = DEFAULT_MAX_INTERVAL_S,
                 local_dir: Path | None = None, shared_wait_s: float = DEFAULT_SHARED_WAIT_S):
        rules.whole_number("job.steps", steps, 0)
        rules.whole_number("job.epochs", epochs)
        if eval_every != AUTO:
            rules.whole_number("job.eval_every", "null" if eval_every is None else eval_every)
        rules.choice("job.resume", resume, RESUME_CHOICES)
        rules.choice("job.on_nonfinite", on_nonfinite, ("stop", "warn"))
        self.run_dir, self.run_key, self._on_loop_start = Path(run_dir), run_key, on_loop_start
        self.seed = seed
        self.eval_every: int | str = AUTO if eval_every == AUTO else int(eval_every)
        self._ledger = ledger
        self.epochs = epochs
        self._steps_setting = steps
        self.total_steps: int | None = steps
        self.tracker = tracker
        self._stop = stop
        self.dist = dist or Dist()
        self.rank, self.world_size, self.local_rank = self.dist.rank, self.dist.world_size, self.dist.local_rank
        self._progress_mode = progress if self.dist.is_main else "off"
        self._progress_every_s = progress_every_s
        self._progress: Progress | None = None
        self.checkpoint_async = async_default() if checkpoint_async is None else bool(checkpoint_async)
        self.store = CheckpointStore(self.run_dir / "checkpoints", run_key)
        self._shared_wait_s = float(shared_wait_s)
        self._resume = RunResume(self.store, self.dist, self.run_dir, run_key, seed, resume, local_dir)
        latest = self._resume.checkpoint
        self._resumed_from: Checkpoint | None = latest
        self._run_state = self._resume.state
        self.start_step = latest.step if latest else 0
        self.step = self.start_step
        self.epoch = 0
        self.at_eval = False
        self.stopping = False
        self.evicted = False
        # RNG states when the current pass over a plain iterable began (saved in checkpoints, see feed.batch_stream).
        self._epoch_rng: dict[str, Any] | None = None
        self._feed: Any = None  # the batch stream of steps(); a PlanStream knows the data position
        self._iterated = False
        self._times = StepTimes()
        # Where a rank other than 0 puts its (discarded) checkpoint files; its Output is a sibling folder.
        scratch = self.run_dir / ".ranks" / f"rank-{self.rank:05d}" / "checkpoint"
        self._checkpoints = RunCheckpoints(self._resume.local or self.store, self.dist, self._times, tracker, scratch,
                                           latest, self._resume.copier)
        self._heartbeat = self._checkpoints.heartbeat = heartbeat  # the hang watchdog's view (None: no watchdog)
        self._metrics = RunMetrics(tracker, self._times, self.dist.is_main, on_nonfinite, self._checkpoints.wait)
        if latest is not None:  # a rerun with no step left still has the values its summary() returns
            self._metrics.restore(self._run_state.get("metrics") if self._run_state else None, latest.metrics)
        self._speeds = RankSpeeds(self.dist, tracker, self.run_dir, slow_rank_factor) if self.dist.enabled else None
        self._auto = None if eval_every != AUTO else AutoInterval(
            self.start_step, mtbf_s or (lambda: DEFAULT_MTBF_H * 3600.0), max_eval_interval_s,
            lambda: self._checkpoints.last_write_s, self.dist.broadcast if self.dist.enabled else None,
            tracker.log_metrics if self.dist.is_main else None)
        if ledger is not None:
            ledger.sealed_of = lambda: self._checkpoints.latest.step if self._checkpoints.latest else None

    def release_local_level(self) -> None:
        """At the end of a run whose version is committed (rank 0; the job calls it): wait for the copy of the
        newest checkpoint, then remove the run's local level, so no node keeps a finished run's checkpoints.
        Nothing when the shared level lacks the newest (a failed copy: the local one stays for a resume)."""
        self._resume.release_local_level(self._checkpoints.wait)

    @property
    def is_main(self) -> bool:
        """True on rank 0 (always in a single-process run): the rank that writes, logs and commits."""
        return self.dist.is_main

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
    def _pass_began(self, rng: dict[str, Any]) -> None:
        self._epoch_rng = rng

    def steps(self, batches: Iterable[Any] | None = None, *, total: int | None = None) -> Iterator[tuple[int, Any]]:
        """Iterate the training: yields ``(step, batch)`` for steps ``start_step + 1 .. total``.

        Args:
            batches: ``Input(...).batches(...)`` (resumable without reading skipped data; epochs repeat with a
                new order), any re-iterable of batches (repeated over epochs; a resume reads the skipped
                ones), or None (the batch is None, for trainings that make their own data). Before each pass
                over a re-iterable, the resumed one included, :func:`~.feed.set_epoch` gives it the epoch number
                (an ``IterableBatches``, a ``DataLoader``'s dataset or ``DistributedSampler``).
            total: the number of steps when a framework's own loop fixes it (``gwenlake_hpc.integrations``:
                the Trainer's ``max_steps``); it replaces ``job.steps``/``job.epochs``. None: from those.

        Before each step ``at_eval`` is fixed: true at multiples of ``eval_every``, at the last step, and when
        a stop request arrived before the step was yielded (that step is then the last, with ``stopping``).
        A stop request that arrives during step k ends the loop after k when k wrote a checkpoint, else after
        one more step k+1 yielded with ``at_eval`` and ``stopping`` true. After such an end ``evicted`` is true.

        Raises:
            ConfigError: the length is unknown (no steps/epochs and no ``len``), or the batches are empty.
            RuntimeError: iterated a second time.
        """
        stream, total = self._begin(batches, total)
        if stream is None:
            return
        if self._on_loop_start is not None:
            self._on_loop_start(self.start_step + 1)
        # the loop's objects and bound methods are read once, not at each step (a framework's step may be ~1 ms:
        # gwenlake_hpc.integrations turn this loop once per step of the framework)
        times, metrics, checkpoints, progress = self._times, self._metrics, self._checkpoints, self._progress
        writer, step, stop = checkpoints.writer, self.start_step, self._stop
        raise_if_failed, check_handlers, update = writer.raise_if_failed, stop.check_handlers, progress.update
        # one decision for all ranks (a collective); else: this process's own stop request
        agree = functools.partial(agree_on_stop, self.dist, stop) if self.dist.enabled else None
        beat, first = (self._heartbeat.beat if self._heartbeat is not None else None), self.start_step + 1
        ledger, auto, every = self._ledger, self._auto, self.eval_every if self._auto is None else 0
        speeds = self._speeds
        try:
            while step < total:
                raise_if_failed()  # a failed background write fails the run at the next step
                check_handlers()  # a library's own SIGTERM handler must not swallow an eviction
                final = agree() if agree is not None else stop.requested
                if final and step > self.start_step and checkpoints.last_step == step:
                    self.evicted = True  # the step just done wrote its checkpoint: end here
                    break
                step += 1
                t_input = time.perf_counter()
                epoch, batch = next(stream)
                self.step, self.epoch = step, epoch
                self.stopping = final
                self.at_eval = at_eval = (final or step == total or
                                          (step % every == 0 if every else step >= auto.next_step))
                if beat is not None:
                    beat(step, at_eval, step == first)
                t_step = times.step_start = time.perf_counter()
                times.input_s += t_step - t_input
                if ledger is not None and step == first:
                    ledger.first_step(step, t_step)
                yield step, batch
                t_end = time.perf_counter()
                times.step_s += t_end - max(t_step, times.window_start)
                if ledger is not None:
                    # the first step's batch is start-up's (the ledger's start-up ends at its arrival)
                    ledger.step_done(step, t_end - (t_step if step == first else t_input), times.checkpoint_total_s,
                                     checkpoints.last_step == step, t_end)
                if auto is not None and not final and step != total:
                    auto.observe(step, t_end - t_input, at_eval)
                if step == first and self.checkpoint_async:
                    checkpoints.reserve_ahead()  # the first checkpoint's host buffers, off the loop
                if times.logged_step != step:  # else logged at its checkpoint, this step counted there
                    times.steps_timed += 1
                    if self.at_eval:
                        metrics.log_times(step)
                if at_eval and speeds is not None and not final:
                    speeds.compare(step, metrics.last_times)  # every rank: a gather
                update(step)
                if final:
                    self._stopped_after(step)
                    break
        except KeyboardInterrupt:
            raise  # a second Ctrl-C: at once, without waiting for a write in flight (its partial is cleaned later)
        except BaseException:
            self._bound_copy(time.monotonic())
            writer.wait(raise_error=False)  # the checkpoint in flight is still sealed; the error wins
            raise
        else:
            if self.evicted:
                self._bound_copy(stop.received_at or time.monotonic())
            self.wait_for_checkpoint()  # the final (eviction) checkpoint is sealed before the loop ends
        finally:
            self._end_loop()

    def _begin(self, batches: Any, fixed: int | None = None) -> tuple[Iterator[tuple[int, Any]] | None, int]:
        """Fix the run's length, check a resume against it, restore the RNG states where the batch stream does
        not, and say where the training starts. Returns the batch stream from the resume point (None when
        there is nothing left to train) and the total steps.

        Raises:
            ConfigError: see :meth:`steps`, and a resume with another number of ranks under ``job.epochs``.
            RuntimeError: called a second time.
        """
        if self._iterated:
            raise RuntimeError("run.steps() can be iterated once per training")
        self._iterated = True
        self._stop.disarm()  # from here a stop signal only sets the flag the loop reads between two steps
        self._resume.copy_resumed()  # the training has loaded it by now
        if fixed is not None:
            rules.whole_number("run.steps(total=)", fixed, 0)
            self._steps_setting, self.epochs = int(fixed), None
        total, per_epoch = resolve_total(batches, self._steps_setting, self.epochs, self.world_size)
        self.total_steps = total
        shield_workers(batches)
        warn_persistent_workers(batches)
        resume = self._resume.begin_loop(batches, total, per_epoch, self._steps_setting is None)
        if self.start_step >= total:
            if self.start_step > total:
                log.warning("checkpoint at step %d is beyond the %d steps asked for: nothing to train",
                            self.start_step, total)
            return None, total
        self._progress = self._metrics.progress = Progress(total, self.start_step, self._progress_mode,
                                                           self._progress_every_s)
        self._feed = batch_stream(batches, per_epoch, self.start_step, rank=self.rank, world_size=self.world_size,
                                  seed=self.seed, on_pass=self._pass_began, resume=resume,
                                  position=(self._run_state or {}).get("data"))
        return self._feed, total

    def _bound_copy(self, since: float) -> None:
        """From now on, waits for the copy to the shared level end ``checkpoint.shared_wait_s`` after ``since``
        (``time.monotonic()``: the stop signal's arrival, or now): an eviction's grace window is short."""
        self._checkpoints.copy_deadline = since + self._shared_wait_s

    def _stopped_after(self, step: int) -> None:
        """The loop ends after ``step``, the last one of a stop request."""
        self.evicted = True
        if self._checkpoints.last_step != step:
            log.warning("stopped at step %d without a checkpoint of it: write one when run.at_eval is true, or "
                        "the work since the last checkpoint is redone", step)

    def _end_loop(self) -> None:
        self.at_eval = self.stopping = False
        if self._ledger is not None:
            self._ledger.loop_ended()
        if self._heartbeat is not None:
            self._heartbeat.phase(DONE)  # the loop is over: the hang watchdog no longer counts
        if hasattr(self._feed, "close"):
            self._feed.close()  # stops a prefetch thread now; the data position stays readable
        if self._progress is not None:
            self._progress.close()
        self._checkpoints.buffers.close()  # DCP's stager of sharded states: its thread and cached host copies
        if self.evicted:
            log.warning("stop requested (%s): loop ended after step %d", self._stop.reason, self.step)

    @property
    def checkpoint_level(self) -> str:
        """Where the newest checkpoint is, in words: its path, or with a node-local level which level(s) hold
        it (after an eviction's bounded wait for the copy, the shared level may not)."""
        return self._checkpoints.where()

    # -- metrics and checkpoints (the objects' own docstrings say more) ----------------------------------------
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
                :mod:`gwenlake_hpc.stores.tracking.metric_tags`).

        Raises:
            ValueError: a bad tag name, or a ``step``/``epoch`` tag that is not a whole number.
            NonFiniteError: a NaN or infinite loss with ``job.on_nonfinite=stop``.
        """
        self._metrics.log(metrics, step, tags, self.step)

    def summary(self) -> dict[str, float]:
        """The latest value of every metric logged in this run, plus ``step`` (the last step done): dict of
        float, by metric name.

        Values logged by earlier starts come from the checkpoint resumed from (its Run state, taken at the end of
        its ``with run.checkpoint()`` block, and its ``ck.metrics``), so a rerun that has no step left to train
        (killed after its last checkpoint, before the commit) returns what was logged up to that block, whether
        tracking is on or off; a value logged after the block of that step is not among them. This rank's values. Read the final values
        from here after the loop, never from a loop variable (unbound when the loop had nothing to do).
        Waits for a checkpoint still being written (its metrics are part of the summary).
        """
        self.wait_for_checkpoint()
        return self._metrics.summary(self.step)

    @property
    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest sealed checkpoint of this process (the one resumed from until a new one is sealed), or
        None. A checkpoint written in the background appears here once sealed."""
        return self._checkpoints.latest

    def state_dict(self) -> dict[str, Any]:
        """The Run's own state saved in every checkpoint (``rng_epoch_start`` only over a plain iterable).

        ``data``: the data position of gwenlake ``Batches`` (:meth:`~.feed.PlanStream.position`: ``samples``,
        the global count of samples all ranks have read, and the positions the current epoch has left), the
        same on every rank; None over other batches, or before :meth:`steps`. ``data_position`` is this rank's
        view in steps (``next_global_batch`` is the step), kept for readers of older checkpoints.
        """
        position = getattr(self._feed, "position", None)
        state = {
            "run_key": self.run_key,
            "step": self.step,
            "epoch": self.epoch,
            "data_position": {"epoch": self.epoch, "next_global_batch": self.step, "rank": self.rank,
                              "world_size": self.world_size},
            "data": position() if position is not None else None,
            "seed": self.seed,
            "world_size": self.world_size,
            "total_steps": self.total_steps,
            "rng": rng_state(),
            "tracking_run_id": getattr(self.tracker, "run_id", None),
            "metrics": dict(self._metrics.values),
            "time": time.time(),
        }
        if self._epoch_rng is not None:  # the RNG states the current pass began with: see feed.batch_stream
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
        return self._checkpoints.wait(raise_error)

    def checkpoint(self, keep: int | None = None, sync: bool | None = None) -> ContextManager[CheckpointWriter]:
        """Write a checkpoint of the current step, atomically: ``with run.checkpoint(keep=3) as ck:``.

        Put your files at ``ck.path(name)`` inside the block (``save_state(ck.path("state.safetensors"),
        ...)``); set ``ck.metrics`` to attach metrics. When the block ends normally the Run adds its own state
        (:meth:`state_dict`: step, data position, RNG states), every file is fsynced, a manifest with each
        file's size and digest is written and the directory renamed into place ("sealed"); then all but the
        newest ``keep`` complete checkpoints of this run are deleted (None keeps all). If the block raises,
        nothing is kept.

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
            ConfigError (when the block is entered): ``keep`` < 1, a nested block, a second block at the same step, or a bad file name.
            CheckpointError (when the block is entered): the previous background write failed (path and errno in
                the message).
        """
        asynchronous = self.checkpoint_async if sync is None else not sync
        return self._checkpoints.checkpoint(self.step, keep, asynchronous, self.state_dict, self._metrics,
                                            log_breakdown=self.at_eval and self._iterated)

    def prepare_checkpoint(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                           extra: Mapping[str, Any] | None = None) -> None:
        """Say what one ``save_state`` of the checkpoints will hold, so that the host buffer of the first
        asynchronous checkpoint is allocated ahead, in a background thread, not inside its block.

        Same arguments as ``save_state`` (call it once per state file, before or inside the loop). The size is
        read from the parts at the end of the loop's first step (an optimizer such as Adam makes its state at
        its first ``step()``), or at once when that step is done; pinned memory when the training uses CUDA.
        Without it, a resumed run sizes the buffers by the checkpoint it resumed from, and a fresh run's first
        checkpoint allocates its buffer inside its block; later checkpoints reuse the buffers (they grow only
        when the state grows). A sharded state (FSDP2, DTensor): every rank makes the host copies of its shards
        ahead (DCP's stager, in its staging thread). Plain states: nothing happens on ranks other than 0 (their
        files are discarded); nothing for a synchronous run.
        """
        parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": extra}
        if self.checkpoint_async:
            self._checkpoints.prepare(parts, now=self._iterated and self.step > self.start_step)

    def interruptible(self) -> Any:
        """A block in which a stop signal raises :class:`gwenlake_hpc.runtime.signals.StopInterrupt` at once (see
        :meth:`StopRequest.interrupting`); used by short fits, which have nothing to save half-way."""
        return self._stop.interrupting()
