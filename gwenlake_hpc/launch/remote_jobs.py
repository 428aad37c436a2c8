"""Jobs submitted over SSH (:mod:`gwenlake_hpc.launch.remote`), once submitted: status, logs, cancel, wait.

Each function takes the job's record from the local index (``<runs_root>/.gwenlake-jobs.jsonl``, with the
cluster's connection settings and no secret) and reaches the cluster through :mod:`.ssh`; the ``status``,
``logs`` and ``cancel`` commands (:mod:`.commands`) and :class:`RemoteJobHandle` use them.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from .ssh import SshConnection, SshTarget, connection
from .status import JobHandle


def _conn(record: dict) -> SshConnection:
    return connection(SshTarget.from_dict(record["ssh"]))


def remote_state(record: dict) -> tuple[str, int | None]:
    """(state, restarts) of a remote job from the cluster's scontrol/sacct; reconnects after a drop."""
    from .status import slurm_state

    conn = _conn(record)

    def run(cmd: list[str]) -> str:
        rc, out, _ = conn.run(cmd, check=False, retry=True, timeout_s=60)
        return out

    return slurm_state(record["job_id"], run=run)


def remote_job_status(record: dict) -> Any:
    """:class:`gwenlake_hpc.launch.status.JobStatus` of a remote job; run directory facts read over SFTP.

    The step is the newest ``checkpoints/step-*`` directory holding its ``MANIFEST.json`` (the manifest is
    written last, so a partial checkpoint has none; its hashes are not re-verified from here).
    """
    from .status import JobStatus

    state, restarts = remote_state(record)
    conn = _conn(record)
    run_dir = record["run_dir"]
    steps = sorted(int(n.split("-")[1]) for n in conn.listdir(f"{run_dir}/checkpoints")
                   if re.fullmatch(r"step-\d+", n))
    step = None
    for s in reversed(steps):
        if conn.stat_size(f"{run_dir}/checkpoints/step-{s:09d}/MANIFEST.json") is not None:
            step = s
            break
    run_id = (conn.read_text(f"{run_dir}/tracking/run_id") or "").strip() or None
    info = json.loads(conn.read_text(f"{run_dir}/run.json") or "{}")
    version = (info.get("completed") or {}).get("version")
    ck = Path(f"{run_dir}/checkpoints/step-{step:09d}") if step is not None else None
    return JobStatus(record["job_id"], state, restarts, step, ck, run_id, version, Path(run_dir))


def print_remote_logs(record: dict, follow: bool = False, stderr: bool = False, poll_s: float = 1.0) -> int:
    """``logs JOB [-f]`` for a remote job: the log file read over SFTP from the last offset; with ``follow``,
    until the job reaches a final state. A dropped connection is reopened and reading resumes at the same byte.

    Raises:
        ConnectionLost: the cluster stayed unreachable for the reconnect time (60 s).
    """
    from .status import FINAL_STATES

    conn = _conn(record)
    path = record["stderr" if stderr else "stdout"].replace("%j", record["job_id"])
    pos = 0

    def drain() -> None:
        nonlocal pos
        while True:
            chunk = conn.read_from(path, pos)
            if not chunk:
                return
            pos += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()

    seen = conn.reconnects
    while True:
        drain()
        if not follow:
            return 0
        state, _ = remote_state(record)
        if conn.reconnects != seen:
            print(f"[gwenlake] connection to {conn.target.where} re-established; continuing at byte {pos}",
                  file=sys.stderr, flush=True)
            seen = conn.reconnects
        if state.split()[0] in FINAL_STATES:
            drain()
            return 0
        time.sleep(poll_s)


def cancel_remote(record: dict) -> int:
    """``scancel`` a remote job over SSH (checkpoints kept) and remove its secrets file (a cancelled job's
    teardown may be killed before it does); returns the exit status."""
    conn = _conn(record)
    rc, _, err = conn.run(["scancel", record["job_id"]], check=False, timeout_s=60)
    if rc != 0:
        print(f"error: scancel {record['job_id']} on {record['cluster']}: {err.strip()}", file=sys.stderr)
        return 1
    if record.get("secrets_file"):
        conn.run(["rm", "-f", "--", str(record["secrets_file"])], check=False, timeout_s=60)
    print(f"cancelled {record['job_id']} on {record['cluster']}; its checkpoints are kept: submit the same job "
          "again to resume")
    return 0


def wait_remote(record: dict, timeout_s: float | None = None, poll_s: float = 2.0) -> Any:
    """Block until a remote job reaches a final state; returns its JobStatus.

    Raises:
        TimeoutError: ``timeout_s`` passed first.
    """
    from .status import poll_until_final

    poll_until_final(lambda: remote_state(record)[0], f"job {record['job_id']} on {record['cluster']}", timeout_s,
                     poll_s)
    return remote_job_status(record)


class RemoteJobHandle(JobHandle):
    """A job submitted over SSH, from Python: :class:`gwenlake_hpc.launch.status.JobHandle` through SSH.

    Attributes:
        job_id: SLURM job id on the cluster.
        run_dir: the run directory on the cluster (a remote path).
        record: the job record (with the connection settings).
    """

    def __init__(self, record: dict):
        super().__init__(record["job_id"], Path(record["run_dir"]))
        self.record = record

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the job created or reattached it."""
        return (_conn(self.record).read_text(f"{self.record['run_dir']}/tracking/run_id") or "").strip() or None

    def status(self) -> Any:
        """Current JobStatus."""
        return remote_job_status(self.record)

    def _wait(self, timeout: float | None) -> Any:
        return wait_remote(self.record, timeout)

    def _label(self) -> str:
        return f"job {self.job_id} on {self.record['cluster']}"

    def cancel(self) -> None:
        """scancel the job (checkpoints kept)."""
        cancel_remote(self.record)
