"""``job.eval_every=auto``: the steps between two evaluations (checkpoints) chosen from the run's own measurements.

The Young/Daly optimum: a checkpoint costing C seconds of the loop, taken every T seconds, under unannounced
interruptions (SIGKILL, a lost node, out of memory, a hang) every M seconds on average, loses about C/T + T/(2M)
of the time; the minimum is at T = sqrt(2 C M), with a goodput of about 1 - sqrt(2 C / M). Announced evictions
(preemption, time limit) need no interval: the Run writes a checkpoint at the stop signal.

Responsibilities of :class:`AutoInterval`, one per Run with ``eval_every=auto``:

- measure, in the loop, the plain steps' mean time and each evaluation step's time; C is the difference (the
  checkpoint block, the evaluation and anything else the step does only at ``at_eval``);
- at each evaluation choose T = sqrt(2 C M), never shorter than the previous checkpoint's background write (a
  checkpoint waits for the one in flight) and never longer than ``job.max_eval_interval_s``, turned into steps
  by the plain step time and never under :data:`MIN_INTERVAL_STEPS` (so that every interval measures a plain
  step again: one slow plain step cannot pin the run to an evaluation at every step); log it
  (``checkpoint/interval_steps``, ``checkpoint/interval_s``, ``checkpoint/cost_s``);
- in a multi-rank run, take rank 0's choice on every rank (a broadcast at each evaluation): every rank must
  evaluate at the same steps.

The first evaluation of a start comes at its third step (one step to warm up, one plain step measured, then
C is measured); M comes
from the job (:mod:`gwenlake_hpc.runtime.ledger`: the run's allocated time over its unannounced interruptions,
``job.mtbf_h`` until there was one).
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: ``job.mtbf_h`` by default: a mean of one unannounced interruption a day.
DEFAULT_MTBF_H = 24.0
#: ``job.max_eval_interval_s`` by default: never more than 30 minutes of steps between two checkpoints.
DEFAULT_MAX_INTERVAL_S = 1800.0
#: What ``job.eval_every`` accepts besides a whole number.
AUTO = "auto"
#: The shortest interval ``auto`` chooses, in steps: one evaluation step and at least one plain step measured.
MIN_INTERVAL_STEPS = 2


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The interval sqrt(2 C M) in seconds for a checkpoint cost ``cost_s`` and a mean time between
    interruptions ``mtbf_s`` (both seconds, >= 0; M may be ``inf``). 0.0 for a free checkpoint (C = 0, any M),
    ``inf`` for C > 0 and M infinite; never NaN."""
    cost, mtbf = max(cost_s, 0.0), max(mtbf_s, 0.0)
    if cost == 0.0 or mtbf == 0.0:
        return 0.0
    return math.sqrt(2.0 * cost * mtbf)


def expected_goodput(cost_s: float, mtbf_s: float) -> float:
    """The analytic optimum 1 - sqrt(2 C / M) (first order; 0 when the checkpoint costs more than that)."""
    return max(0.0, 1.0 - math.sqrt(2.0 * max(cost_s, 0.0) / mtbf_s)) if mtbf_s > 0 else 0.0


class AutoInterval:
    """Chooses the next evaluation step of a Run (see the module's docstring).

    Args:
        start_step: the step the Run resumed from (0 for a new run).
        mtbf_s: gives M, seconds (called at each evaluation, on rank 0).
        max_interval_s: ``job.max_eval_interval_s``.
        write_s: gives the previous background write's seconds, or None (no background write yet).
        broadcast: rank 0's value on every rank (``Dist.broadcast``), or None in a single process.
        log: logs the chosen interval's metrics at a step (rank 0's tracker), or None.

    Attributes:
        next_step: the next step with ``at_eval`` true.
        interval_steps, interval_s, cost_s: the last choice (None before the first).
    """

    def __init__(self, start_step: int, mtbf_s: Callable[[], float], max_interval_s: float = DEFAULT_MAX_INTERVAL_S,
                 write_s: Callable[[], float | None] = lambda: None, broadcast: Callable[[Any], Any] | None = None,
                 log: Callable[[dict[str, float], int], None] | None = None):
        self.next_step = int(start_step) + 3
        self._first = int(start_step) + 1
        self._mtbf_s, self._max_s, self._write_s = mtbf_s, float(max_interval_s), write_s
        self._broadcast, self._log = broadcast, log
        self._plain_s, self._plain_n = 0.0, 0
        self._plain_mean = 0.0  # seconds of a plain step, from the last interval that had one
        self.interval_steps: int | None = None
        self.interval_s: float | None = None
        self.cost_s: float | None = None

    def observe(self, step: int, whole_s: float, at_eval: bool) -> None:
        """Step ``step`` took ``whole_s`` seconds (``at_eval``: it was an evaluation step); at an evaluation the
        next one is chosen. The start's first step (warm-up: compilation, caches) is not measured."""
        if step == self._first and not at_eval:
            return
        if not at_eval:
            self._plain_s += whole_s
            self._plain_n += 1
            return
        self.choose(step, whole_s)

    def choose(self, step: int, eval_s: float) -> int:
        """Set :attr:`next_step` after the evaluation step ``step`` that took ``eval_s`` seconds; returns the
        interval in steps (>= :data:`MIN_INTERVAL_STEPS`)."""
        if self._plain_n:
            self._plain_mean = self._plain_s / self._plain_n
        plain = self._plain_mean
        cost = max(eval_s - plain, 0.0)
        interval = young_daly_s(cost, self._mtbf_s())
        floor = self._write_s() or 0.0
        interval = min(max(interval, floor), self._max_s)
        steps = int(round(interval / plain)) if plain > 0 and math.isfinite(interval / plain) else 1
        steps = max(MIN_INTERVAL_STEPS, steps)
        if self._broadcast is not None:
            steps = int(self._broadcast(steps))
        self.interval_steps, self.interval_s, self.cost_s = steps, interval, cost
        self.next_step = step + steps
        self._plain_s, self._plain_n = 0.0, 0  # each interval is measured on the steps since the last one
        if self._log is not None:
            self._log({"checkpoint/interval_steps": float(steps), "checkpoint/interval_s": interval,
                       "checkpoint/cost_s": cost}, step)
        return steps
