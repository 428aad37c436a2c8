"""The Run's loop advanced from a framework's callbacks: one optimizer step of the framework is one Run step.

Responsibilities:

- the step boundary: :meth:`DrivenLoop.advance` is called once before the framework's first optimizer step and
  once after each one (after its checkpoint, when the step writes one). It runs one turn of
  :meth:`gwenlake_hpc.runtime.run.Run.steps`, so the stop decision (agreed by every rank), ``at_eval``,
  ``stopping``, the heartbeat, the ledger and the step times are the Run's, unchanged;
- the step counter: the framework's own step (the HF ``TrainerState.global_step``, Lightning's
  ``trainer.global_step``) must equal ``run.step`` at the end of every step (:meth:`check_step`);
- the end: :attr:`ended` once the Run's loop is over (the last step, or a stop request after a sealed
  checkpoint); :meth:`close` ends it when the framework stopped on its own first.

Not here: the checkpoint files (each framework module writes its own into ``run.checkpoint()``), the signals
(the job's, as for any training).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

log = logging.getLogger("gwenlake_hpc.integrations")


class DrivenLoop:
    """``run.steps(total=...)`` turned from the outside, one call of :meth:`advance` a step boundary.

    Args:
        run: the job's :class:`~gwenlake_hpc.runtime.run.Run` (the ``run`` argument of the training function).
        total: the framework's number of optimizer steps (HF ``state.max_steps``, Lightning's
            ``trainer.estimated_stepping_batches``); the Run's ``total_steps`` becomes it.
        framework: the framework's name, for messages.
    """

    def __init__(self, run: Any, total: int, framework: str):
        self.run, self.total, self.framework = run, int(total), framework
        self._steps: Iterator[tuple[int, Any]] = run.steps(total=self.total)
        self.ended = False
        self.in_step = False

    def advance(self) -> bool:
        """End the step just done (if any) and begin the next one.

        Returns:
            True when the framework may run the next step (``run.step`` is its number, ``run.at_eval`` and
            ``run.stopping`` are set); False when the Run's loop is over: the framework must stop now (its last
            step was the run's last, or a stop request arrived after a sealed checkpoint). ``run.evicted`` then
            says which.
        """
        if self.ended:
            return False
        try:
            next(self._steps)
        except StopIteration:
            self.ended, self.in_step = True, False
            return False
        except BaseException:
            self.ended = True
            raise
        self.in_step = True
        return True

    def stop_requested(self) -> bool:
        """Whether a stop was asked for on any rank (one decision for all: a collective in a multi-task run,
        called by every rank at the same step; a flag read in one process). A framework that can checkpoint the
        step just done asks this at its boundary, before it decides to checkpoint: it then ends after that step
        (its checkpoint sealed, :meth:`advance` returns False), not after one more (the Run's own loop agrees
        only before the next step)."""
        from ..runtime.distributed import agree_on_stop

        return agree_on_stop(self.run.dist, self.run._stop)  # noqa: SLF001 - the Run's agreement, one step earlier

    def check_step(self, framework_step: int) -> None:
        """Refuse a framework step counter other than the Run's at the end of a step.

        Raises:
            RuntimeError: they differ (the checkpoint resumed from is not the framework's, or the framework
                was given a ``max_steps`` of its own after the Run began).
        """
        if self.in_step and int(framework_step) != self.run.step:
            raise RuntimeError(f"{self.framework}: its step counter is {framework_step} where the Run's is "
                               f"{self.run.step}; resume it only through gwenlake_hpc (run.resume_path), and do not "
                               f"change max_steps during the training")

    def close(self) -> None:
        """End the Run's loop when the framework's ended first (its own early stopping, the end of its data):
        a checkpoint in flight is still sealed. Nothing when the Run's loop is over already."""
        if self.ended:
            return
        self.ended = True
        if self.in_step:
            log.warning("%s stopped at step %d of %d on its own (early stopping, the end of its data?): the run "
                        "ends there", self.framework, self.run.step, self.total)
        self._steps.close()
