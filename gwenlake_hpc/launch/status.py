"""Job status from SLURM's own records (sacct, scontrol) joined with the run directory's facts."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints import CheckpointStore
from ..errors import GwenlakeError
from ..fsutil import read_json

#: Job states after which a job will not run again (a REQUEUED or PREEMPTED job will).
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                "DEADLINE")


@dataclass
class JobStatus:
    """One job as SLURM and its run directory see it.

    Attributes:
        job_id: SLURM job id (``<id>`` or ``<array id>_<task>``).
        state: SLURM state (``PENDING``, ``RUNNING``, ``PREEMPTED``, ``REQUEUED``, ``COMPLETED``, ...), from
            ``squeue`` while the job is queued or running, else ``sacct``; ``UNKNOWN`` if neither knows it.
        restarts: SLURM's restart count (``scontrol show job``); once SLURM forgot the job (``MinJobAge``), the
            count the run recorded itself (``SLURM_RESTART_COUNT`` of each start in ``run.json``); None if
            neither knows.
        step: newest complete checkpoint's step, None if none.
        checkpoint: its directory.
        tracking_run_id: the MLflow run id stored in the run directory.
        version: the model version when the run completed.
    """

    job_id: str
    state: str
    restarts: int | None
    step: int | None
    checkpoint: Path | None
    tracking_run_id: str | None
    version: str | None
    run_dir: Path | None = None


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def slurm_state(job_id: str, run=_run) -> tuple[str, int | None]:
    """(state, restarts) of a job: ``scontrol show job`` while SLURM holds it, else ``sacct``.

    ``run`` runs a command (argv) and returns its stdout: here by default, over SSH for a remote cluster."""
    out = run(["scontrol", "-o", "show", "job", job_id])
    if out.strip():
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        restarts = int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else None
        return fields.get("JobState", "UNKNOWN"), restarts
    out = run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"])
    states = [line.strip() for line in out.splitlines() if line.strip()]
    return (states[-1].split()[0] if states else "UNKNOWN"), None


def restarts_from_record(info: dict, job_id: str) -> int | None:
    """The restart count of SLURM job ``job_id`` (``<id>`` or ``<array id>_<task>``) as the run recorded it: the
    highest ``SLURM_RESTART_COUNT`` among the starts of ``run.json`` made by that job, 0 for a job that started
    once; None when no start of the run came from it."""
    array, _, task = job_id.partition("_")
    counts = []
    for start in info.get("starts") or []:
        if task:
            mine = start.get("SLURM_ARRAY_JOB_ID") == array and start.get("SLURM_ARRAY_TASK_ID") == task
        else:
            mine = start.get("SLURM_JOB_ID") == job_id
        if mine and start.get("SLURM_PROCID", "0") == "0":
            counts.append(int(start.get("SLURM_RESTART_COUNT") or 0))
    return max(counts) if counts else None


def job_status(record: dict, known: tuple[str, int | None] | None = None) -> JobStatus:
    """Status of one job submitted to this host's SLURM (a record of :mod:`gwenlake_hpc.launch.records`;
    :func:`gwenlake_hpc.launch.commands.any_job_status` also answers for jobs on a cluster over SSH). ``known``:
    (state, restarts) already read (a whole array at once), so SLURM is not asked again."""
    state, restarts = known if known is not None else slurm_state(record["job_id"])
    run_dir = Path(record["run_dir"])
    info = read_json(run_dir / "run.json", default={}) or {}
    ck = CheckpointStore(run_dir / "checkpoints", record.get("run_key") or run_dir.name).complete() \
        if (run_dir / "checkpoints").is_dir() else []
    run_id_file = run_dir / "tracking" / "run_id"
    if restarts is None:
        restarts = restarts_from_record(info, record["job_id"])
    return JobStatus(record["job_id"], state, restarts, ck[-1].step if ck else None, ck[-1].path if ck else None,
                     run_id_file.read_text().strip() if run_id_file.exists() else None,
                     (info.get("completed") or {}).get("version"), run_dir)


def scancel(job_id: str) -> int:
    """``scancel`` a job of this host's SLURM; its run directory and checkpoints are kept. Returns 0, or 1 with
    scancel's message printed."""
    proc = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: scancel {job_id}: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"cancelled {job_id}; its checkpoints are kept: submit the same job again to resume")
    return 0


def poll_until_final(state: Callable[[], str], what: str, timeout_s: float | None = None,
                     poll_s: float = 2.0) -> str:
    """Call ``state()`` (a SLURM state such as ``RUNNING`` or ``CANCELLED by 0``) every ``poll_s`` seconds until
    it is final (a requeue is not); returns that state. Used for local and remote jobs alike.

    Raises:
        TimeoutError: ``timeout_s`` passed first (``what`` names the job in the message).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        current = state()
        if current.split()[0] in FINAL_STATES:
            return current
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what} still {current} after {timeout_s} s")
        time.sleep(poll_s)


def wait(job_id: str, run_dir: Path, timeout_s: float | None = None, poll_s: float = 2.0) -> JobStatus:
    """Block until the job reaches a final state (a requeue is not one).

    Raises:
        TimeoutError: ``timeout_s`` passed first.
    """
    poll_until_final(lambda: slurm_state(job_id)[0], f"job {job_id}", timeout_s, poll_s)
    return job_status({"job_id": job_id, "run_dir": str(run_dir), "run_key": Path(run_dir).name})


def array_states(array_id: str, run=_run) -> dict[str, str]:
    """State of every task of job array ``array_id`` (``{"<array>_<i>": state}``) in two calls at most: ``squeue``
    for the tasks SLURM still holds (pending ones included), ``sacct`` for the others."""
    states: dict[str, str] = {}
    for line in run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i %T"]).splitlines():
        fields = line.split()
        if len(fields) == 2:
            states[fields[0]] = fields[1]
    for line in run(["sacct", "-n", "-P", "-X", "-j", array_id, "-o", "JobID,State"]).splitlines():
        job, _, state = line.strip().partition("|")
        if job and "[" not in job and job not in states:  # "123_[4-9]": pending, squeue has them
            states[job] = state.split()[0] if state else "UNKNOWN"
    return states


def wait_array(tasks: list[dict], poll_s: float = 2.0, run=_run) -> list[JobStatus]:
    """Block until every task (``{"job_id": "<array>_<i>", "run_dir"}``) reached a final state; one ``squeue``
    and one ``sacct`` per poll for the whole array, whatever its size. Returns their statuses in order."""
    array_id = tasks[0]["job_id"].split("_")[0]
    final: dict[str, str] = {}
    while True:
        states = array_states(array_id, run)
        for t in tasks:
            state = states.get(t["job_id"], "")
            if state.split()[0:1] and state.split()[0] in FINAL_STATES:
                final[t["job_id"]] = state.split()[0]
        if len(final) == len(tasks):
            break
        time.sleep(poll_s)
    out = []
    for t in tasks:
        info = read_json(Path(t["run_dir"]) / "run.json", default={}) or {}
        record = {"job_id": t["job_id"], "run_dir": t["run_dir"], "run_key": Path(t["run_dir"]).name}
        out.append(job_status(record, known=(final[t["job_id"]], restarts_from_record(info, t["job_id"]))))
    return out


class JobHandle:
    """A submitted job, from Python: ``fit.submit(...)`` returns one.

    Attributes:
        job_id: SLURM job id.
        run_dir: the run directory (checkpoints, tracking, output).
    """

    def __init__(self, job_id: str, run_dir: Path):
        self.job_id = job_id
        self.run_dir = Path(run_dir)

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the job created or reattached it."""
        path = self.run_dir / "tracking" / "run_id"
        return path.read_text().strip() if path.exists() else None

    def status(self) -> JobStatus:
        """Current :class:`JobStatus`."""
        return job_status({"job_id": self.job_id, "run_dir": str(self.run_dir), "run_key": self.run_dir.name})

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the job ends.

        Raises:
            TimeoutError: not ended within ``timeout`` seconds.
            GwenlakeError: it ended in another state than COMPLETED (failed, cancelled, timed out).
        """
        final = self._wait(timeout)
        if not final.state.startswith("COMPLETED"):
            raise GwenlakeError(f"{self._label()} ended {final.state}; see its log")
        return final

    def _wait(self, timeout: float | None) -> JobStatus:
        return wait(self.job_id, self.run_dir, timeout)

    def _label(self) -> str:
        return f"job {self.job_id}"

    def latest_checkpoint(self) -> Path | None:
        """Directory of the newest complete checkpoint."""
        return self.status().checkpoint

    def cancel(self) -> None:
        """scancel the job (checkpoints kept)."""
        scancel(self.job_id)
