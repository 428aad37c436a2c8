"""Where a training's time goes between two evaluations: the accumulators the loop, ``run.log`` and
``run.checkpoint()`` add to, and the ``time/*`` breakdown made of them.

:class:`StepTimes` is one object the Run builds and hands to its metrics (:mod:`.run_metrics`) and checkpoints
(:mod:`.run_checkpoints`). It owns:

- the seconds spent since the window began waiting for input, in whole steps (checkpoint and tracking
  included), blocked in ``run.checkpoint()`` blocks and in ``run.log()``;
- how many steps the window counted, and the step its breakdown was last made at;
- when the window, the current step and the current checkpoint block began (``time.perf_counter`` seconds);
- :meth:`StepTimes.breakdown`: the per-step averages, after which a new window begins.

Plain attributes with ``__slots__``: the loop adds to them at every step, so each is one attribute access.
"""

from __future__ import annotations

import time


class StepTimes:
    """Time accumulators of the current window (since the last breakdown), in seconds.

    Attributes:
        input_s: waiting for the next batch.
        step_s: inside whole steps (from the batch's arrival to the loop's next turn), checkpoint blocks and
            ``run.log`` included.
        checkpoint_s: inside ``run.checkpoint()`` blocks (snapshot or write, and whatever the block does).
        tracking_s: inside ``run.log()``.
        steps_timed: steps the window counted.
        window_start: when the window began (``perf_counter`` s; 0.0 before the first breakdown).
        step_start: when the current step began (its batch arrived).
        block_start: when the current checkpoint block began.
        logged_step: the step of the last breakdown, or None: that step's breakdown was made inside its
            checkpoint block (before the seal), and what remained of it counts in the next window.
        checkpoint_total_s: inside ``run.checkpoint()`` blocks since the Run began (never reset: the goodput
            ledger's checkpoint stalls).
    """

    __slots__ = ("input_s", "step_s", "checkpoint_s", "tracking_s", "steps_timed", "window_start", "step_start",
                 "block_start", "logged_step", "checkpoint_total_s")

    def __init__(self) -> None:
        self.input_s = self.step_s = self.checkpoint_s = self.tracking_s = 0.0
        self.steps_timed = 0
        self.window_start = self.step_start = self.block_start = 0.0
        self.logged_step: int | None = None
        self.checkpoint_total_s = 0.0

    def breakdown(self, step: int, during_step: bool = False) -> dict[str, float]:
        """The window's seconds per step, named as logged, then start a new window at ``step``.

        ``time/input`` waiting for the next batch, ``time/compute`` the steps minus their checkpoint blocks
        and tracking, ``time/checkpoint`` inside ``run.checkpoint()`` blocks, ``time/tracking`` inside
        ``run.log()``; each a mean over the window's steps (1 when it counted none).

        ``during_step``: made from the checkpoint block of ``step`` before its seal; the step and the block
        count up to now, and what remains of them counts in the next window.
        """
        n, step_s, checkpoint_s = self.steps_timed, self.step_s, self.checkpoint_s
        now = time.perf_counter()
        if during_step:
            n += 1
            step_s += now - max(self.step_start, self.window_start)
            checkpoint_s += now - max(self.block_start, self.window_start)
        n = max(n, 1)
        compute = max(step_s - checkpoint_s - self.tracking_s, 0.0)
        values = {"time/input": self.input_s / n, "time/compute": compute / n, "time/checkpoint": checkpoint_s / n,
                  "time/tracking": self.tracking_s / n}
        self.input_s = self.step_s = self.checkpoint_s = self.tracking_s = 0.0
        self.steps_timed = 0
        self.logged_step, self.window_start = step, now
        return values
