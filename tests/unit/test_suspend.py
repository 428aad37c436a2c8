"""Suspension (issue 40, item 11): a helper process stops with its stopped parent and continues with it; the
progress line's speed and ETA leave a suspension out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gwenlake_hpc.base.processes import proc_state
from gwenlake_hpc.runtime.progress import Progress

_PARENT = r"""
import subprocess, sys, time
from gwenlake_hpc.base.suspend import watch
helper = subprocess.Popen([sys.executable, "-c",
    "import os, time; from gwenlake_hpc.base.suspend import follow_parent_stops; "
    "follow_parent_stops(os.getppid()); time.sleep(300)"], start_new_session=True)
watch().follow(helper.pid)
print(helper.pid, flush=True)
try:
    time.sleep(300)
finally:
    helper.kill()
"""


def _wait(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_helper_in_its_own_session_stops_with_its_stopped_parent_and_continues_with_it():
    """The tracking delivery process's case: a session of its own, which SLURM's suspend (the job step's process
    group) does not reach. Before, it kept running while its training was stopped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, env=env)
    helper = None
    try:
        helper = int(parent.stdout.readline())
        _wait(lambda: proc_state(helper) in ("S", "R"), "the helper running")
        os.kill(parent.pid, signal.SIGSTOP)
        _wait(lambda: proc_state(helper) == "T", "the helper stopped with its parent")
        time.sleep(1.5)
        assert proc_state(helper) == "T"  # stays stopped while the parent is
        os.kill(parent.pid, signal.SIGCONT)
        _wait(lambda: proc_state(helper) in ("S", "R"), "the helper continued by its parent")
    finally:
        os.kill(parent.pid, signal.SIGCONT)
        parent.kill()
        parent.wait(timeout=60)
        if helper is not None:
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_progress_eta_after_a_resume_leaves_the_suspension_out():
    """The issue's line: 3,000 steps of ~24 ms, a 60 s suspension: the first line after the resume said ETA
    0:10:00 (the minute counted as training). Now the speed is over the time the loop ran."""
    stopped = [0.0]
    progress = Progress(3000, 0, "lines", suspended_of=lambda: stopped[0])
    t0 = progress._t0
    stopped[0] = 60.0
    line = progress.line(1000, now=t0 + 24.0 + 60.0)  # 1,000 steps in 24 s of running, then 60 s stopped
    assert "41.7 steps/s" in line and "ETA 0:00:48" in line, line
