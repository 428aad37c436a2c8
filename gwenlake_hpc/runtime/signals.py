"""Eviction: termination signals become a flag that the training loop reads between two steps.

SLURM sends SIGTERM on preemption and scancel, and the ``--signal`` of the job (SIGUSR2 here) ahead of the time
limit; Ctrl-C sends SIGINT. The handlers only record which signal arrived and when: no I/O, no exit, no
exception inside a step. A second Ctrl-C raises KeyboardInterrupt, for a person who really wants out now.

A training function, or a library it calls (profilers, loggers, experiment trackers), may install its own
handler for one of these signals, which would silently swallow an eviction. :meth:`StopRequest.check_handlers`
(called by the Run at every step boundary) notices it, puts ours back chained to theirs (ours records the stop,
then theirs runs), and warns once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from types import FrameType
from typing import Iterator

log = logging.getLogger("gwenlake_hpc.signals")

#: Signals that ask a training to stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


# signal.getsignal without its conversion of the handler into a ``signal.Handlers`` member, which raises and
# catches a ValueError for any handler that is a function (~1.7 us a signal): the check between two steps
# reads the handlers with it, and with signal.getsignal only one that is not ours.
try:
    from _signal import getsignal as _getsignal  # the C function signal.getsignal wraps (CPython)
except ImportError:  # pragma: no cover - another interpreter
    _getsignal = signal.getsignal


class StopInterrupt(BaseException):
    """Raised by a stop signal inside :meth:`StopRequest.interrupting` (a BaseException: ``except Exception`` in
    user code does not swallow it)."""


class StopRequest:
    """A stop flag set by signal handlers (or by :meth:`request`), read by the Run between steps.

    Attributes:
        signum: the first signal received (``signal.Signals``), or None.
        received_at: ``time.monotonic()`` when it arrived, or None.
        reason: a short text for logs (``"SIGTERM"``, or the reason given to :meth:`request`).
    """

    def __init__(self) -> None:
        self.signum: signal.Signals | None = None
        self.received_at: float | None = None
        self.reason: str | None = None
        self._previous: dict[int, object] = {}
        self._ours: dict[int, object] = {}  # signal -> the handler we installed (ours, or ours chained)
        self._sigints = 0

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self.reason is not None

    def request(self, reason: str) -> None:
        """Ask for a stop without a signal (tests, other ranks, a programme's own logic)."""
        if self.reason is None:
            self.received_at = time.monotonic()
            self.reason = reason

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                raise KeyboardInterrupt
        if self.reason is None:
            self.signum = signal.Signals(signum)
            self.received_at = time.monotonic()
            self.reason = self.signum.name
        if getattr(self, "_interrupting", False):
            self._interrupting = False  # once: the code that catches it may clean up undisturbed
            self.interrupted = True
            raise StopInterrupt(self.reason)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """Within the block a stop signal also raises :class:`StopInterrupt` where the code is (after recording
        the stop as usual). For work with nothing to save half-way (a short fit), which then ends at once
        instead of running to its end only to be discarded. Main thread only (where handlers run)."""
        self._interrupting = True
        try:
            if self.requested:  # asked before the block began
                raise StopInterrupt(self.reason or "stop")
            yield
        finally:
            self._interrupting = False

    #: True once a stop signal raised :class:`StopInterrupt` (the start ended outside its loop, at once).
    interrupted = False

    def arm(self) -> None:
        """Until :meth:`disarm`, a stop signal also raises :class:`StopInterrupt` where the main thread is (once).

        For the time outside the training loop, where no step boundary will read the flag: the start-up (imports,
        Hydra, the user's module at import), then the training function before its loop (building the model,
        loading data). A process blocked there (a stalled import, a slow file system) ends at once on SLURM's or
        torchrun's SIGTERM instead of being SIGKILLed 30 s later. The Run disarms it as its loop begins.

        Raises:
            StopInterrupt: a stop was already requested (recorded while disarmed).
        """
        if self.requested:
            self.interrupted = True
            raise StopInterrupt(self.reason or "stop")
        self._interrupting = True

    def disarm(self) -> None:
        """A stop signal only records the stop again (the loop, or the job's own set-up and end, reads it)."""
        self._interrupting = False

    def install(self, signals: tuple[int, ...] = STOP_SIGNALS) -> bool:
        """Install the handlers; the previous ones are kept for :meth:`uninstall`.

        Returns False (and installs nothing) outside the main thread, where Python cannot set handlers.
        """
        if threading.current_thread() is not threading.main_thread():
            return False
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth > 1:  # already installed by an outer owner (the SLURM entry point)
            return True
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)
            self._ours[s] = self._handle
        return True

    def reclaim(self) -> None:
        """Put our plain handlers back on every installed signal, dropping whatever replaced them (submitit's,
        installed after ours in the job step: they would requeue or end the job from inside a signal handler)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self._ours:
            signal.signal(s, self._handle)
            self._ours[s] = self._handle

    def check_handlers(self) -> list[str]:
        """Put our handlers back where someone replaced them since :meth:`install`, chained to theirs.

        Called by the Run between two steps (main thread). For each stop signal whose handler is no longer
        ours: ours is installed again, and calls theirs after recording the stop (unless theirs is the default
        action or "ignore", which would kill the training mid-step or do nothing). One warning a signal.

        Returns:
            The names of the signals whose handler was put back (empty almost always).
        """
        if not self._ours or threading.current_thread() is not threading.main_thread():
            return []
        fixed = []
        for s, ours in self._ours.items():
            current = _getsignal(s)
            if current is ours or current == ours:
                continue
            current = signal.getsignal(s)
            chained = _Chained(self._handle, current)
            signal.signal(s, chained)
            self._ours[s] = chained
            name = signal.Signals(s).name
            fixed.append(name)
            log.warning("the handler of %s was replaced (by %s) during the training: gwenlake_hpc's is put back, "
                        "chained to it, so that an eviction still ends the loop at a step boundary", name,
                        _describe(current))
        return fixed

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install` (at the outermost uninstall)."""
        self._depth = max(getattr(self, "_depth", 1) - 1, 0)
        if self._depth:
            return
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()
        self._ours.clear()

    def __enter__(self) -> "StopRequest":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


_PROCESS_STOP: StopRequest | None = None


def install_early() -> StopRequest:
    """Install the stop handlers at the very start of a training process, and keep them until it exits.

    Called by the command lines before Hydra, torch and the user's module are imported: a stop signal during
    start-up (SLURM may signal early) or after the version was committed is recorded instead of killing the
    process with the default action (exit 143). The job then uses this same :class:`StopRequest`
    (:func:`process_stop`): it arms it (:meth:`StopRequest.arm`) as it begins, so a stop recorded while Hydra
    composed ends the start there with exit 75, and one while the user's module imports ends it at once (never
    inside Hydra or OmegaConf, whose state an exception raised anywhere would corrupt).
    """
    global _PROCESS_STOP
    if _PROCESS_STOP is None:
        _PROCESS_STOP = StopRequest()
        _PROCESS_STOP.install()
    return _PROCESS_STOP


def release_early() -> StopRequest | None:
    """Give the stop signals back their previous handlers (a command that turned out to submit and wait, where
    Ctrl-C must interrupt at once). Returns the early StopRequest, whose ``signum`` tells a signal already
    received, or None."""
    global _PROCESS_STOP
    stop, _PROCESS_STOP = _PROCESS_STOP, None
    if stop is not None:
        stop.uninstall()
    return stop


def ignore_from_now_on() -> None:
    """Ignore the stop signals for the rest of the process (its work is done, it only exits).

    Python puts back the default actions while the interpreter shuts down (a SIGTERM then exits 143 after a
    committed version); an ignored signal stays ignored. Only where :func:`install_early` ran.
    """
    if _PROCESS_STOP is None or threading.current_thread() is not threading.main_thread():
        return
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def process_stop() -> StopRequest | None:
    """The StopRequest of :func:`install_early`, or None."""
    return _PROCESS_STOP


class _Chained:
    """Our handler, then the one a training installed over it (when that one is a function)."""

    def __init__(self, ours: object, theirs: object) -> None:
        self.ours, self.theirs = ours, theirs

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.ours(signum, frame)  # type: ignore[operator]
        if callable(self.theirs):
            self.theirs(signum, frame)


def _describe(handler: object) -> str:
    if handler in (signal.SIG_DFL, signal.SIG_IGN, None):
        return {signal.SIG_DFL: "the default action", signal.SIG_IGN: "ignore"}.get(handler, "a C handler")
    mod = getattr(handler, "__module__", None) or "?"
    return f"{mod}.{getattr(handler, '__qualname__', type(handler).__name__)}"

