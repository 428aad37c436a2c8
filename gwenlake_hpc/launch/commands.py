"""The ``status``, ``logs`` and ``cancel`` commands over every job submitted from a runs root: jobs of this host's
SLURM (:mod:`gwenlake_hpc.launch.status`) and jobs on a cluster over SSH (:mod:`gwenlake_hpc.launch.remote`)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..base.errors import ConfigError, GwenlakeError
from .records import job_records
from .status import (FINAL_STATES, JobStatus, goodput_facts, job_status, levels_facts, live_facts, scancel,
                     slurm_state)


def any_job_status(record: dict) -> JobStatus:
    """Status of a job record: asked over SSH for a record with a ``cluster``, else of this host's SLURM."""
    if record.get("cluster"):
        from .remote_jobs import remote_job_status  # paramiko: only for jobs on a cluster over SSH

        return remote_job_status(record)
    return job_status(record)


def print_status(runs_root: Path, include_old: bool = False) -> int:
    """The ``status`` command: one line per job submitted from here."""
    records = job_records(runs_root)
    if not include_old:
        records = [r for r in records if time.time() - r.get("submitted", 0) < 86400]
    if not records:
        older = "" if include_old else " in the last 24 hours (--all shows older ones)"
        print(f"no jobs submitted to SLURM from {runs_root.resolve()}{older}; local runs are not jobs: "
              "`checkpoints list` and MLflow show them")
        return 0
    print(f"{'JOB':>10}  {'STATE':<12} {'RESTARTS':>8} {'STEP':>8}  MLFLOW RUN                        RUN")
    for r in records:
        try:
            s = any_job_status(r)
        except GwenlakeError as exc:  # a remote cluster out of reach: say so, go on with the other jobs
            print(f"{r['job_id']:>10}  {'UNREACHABLE':<12} {'':>8} {'':>8}  {'-':<32}  {r['model']}/"
                  f"{Path(r['run_dir']).name}  on {r.get('cluster')}: {str(exc).splitlines()[0]}")
            continue
        print(f"{s.job_id:>10}  {s.state:<12} {'' if s.restarts is None else s.restarts:>8} "
              f"{'' if s.step is None else s.step:>8}  {s.tracking_run_id or '-':<32}  "
              f"{r['model']}/{Path(r['run_dir']).name}" + (f"  version {s.version[:12]}" if s.version else "")
              + (f"  on {r['cluster']}" if r.get("cluster") else "")
              + (f"  ended by {s.ended_by}: {s.reason}" if s.ended_by else "")
              + (f"  {live}" if s.state == "RUNNING" and (live := live_facts(Path(r["run_dir"]))) else "")
              + (f"  {lv}" if (lv := levels_facts(Path(r["run_dir"]), s.state not in FINAL_STATES)) else "")
              + (f"  {gp}" if (gp := goodput_facts(Path(r["run_dir"]), s.state,
                                                   None if r.get("cluster") else s.job_id)) else ""))
    return 0


def cancel(job_id: str, runs_root: Path | None = None) -> int:
    """``scancel`` a job; its run directory and checkpoints are kept, the secrets files that ``runs_root``'s
    index records for it (for every task of an array given by its id) removed. A job that the index records as
    submitted to a remote cluster is cancelled there over SSH."""
    records = job_records(runs_root) if runs_root is not None else []
    remote = [r for r in records if r["job_id"] == job_id]
    if remote and remote[-1].get("cluster"):
        from .remote_jobs import cancel_remote

        return cancel_remote(remote[-1])
    tasks = [r for r in records if r["job_id"] == job_id or str(r["job_id"]).startswith(f"{job_id}_")]
    if tasks:
        return scancel(job_id, [r["secrets"] for r in tasks if r.get("secrets")])
    # Not in this runs root's index (submitted with another paths.runs_root, or by hand): the job's own batch
    # script names the secrets file it sources. A pending job never runs a teardown that would remove it.
    secrets = secrets_in_batch_script(job_id)
    if secrets is None:
        print(f"warning: job {job_id} is not in {runs_root} and SLURM no longer has its batch script: if it had "
              "launcher.secrets, its secrets file is not removed (pass --runs-root with the paths.runs_root it was "
              "submitted with, or delete <run_dir>/slurm/secrets-*.env yourself)", file=sys.stderr)
    return scancel(job_id, secrets or [])


_SOURCED = re.compile(r"^set -a; \. (.+); set \+a$")


def secrets_in_batch_script(job_id: str) -> list[str] | None:
    """The secrets files the job's batch script sources (``set -a; . FILE; set +a``, the line
    :func:`gwenlake_hpc.launch.slurm.setup_lines` writes), from ``scontrol write batch_script JOB -``; an array
    task's ``%a``-style path is left out (its index records it). None when SLURM has no script for the job."""
    try:
        proc = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    found = []
    for line in proc.stdout.splitlines():
        m = _SOURCED.match(line.strip())
        if m:
            words = shlex.split(m.group(1))
            if len(words) == 1 and "$" not in words[0] and Path(words[0]).name.startswith("secrets-"):
                found.append(words[0])
    return found


def _record(runs_root: Path, job_id: str) -> dict:
    for r in reversed(job_records(runs_root)):
        if r["job_id"] == job_id:
            return r
    raise ConfigError(f"job {job_id} was not submitted from {runs_root.resolve()} (see `status --all`)")


def print_logs(runs_root: Path, job_id: str, follow: bool = False, stderr: bool = False) -> int:
    """The ``logs`` command: print the job's log; with ``follow``, until the job reaches a final state."""
    r = _record(runs_root, job_id)
    if r.get("cluster"):
        from .remote_jobs import print_remote_logs

        return print_remote_logs(r, follow=follow, stderr=stderr)
    path = Path(r["stderr" if stderr else "stdout"].replace("%j", job_id))
    pos = 0
    while True:
        if path.exists():
            with open(path, errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            sys.stdout.write(chunk)
            sys.stdout.flush()
        if not follow:
            return 0
        state, _ = slurm_state(job_id)
        if state.split()[0] in FINAL_STATES:
            return 0
        time.sleep(1.0)


