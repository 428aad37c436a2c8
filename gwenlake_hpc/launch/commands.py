"""The ``status``, ``logs`` and ``cancel`` commands over every job submitted from a runs root: jobs of this host's
SLURM (:mod:`gwenlake_hpc.launch.status`) and jobs on a cluster over SSH (:mod:`gwenlake_hpc.launch.remote`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..base.errors import ConfigError, GwenlakeError
from .records import job_records
from .status import FINAL_STATES, JobStatus, job_status, scancel, slurm_state


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
        print(f"no jobs submitted from {runs_root.resolve()} (try --all)")
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
              + (f"  ended by {s.ended_by}: {s.reason}" if s.ended_by else ""))
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
    return scancel(job_id, [r["secrets"] for r in tasks if r.get("secrets")])


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


