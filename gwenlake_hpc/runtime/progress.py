"""Progress: a tqdm bar on a terminal, periodic log lines in a batch job (whose log is a file)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from ..base import suspend

log = logging.getLogger("gwenlake_hpc.progress")


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Shows step, loss, steps/s and ETA.

    Args:
        total: the last step (None if unknown).
        start: the step the loop resumes after (0 on a fresh run).
        mode: ``"auto"`` (bar when stderr is a terminal, else lines), ``"bar"``, ``"lines"`` or ``"off"``.
        every_s: seconds between two log lines in ``lines`` mode.
        suspended_of: gives the seconds this process was stopped so far (``scontrol suspend``), left out of the
            speed and the ETA; None: :func:`gwenlake_hpc.base.suspend.watch`'s count in ``lines`` mode.
    """

    def __init__(self, total: int | None, start: int = 0, mode: str = "auto", every_s: float = 30.0,
                 suspended_of: Callable[[], float] | None = None):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self.total = total
        self.start = start
        self.every_s = every_s
        if suspended_of is None and mode == "lines":
            suspended_of = suspend.watch().suspended_s
        self._suspended_of = suspended_of or (lambda: 0.0)
        self._t0 = time.monotonic()
        self._susp0 = self._suspended_of()
        self._last_line = self._t0
        self._bar = None
        self.loss: float | None = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int) -> None:
        """Record that ``step`` is done (cheap: a bar refresh or a clock check)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if self.loss is not None:
                self._bar.set_postfix(loss=f"{self.loss:.4g}", refresh=False)
        elif self.mode == "lines":
            now = time.monotonic()
            if now - self._last_line >= self.every_s or step == self.total:
                self._last_line = now
                log.info(self.line(step, now))

    def line(self, step: int, now: float | None = None) -> str:
        """One status line: ``step 1000/30000 (3.3%) loss 0.4213 812.0 steps/s ETA 0:00:35``; the speed over the
        time since the loop began (``now``: ``time.monotonic()`` s) less the time the process was stopped."""
        now = time.monotonic() if now is None else now
        stopped = max(0.0, self._suspended_of() - self._susp0)
        rate = (step - self.start) / max(now - self._t0 - stopped, 1e-9)
        parts = [f"step {step}" + (f"/{self.total} ({100 * step / self.total:.1f}%)" if self.total else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        parts.append(f"{rate:.1f} steps/s")
        if self.total and rate > 0:
            parts.append(f"ETA {_fmt_eta((self.total - step) / rate)}")
        return " ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
