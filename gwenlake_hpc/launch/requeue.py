"""The requeue decision, taken in the batch script after the job step ends (submitit's ``teardown``).

SLURM requeues a ``--requeue`` job by itself on preemption and on node failure. It does not on a time limit
nor when the job step is killed without warning (SIGKILL, out of memory); this module covers those two, and
never a preemption: whether an eviction was a time limit is decided from the job's real remaining time as
SLURM reports it, not from which signal arrived (some clusters send ``--signal`` on preemption too).

The batch shell ignores SIGTERM (so that srun does not SIGKILL the step), so this code also runs after a
preemption or a scancel. It then finds the job no longer RUNNING (COMPLETING, CANCELLED, PREEMPTED...): SLURM is
ending the job itself and nothing is requeued here, whatever the remaining time.

The module uses the standard library only and runs as a plain file too (``python3 requeue.py --rc ...``): a job
in a container image runs its teardown on the host, whose Python may not have gwenlake_hpc
(:mod:`gwenlake_hpc.launch.container` copies this file into the job's folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

#: The exit status of an evicted training (:data:`gwenlake_hpc.errors.EXIT_EVICTED`; a test checks they agree).
EXIT_EVICTED = 75

log = logging.getLogger("gwenlake_hpc.launch.requeue")

#: An eviction with at most signal_delay_s + this many seconds left is a time limit: SLURM may send the
#: warning signal up to 60 s early, and the checkpoint and exit take some seconds more.
TIME_LIMIT_SLACK_S = 90


@dataclass(frozen=True)
class Decision:
    """``action``: ``done`` (success), ``requeue``, ``leave`` (SLURM decides) or ``fail``; ``reason`` says why."""

    action: str
    reason: str


def parse_slurm_time(text: str) -> int | None:
    """Seconds from SLURM's ``[days-]hours:minutes:seconds`` / ``minutes:seconds`` (squeue ``%L``).

    Returns None for ``UNLIMITED``, ``NOT_SET``, ``INVALID`` or anything unparseable.
    """
    text = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def decide(rc: int, restarts: int, max_retries: int, remaining_s: int | None, signal_delay_s: int,
           state: str | None = None) -> Decision:
    """What to do after the job step ended with status ``rc``.

    Args:
        rc: the step's exit status as the batch shell sees it (0 done, 75 evicted, 1 the training raised,
            >128 or 137 killed by a signal).
        restarts: ``SLURM_RESTART_COUNT`` (0 on the first start).
        max_retries: the launcher's ``max_retries``.
        remaining_s: the job's remaining time from ``squeue -o %L``, None if unknown or unlimited.
        signal_delay_s: the ``--signal`` lead time.
        state: the job's state from ``squeue -o %T`` (None if unknown): anything but RUNNING means SLURM is
            ending the job (scancel, preemption, the time limit itself) and decides about it.
    """
    if rc == 0:
        return Decision("done", "the training finished")
    if state and state != "RUNNING":
        return Decision("leave", f"the job is {state}: SLURM is ending it (scancel, preemption or time limit) "
                                 "and decides; no requeue from here")
    warned = rc in (128 + signal.SIGUSR2, -signal.SIGUSR2)  # killed by the time-limit warning before any handler
    if rc == EXIT_EVICTED or warned:
        if remaining_s is not None and remaining_s <= signal_delay_s + TIME_LIMIT_SLACK_S:
            if restarts < max_retries:
                return Decision("requeue", f"time limit ({remaining_s} s left): requeue {restarts + 1}/{max_retries}")
            return Decision("fail", f"time limit and no retry left ({restarts}/{max_retries} used)")
        if warned and restarts < max_retries and remaining_s is not None:
            return Decision("requeue", f"job step killed by SIGUSR2 with {remaining_s} s left (the warning came "
                                       f"before its handlers existed): requeue {restarts + 1}/{max_retries}")
        return Decision("leave", f"evicted with {remaining_s} s left: a preemption or a cancel, SLURM decides")
    if rc > 128 or rc < 0:
        sig = rc - 128 if rc > 128 else -rc
        if restarts < max_retries:
            return Decision("requeue", f"job step killed by signal {sig} (out of memory or killed): "
                                       f"requeue {restarts + 1}/{max_retries}")
        return Decision("fail", f"job step killed by signal {sig}, no retry left ({restarts}/{max_retries} used)")
    return Decision("fail", f"the training failed with exit status {rc} (traceback above)")


def slurm_job_ref() -> str:
    """``<array job id>_<task id>`` for an array task, else ``SLURM_JOB_ID``."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def job_state(job_ref: str) -> tuple[str | None, int | None]:
    """The job's state and remaining seconds as SLURM reports them (``squeue -h -j REF -o "%T %L"``).

    ``(None, None)`` when squeue does not answer or no longer lists the job.
    """
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_ref, "-o", "%T %L"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    fields = out.split()
    if len(fields) < 2:
        return None, None
    return fields[0], parse_slurm_time(fields[1])


def main(argv: list[str] | None = None) -> int:
    """``python -m gwenlake_hpc.launch.requeue --rc RC --max-retries N --signal-delay S``; returns the job's status."""
    logging.basicConfig(level=logging.INFO, format="[gwenlake requeue] %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser()
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--max-retries", type=int, required=True)
    p.add_argument("--signal-delay", type=int, required=True)
    a = p.parse_args(argv)
    ref = slurm_job_ref()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    state, remaining = job_state(ref) if a.rc != 0 else (None, None)
    d = decide(a.rc, restarts, a.max_retries, remaining, a.signal_delay, state)
    log.info("job %s step ended with status %d: %s", ref, a.rc, d.reason)
    if d.action == "requeue":
        proc = subprocess.run(["scontrol", "requeue", ref], capture_output=True, text=True)
        if proc.returncode != 0:
            log.error("scontrol requeue %s failed: %s", ref, proc.stderr.strip())
            return a.rc or 1
        return 0
    if d.action == "done":
        return 0
    return a.rc if a.rc > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
