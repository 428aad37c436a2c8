"""The background thread that seals asynchronous checkpoints, at most one in flight."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from ...base.errors import ConfigError
from ...base.waits import waiting_for

log = logging.getLogger("gwenlake_hpc.checkpoints")


class BackgroundWriter:
    """Runs one sealing job at a time in a daemon thread and keeps its error for the training thread.

    ``submit`` first waits for the job in flight, so host memory holds at most one snapshot. A failed job's
    exception is sticky: every later :meth:`submit`, :meth:`wait` and :meth:`raise_if_failed` raises it again,
    so a ``try``/``except`` around one checkpoint block cannot make a run go on without checkpoints. The thread is
    a daemon: a forced exit (a second Ctrl-C) does not wait for it, and the partial directory it leaves is
    removed at the next start.
    """

    def __init__(self, name: str = "gwenlake-checkpoint-writer"):
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self._logged = False
        #: seconds the training thread spent waiting here for a job in flight (summed)
        self.waited_s = 0.0

    @property
    def busy(self) -> bool:
        """True while a job runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], Any]) -> None:
        """Wait for the job in flight (raising its error), then start ``job`` in the background."""
        self.wait()

        def target() -> None:
            try:
                self._result = job()
            except BaseException as exc:  # kept for the training thread, which decides what to do
                self._error, self._logged = exc, False

        self._thread = threading.Thread(target=target, name=self._name, daemon=True)
        self._thread.start()

    def wait(self, raise_error: bool = True) -> Any:
        """Block until no job is in flight; returns the last job's result.

        Raises:
            the failed job's exception (every time), unless ``raise_error`` is false (it is then logged once).
        """
        t = self._thread
        if t is not None and t.is_alive():
            import time

            start = time.perf_counter()
            with waiting_for(t):  # a hang's verdict names this thread, not the join
                t.join()
            self.waited_s += time.perf_counter() - start
        return self.raise_if_failed(raise_error)

    def raise_if_failed(self, raise_error: bool = True) -> Any:
        """Raise the error of a finished job without waiting for a running one; else its result."""
        if self._error is not None and not self.busy:
            if raise_error:
                raise self._error
            if not self._logged:  # kept for a later wait() that raises, logged once
                log.error("a background checkpoint write failed: %s", self._error)
                self._logged = True
        return self._result


def async_default() -> bool:
    """Whether checkpoints are asynchronous by default: ``GWENLAKE_CHECKPOINT_ASYNC`` (on unless 0/false/no/off).

    Raises:
        ConfigError: another value.
    """
    raw = os.environ.get("GWENLAKE_CHECKPOINT_ASYNC", "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"GWENLAKE_CHECKPOINT_ASYNC={raw!r}: use 1 (asynchronous checkpoints, the default) or 0")
