"""Job status from SLURM's own records (sacct, scontrol) joined with the run directory's facts.

A run key can be reused by a later job (a cancelled sweep task submitted again, alone); once a later job started
the run, a job's step and version come from its own records (its teardown's record, else the checkpoints sealed
before the later start and the completions within its time), not from the run directory's newer state."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..stores.checkpoints import CheckpointStore
from ..base.errors import GwenlakeError
from ..base.fsutil import read_json
from .requeue import read_record

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
        ended_by: the setting whose budget ended the job (``launcher.max_retries``, ``launcher.max_starts``),
            from its teardown's record; None otherwise.
        reason: the teardown's last decision, when it recorded one.

    A job whose run a later job started again shows its own step and version (see the module's docstring).
    """

    job_id: str
    state: str
    restarts: int | None
    step: int | None
    checkpoint: Path | None
    tracking_run_id: str | None
    version: str | None
    run_dir: Path | None = None
    ended_by: str | None = None
    reason: str | None = None


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


def _started_by(start: dict, job_id: str) -> bool:
    """Whether a start of ``run.json`` came from SLURM job ``job_id`` (``<id>`` or ``<array id>_<task>``)."""
    array, _, task = job_id.partition("_")
    if task:
        return start.get("SLURM_ARRAY_JOB_ID") == array and start.get("SLURM_ARRAY_TASK_ID") == task
    return start.get("SLURM_JOB_ID") == job_id


def restarts_from_record(info: dict, job_id: str) -> int | None:
    """The restart count of SLURM job ``job_id`` (``<id>`` or ``<array id>_<task>``) as the run recorded it: the
    highest ``SLURM_RESTART_COUNT`` among the starts of ``run.json`` made by that job, 0 for a job that started
    once; None when no start of the run came from it."""
    counts = [int(start.get("SLURM_RESTART_COUNT") or 0) for start in info.get("starts") or []
              if _started_by(start, job_id) and start.get("SLURM_PROCID", "0") == "0"]
    return max(counts) if counts else None


def own_progress(record: dict, info: dict, checkpoints: list) -> tuple[int | None, str | None] | None:
    """(step, version) of the job of ``record`` from its own records once a later job (or a local run) started
    its run after it; None while none did (the run directory's state is then this job's).

    Its step: the newest sealed step its teardown recorded, else the newest of ``checkpoints`` (the run's
    complete ones) sealed before that later start; its version: the one its teardown recorded as finished, else
    a completion of ``run.json`` between its first start and that later start. A job that never started: (None,
    None)."""
    job_id = str(record["job_id"])
    starts = [st for st in info.get("starts") or [] if st.get("SLURM_PROCID", "0") == "0"]
    mine = [float(st.get("time") or 0) for st in starts if _started_by(st, job_id)]
    since = max(mine, default=float(record.get("submitted") or 0))
    later = [float(st.get("time") or 0) for st in starts if not _started_by(st, job_id)
             and float(st.get("time") or 0) > since]
    if not later:
        return None
    own = read_record(Path(record["run_dir"]), job_id)
    ends = own.get("starts") or []
    if ends:
        return ends[-1].get("newest_step"), own.get("version") if ends[-1].get("action") == "done" else None
    if not mine:
        return None, None
    cutoff = min(later)
    sealed = [ck.step for ck in checkpoints if float(ck.manifest.get("created") or 0) < cutoff]
    versions = [c.get("version") for c in info.get("completions") or [info.get("completed") or {}]
                if min(mine) <= float(c.get("time") or 0) < cutoff]
    return (sealed[-1] if sealed else None), (versions[-1] if versions else None)


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
    step, version = ck[-1].step if ck else None, (info.get("completed") or {}).get("version")
    own = own_progress(record, info, ck)
    if own is not None:  # a later job reused the run: show what this one did
        step, version = own
    checkpoint = next((c.path for c in ck if c.step == step), None)
    last = (read_record(run_dir, record["job_id"]).get("starts") or [{}])[-1]
    return JobStatus(record["job_id"], state, restarts, step, checkpoint,
                     run_id_file.read_text().strip() if run_id_file.exists() else None, version, run_dir,
                     ended_by=last.get("rule"), reason=last.get("reason"))


def live_facts(run_dir: Path, now: float | None = None) -> str:
    """What a running job's rank 0 last wrote: ``last step 340 12 s ago`` (``<run_dir>/progress.json``, written by
    rank 0's hang watchdog at most every 5 s while steps advance; none with ``job.hang_timeout_s=0``) and, in a
    multi-rank run, ``slowest rank 1 on n2 (1.62x the others' median, step 300)`` (``ranks.json``, at each
    evaluation). Ages compare the node's clock with this host's (NTP keeps them
    within far less than a second). "" when neither file is there."""
    import json

    from ..job.watchdog import PROGRESS_FILE
    from ..runtime.ranks import read_ranks

    parts = []
    try:
        prog = json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
        age = max(0.0, (time.time() if now is None else now) - float(prog["time"]))
        parts.append(f"last step {int(prog['step'])} {age:.0f} s ago")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ranks = read_ranks(run_dir)
    if ranks and isinstance(ranks.get("ratio"), (int, float)):
        slow = ranks["slowest"]
        parts.append(f"slowest rank {slow['rank']} on {slow['host']} ({ranks['ratio']:.2f}x the others' median, "
                     f"step {ranks['step']})")
    return "; ".join(parts)


def lost_node_starts(job_id: str, run_dir: Path, run=_run) -> set[int]:
    """The ledger's indexes of the job's starts that SLURM ended with their node (``NODE_FAIL``): ``sacct -D``
    lists one line per run of the job, the k-th with restart count k, matched to the starts that recorded
    that job id and restart count (``slurm_job_id``, ``slurm_restart_count``). Empty when sacct says nothing."""
    from ..runtime import ledger as ledgers

    out = run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "State"])
    runs = [line.split()[0] for line in out.splitlines() if line.strip()]
    failed = {k for k, st in enumerate(runs) if st == "NODE_FAIL"}
    if not failed:
        return set()
    return {int(r["start"]) for r in ledgers.read_ledger(run_dir)
            if str(r.get("slurm_job_id")) == str(job_id) and int(r.get("slurm_restart_count") or 0) in failed}


def levels_facts(run_dir: Path, live: bool = True) -> str:
    """The two levels of the run's checkpoints as its copier last recorded them (``checkpoints/LEVELS.json``,
    :mod:`gwenlake_hpc.stores.checkpoints.levels`): ``levels: step 40 local (n1) and shared`` or ``levels: local
    step 40 on n1, shared step 30, copying step 40``; "" for a run without a node-local level. ``live``: a start of
    the run may be running (else a copy the record names in flight was cut short, and is not shown)."""
    from ..stores.checkpoints.levels import levels_record

    rec = levels_record(run_dir / "checkpoints")
    if rec is None:
        return ""
    local, shared, copying, host = rec.get("local_step"), rec.get("shared_step"), rec.get("copying"), rec.get("host")
    copying = copying if live else None
    if local == shared and copying is None:
        return f"levels: step {shared} local ({host}) and shared"
    return (f"levels: local step {local} on {host}, shared step {'none' if shared is None else shared}"
            + (f", copying step {copying}" if copying is not None else ""))


def goodput_facts(run_dir: Path, state: str, job_id: str | None = None) -> str:
    """The run's goodput as its ledger adds it up (``goodput 0.82 of 1.40 h (largest loss: lost 0.10 h),
    queued 12 s``: :func:`gwenlake_hpc.runtime.ledger.describe`); "" for a run without a ledger. ``state``: the
    job's SLURM state (a job not in a final state has its newest start still running); ``job_id``: the job on
    this host's SLURM, whose runs that ended ``NODE_FAIL`` are the ledger's lost nodes (None: not asked)."""
    from ..runtime import ledger as ledgers

    try:
        completed = bool((read_json(run_dir / "run.json", default={}) or {}).get("completed"))
        lost = lost_node_starts(job_id, run_dir) if job_id else set()
        recs = ledgers.read_ledger(run_dir, live=state not in FINAL_STATES, completed=completed, lost_nodes=lost)
    except (OSError, ValueError, AttributeError):  # a run.json damaged by hand: no goodput, not a traceback
        return ""
    return ledgers.describe(ledgers.summarize(recs)) if recs else ""


def scancel(job_id: str, secrets: Iterable[str | Path] = ()) -> int:
    """``scancel`` a job of this host's SLURM; its run directory and checkpoints are kept, its ``secrets`` files
    removed (a cancelled job's teardown may be killed before it removes them). Returns 0, or 1 with scancel's
    message printed (nothing removed)."""
    proc = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: scancel {job_id}: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    for path in secrets:
        Path(path).unlink(missing_ok=True)
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
        secrets: the job's secrets file, None without secrets (:meth:`cancel` removes it).
    """

    def __init__(self, job_id: str, run_dir: Path, secrets: Path | None = None):
        self.job_id = job_id
        self.run_dir = Path(run_dir)
        self.secrets = secrets

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
        """scancel the job (checkpoints kept, its secrets file removed)."""
        scancel(self.job_id, [self.secrets] if self.secrets else [])
