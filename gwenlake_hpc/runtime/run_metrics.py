"""The Run's metrics: :meth:`Run.log <RunMetrics.log>`, the time breakdown, non-finite losses, the summary.

A mixin of :class:`gwenlake_hpc.runtime.run.Run` (its other halves: the loop in :mod:`gwenlake_hpc.runtime.run`, checkpoints in
:mod:`gwenlake_hpc.runtime.run_checkpoints`). It reads the Run's ``tracker``, ``step``, ``is_main``, ``_progress``,
``_on_nonfinite`` and the time accumulators ``_times``/``_steps_timed``; it never blocks on tracking (the
tracker queues points, :mod:`gwenlake_hpc.stores.tracking.tracker`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Mapping

from ..base.errors import NonFiniteError
from ..stores.tracking.metric_tags import run_tag, tagged_series

log = logging.getLogger("gwenlake_hpc.run")


class RunMetrics:
    """Metrics of a :class:`gwenlake_hpc.runtime.run.Run` (mixed into it; not used on its own)."""

    tracker: Any
    step: int
    _summary: dict[str, float]
    _tagged_series: dict[str, dict[str, str]]
    _times: dict[str, float]
    _steps_timed: int
    _window_start: float
    _t_step: float
    _t_block: float
    _times_logged_step: int | None
    _on_nonfinite: str
    _warned_nonfinite: set[str]

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

    def _log_times(self, step: int, during_step: bool = False) -> None:
        """Log where the steps since the last evaluation spent their time, in seconds per step.

        ``time/input`` waiting for the next batch, ``time/compute`` the step itself minus what follows,
        ``time/checkpoint`` inside ``run.checkpoint()`` blocks (snapshot or write, and whatever the block
        does), ``time/tracking`` inside ``run.log()``. Logged at each evaluation step (rank 0), not part of
        :meth:`summary`: a user sees at a glance whether input, model, checkpoints or tracking is the limit.

        ``during_step``: called from the checkpoint block of ``step`` before its seal; the step and the block
        count up to now, and what remains of them counts in the next window.
        """
        t = self._times
        n, step_s, checkpoint_s = self._steps_timed, t["step"], t["checkpoint"]
        now = time.perf_counter()
        if during_step:
            n += 1
            step_s += now - max(self._t_step, self._window_start)
            checkpoint_s += now - max(self._t_block, self._window_start)
        n = max(n, 1)
        compute = max(step_s - checkpoint_s - t["tracking"], 0.0)
        values = {"time/input": t["input"] / n, "time/compute": compute / n, "time/checkpoint": checkpoint_s / n,
                  "time/tracking": t["tracking"] / n}
        if self.is_main:
            self.tracker.log_metrics(values, step)
        self._times = dict.fromkeys(t, 0.0)
        self._steps_timed = 0
        self._times_logged_step, self._window_start = step, now

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
