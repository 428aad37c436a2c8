"""Suspension: the seconds this process spent stopped (``scontrol suspend``, SIGSTOP, Ctrl-Z), and the helper
processes that must stop and continue with it.

``scontrol suspend`` stops every process of a job step (SLURM sends SIGSTOP; ``scontrol resume`` sends SIGCONT).
``time.monotonic()`` and ``time.perf_counter()`` (CLOCK_MONOTONIC) go on advancing while a process is stopped, so
a step that spans a suspension looks as long as the suspension: the goodput ledger would count it as training
and the progress line's ETA would be computed from a false speed. Two facts say "this process was stopped":

- a gap: :class:`SuspendWatch`'s sampler thread wakes every :data:`SAMPLE_S`; a stopped process has no thread
  running, so after the resume the clock has jumped by the stop's length since its last wake;
- a SIGCONT: a handler that only counts (Python runs it in the main thread, at its next bytecode).

A gap is counted as suspended time only when a SIGCONT came with it: a gap alone is also what a thread starved of
the GIL sees (a long C call that holds it), which is not a suspension. The suspension is the gap less one sampling
period (the stop began somewhere in that period: never counted more than it was).

A helper process in a session of its own (the tracking delivery process) is not stopped by SLURM, which
signals the job step's process group: it follows its parent itself (:func:`follow_parent_stops`: it stops
itself with SIGSTOP while its parent is stopped), and the parent continues it (:meth:`SuspendWatch.follow`:
the sampler sends SIGCONT to a follower it finds stopped while the parent itself runs).

Standard library only (a layer ``base`` module): the Run, the ledger and the tracking store all use it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque

from .processes import proc_state

#: Seconds between two wakes of the sampler thread (the precision of a suspension's length).
SAMPLE_S = 0.25
#: A gap between two wakes longer than this (seconds) may be a suspension (below: scheduling noise).
GAP_S = 1.0
#: Seconds between two looks of a follower at its parent's state.
FOLLOW_S = 0.5


def is_stopped(pid: int) -> bool:
    """True while process ``pid`` is stopped (SIGSTOP, SIGTSTP, a debugger): ``T`` or ``t`` in ``/proc``."""
    return proc_state(pid) in ("T", "t")


class SuspendWatch:
    """Counts the seconds this process was stopped; continues the followers it was given.

    Use the process's one watch (:func:`watch`); it starts its sampler thread on creation and installs the
    SIGCONT handler when created in the main thread (else a suspension is not counted: no confirmation).

    Args:
        sample_s: seconds between two wakes of the sampler (tests shorten it).
        gap_s: the shortest gap counted (seconds).
    """

    def __init__(self, sample_s: float = SAMPLE_S, gap_s: float = GAP_S):
        self.sample_s, self.gap_s = float(sample_s), float(gap_s)
        self._lock = threading.Lock()
        self._last = time.monotonic()  # the newest wake of any thread that observed
        self._conts = 0  # SIGCONTs received (the handler's only work)
        self._conts_used = 0  # SIGCONTs that confirmed gaps already
        self._pending: deque[float] = deque(maxlen=64)  # gaps (seconds, less one period) not confirmed yet
        self._total = 0.0  # confirmed suspended seconds
        self._followers: set[int] = set()
        self.handler_installed = False
        self._thread = threading.Thread(target=self._sample, name="gwenlake-suspend", daemon=True)
        self._thread.start()

    def install_handler(self) -> bool:
        """Install the SIGCONT handler (main thread only; not over a handler someone else installed). Returns
        whether ours is installed. Interrupted system calls restart (``siginterrupt(False)``): a SIGCONT must
        not make a library's blocking call fail with EINTR."""
        if self.handler_installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGCONT) not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGCONT, self._on_cont)
        signal.siginterrupt(signal.SIGCONT, False)
        self.handler_installed = True
        return True

    def _on_cont(self, signum: int, frame: object) -> None:
        self._conts += 1  # a flag only: the gap is measured by whoever observes next

    def _observe(self, now: float) -> None:
        with self._lock:
            gap = now - self._last
            self._last = now
            if gap > self.gap_s:
                self._pending.append(gap - self.sample_s)

    def _sample(self) -> None:
        while True:
            time.sleep(self.sample_s)
            self._observe(time.monotonic())
            if self._followers:
                self._continue_followers()

    def _continue_followers(self) -> None:
        for pid in list(self._followers):
            state = proc_state(pid)
            if state is None or state == "Z":
                self._followers.discard(pid)  # gone: forget it (a new process may reuse the pid later)
            elif state == "T":  # we run, it stopped itself while we were stopped: it goes on with us
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    self._followers.discard(pid)

    def follow(self, pid: int) -> None:
        """From now on, continue process ``pid`` (SIGCONT) whenever the sampler finds it stopped: a helper that
        stops itself while this process is stopped (:func:`follow_parent_stops`)."""
        self._followers.add(int(pid))

    def unfollow(self, pid: int) -> None:
        """Forget process ``pid`` (it ended)."""
        self._followers.discard(int(pid))

    def suspended_s(self) -> float:
        """Seconds this process was stopped since the watch began (monotonic clock; confirmed gaps only).

        From the main thread, a gap that came without a SIGCONT is dropped (the main thread runs Python, so a
        SIGCONT that came would have been counted by now: that gap was a starved thread, not a stop); from
        another thread it stays pending until a SIGCONT confirms it or the main thread drops it."""
        self._observe(time.monotonic())
        with self._lock:
            if self._pending and self._conts > self._conts_used:
                self._total += sum(self._pending)
                self._pending.clear()
                self._conts_used = self._conts
            elif self._pending and threading.current_thread() is threading.main_thread():
                self._pending.clear()
            return self._total


_WATCH: SuspendWatch | None = None
_WATCH_LOCK = threading.Lock()


def watch() -> SuspendWatch:
    """The process's :class:`SuspendWatch` (made on first use; from the main thread it installs the SIGCONT
    handler, from another thread the next call from the main thread does)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = SuspendWatch()
    _WATCH.install_handler()
    return _WATCH


def follow_parent_stops(ppid: int, every_s: float = FOLLOW_S) -> threading.Thread:
    """In a helper process: a thread that stops this whole process (SIGSTOP to itself) while process ``ppid``
    (the training) is stopped, so that a suspended job uses no CPU nor network. The parent continues it
    (:meth:`SuspendWatch.follow`); so does SLURM's resume or cancel, and anyone's SIGCONT. Returns the thread
    (a daemon, looking every ``every_s`` seconds; it ends when the parent is gone)."""

    def loop() -> None:
        while True:
            time.sleep(every_s)
            state = proc_state(ppid)
            if state is None or state == "Z" or os.getppid() != ppid:
                return  # the parent is gone: nobody would continue us
            if state == "T":
                os.kill(os.getpid(), signal.SIGSTOP)

    thread = threading.Thread(target=loop, name="gwenlake-follow-parent", daemon=True)
    thread.start()
    return thread
