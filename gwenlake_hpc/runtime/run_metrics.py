"""The Run's metrics: what :meth:`Run.log <gwenlake_hpc.runtime.run.Run.log>` does, the time breakdown,
non-finite losses, the summary.

:class:`RunMetrics` is an object the Run builds in its ``__init__`` and delegates ``run.log`` and
``run.summary()`` to (the loop is in :mod:`gwenlake_hpc.runtime.run`, checkpoints in
:mod:`gwenlake_hpc.runtime.run_checkpoints`). It owns:

- the values handed to tracking: ``run.log``'s numbers, named by their tags (a series' tags recorded on the
  run once), forwarded to the tracker without blocking on it (the tracker queues points,
  :mod:`gwenlake_hpc.stores.tracking.tracker`);
- the latest value of every metric (the summary);
- non-finite values: a NaN loss stops the run (``job.on_nonfinite``), other metrics warn once;
- the ``time/*`` breakdown logged at evaluation steps, from the Run's :class:`~.timing.StepTimes`, to which
  it adds the seconds spent in ``run.log``;
- the loss shown by the progress display.

It reads the current step only as an argument from the Run, and waits for a checkpoint in flight through
the ``wait_for_checkpoint`` callable it is given.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping

from ..base.errors import NonFiniteError
from ..stores.tracking.metric_tags import run_tag, tagged_series
from .progress import Progress
from .timing import StepTimes

log = logging.getLogger("gwenlake_hpc.run")


class RunMetrics:
    """The metrics of one Run (see the module's docstring for what it owns).

    Args:
        tracker: a ``gwenlake_hpc.stores.tracking`` Tracker or NullTracker (``log_metrics``, ``set_tags``).
        times: the Run's time accumulators; ``run.log`` adds its seconds to ``tracking_s``.
        is_main: whether this process is rank 0 (the one that logs the breakdown and records tags).
        on_nonfinite: ``stop`` or ``warn`` (``job.on_nonfinite``).
        wait_for_checkpoint: ``wait_for_checkpoint(raise_error)`` -> the newest sealed checkpoint or None; called
            before a :class:`NonFiniteError` names the checkpoint that is kept.

    Attributes:
        progress: the loop's progress display (it shows the latest ``loss``), set by the loop; None before.
        last_times: this rank's latest ``time/*`` breakdown (seconds per step), compared across ranks.
    """

    def __init__(self, tracker: Any, times: StepTimes, is_main: bool, on_nonfinite: str,
                 wait_for_checkpoint: Callable[[bool], Any]):
        self.tracker = tracker
        self.times = times
        self.is_main = is_main
        self.on_nonfinite = on_nonfinite
        self._wait_for_checkpoint = wait_for_checkpoint
        self.progress: Progress | None = None
        self.values: dict[str, float] = {}  #: the latest value of every metric (restored ones included)
        self.last_times: dict[str, float] = {}
        self._tagged_series: dict[str, dict[str, str]] = {}  # series -> its tags (recorded on the run already)
        self._warned_nonfinite: set[str] = set()

    def log(self, metrics: Mapping[str, Any], step: int | None, tags: Mapping[str, Any] | None,
            current_step: int) -> None:
        """What ``run.log(metrics, step, tags)`` does (:meth:`gwenlake_hpc.runtime.run.Run.log` documents the
        arguments and the errors raised): record the values, never blocking on tracking.

        ``current_step`` is the Run's step: the values' step when neither ``step`` nor a ``step``/``epoch`` tag
        gives one.

        Raises:
            ValueError: a bad tag name, or a ``step``/``epoch`` tag that is not a whole number.
            NonFiniteError: a NaN or infinite loss with ``on_nonfinite="stop"``.
        """
        tag_step = None
        if tags:  # the plain path (every step, no tags) does no naming work
            series_of, tag_step = self._tagged_names(metrics, tags)
            values = {series_of[k]: float(v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        else:  # a Python float as it is (float() of one is itself): no failed hasattr for a framework's logs
            values = {k: v if type(v) is float else float(v.item() if hasattr(v, "item") else v)
                      for k, v in metrics.items()}
        step = int(step) if step is not None else tag_step if tag_step is not None else current_step
        # one test when all are finite: a NaN or infinite value makes the sum so (finite values whose sum
        # overflows are then each tested, and pass)
        if not math.isfinite(sum(values.values())):
            for k, v in values.items():
                if not math.isfinite(v):
                    self._non_finite(k, v, step)
        self.values.update(values)
        if self.progress is not None and "loss" in values:
            self.progress.loss = values["loss"]
        t0 = time.perf_counter()
        self.tracker.log_metrics(values, step)
        self.times.tracking_s += time.perf_counter() - t0

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

    def log_times(self, step: int, during_step: bool = False) -> None:
        """Log where the steps since the last evaluation spent their time, in seconds per step (rank 0), and
        begin a new window (:meth:`StepTimes.breakdown`; ``during_step`` as there).

        Logged at each evaluation step, not part of the summary: a user sees at a glance whether input, model,
        checkpoints or tracking is the limit.
        """
        values = self.last_times = self.times.breakdown(step, during_step)
        if self.is_main:
            self.tracker.log_metrics(values, step)

    def _non_finite(self, key: str, value: float, step: int) -> None:
        """A metric is NaN or infinite: stop on a loss (unless ``warn``), warn once otherwise.

        Raises:
            NonFiniteError: a loss, with ``on_nonfinite="stop"``; the message names metric, step, the
                newest checkpoint (kept) and the setting that lets the run go on.
        """
        if "loss" in key.lower() and self.on_nonfinite == "stop":
            ck = self._wait_for_checkpoint(False)
            raise NonFiniteError(
                f"metric {key!r} is {value} at step {step}: the training diverged or its data holds NaN; the "
                f"newest checkpoint ({ck.path if ck else 'none'}) is kept. Lower the learning rate or clean the "
                "data, or set job.on_nonfinite=warn to go on anyway")
        if key not in self._warned_nonfinite:
            self._warned_nonfinite.add(key)
            log.warning("metric %r is %s at step %d (and may be again: warned once)", key, value, step)

    def restore(self, saved: Mapping[str, Any] | None, attached: Mapping[str, Any] | None) -> None:
        """Take the latest values of a resumed run: ``saved``, the Run state's ``metrics`` (what ``run.log``
        recorded up to the checkpoint), then ``attached``, the checkpoint's own ``ck.metrics`` (logged after the
        state was taken). Either may be None (a checkpoint of an older version holds no ``metrics``)."""
        for values in (saved, attached):
            self.values.update({str(k): float(v) for k, v in (values or {}).items()})

    def summary(self, step: int) -> dict[str, float]:
        """The latest value of every metric logged in this run (the restored ones included), plus ``step`` (the Run's last step done).

        The caller waits for a checkpoint in flight first (its metrics are part of the summary)."""
        return {**self.values, "step": float(step)}
