"""Child processes of a job step that SLURM's stop signals must not kill (git, the tracking delivery process), and
whether a process named by a record (a run's lease or lock) is gone.

Standard library only, so that the stores (git, tracking) shield their children without importing the Run's
eviction signals (:mod:`gwenlake_hpc.runtime.signals`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator

#: What SLURM sends to every process of a job step: preemption and scancel (SIGTERM), the time-limit warning
#: (SIGUSR2). Not SIGINT: a Ctrl-C in a terminal must still interrupt a long git or git-lfs command at once.
SLURM_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)


@contextlib.contextmanager
def shield_children(signals: tuple[int, ...] = SLURM_SIGNALS) -> Iterator[None]:
    """Block SLURM's stop signals in this thread while the block runs; processes it starts inherit them blocked.

    SLURM sends the time-limit warning (SIGUSR2) and SIGTERM to every process of the job step. A ``git``
    child of the final commit would die from them ("git write-tree failed (exit -12)") and fail a training
    that had finished. A blocked signal stays pending in such a child, which ends normally; in this process
    the handlers still record it (at the latest when the block ends), so nothing is lost. Works in any thread
    (the mask is the calling thread's; Python runs the handlers in the main thread either way).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def pid_gone(pid: int) -> bool:
    """True when no process of this pid namespace has ``pid`` (``kill(pid, 0)`` says so); False when one has it,
    or one of another user does (``EPERM``), or ``pid`` is no pid (<= 0)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def proc_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped, ``t`` traced,
    ``Z``...), or None when it cannot be read (no such process, not Linux)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, ValueError):
        return None
