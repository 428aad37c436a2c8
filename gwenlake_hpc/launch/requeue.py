"""The requeue decision, taken in the batch script after the job step ends (submitit's ``teardown``).

SLURM requeues a ``--requeue`` job by itself on preemption and on node failure. It does not on a time limit
nor when the job step is killed without warning (SIGKILL, out of memory); this module covers those two, and
never a preemption: whether an eviction was a time limit is decided from the job's real remaining time as
SLURM reports it, not from which signal arrived (some clusters send ``--signal`` on preemption too).

The batch shell ignores SIGTERM (so that srun does not SIGKILL the step), so this code also runs after a
preemption or a scancel. It then finds the job no longer RUNNING (COMPLETING, CANCELLED, PREEMPTED...): SLURM is
ending the job itself and nothing is requeued here, whatever the remaining time.

The budget counts starts that made no progress. A training meant to span many allocations (a week on a
partition limited to 24 h) is requeued as long as each start seals a newer checkpoint; one that loops without
progress (out of memory at the same step, a crash on resume) is not. ``--max-retries`` bounds the starts *in a
row* whose end found no checkpoint sealed since the batch script began (``--started``, its ``date +%s``; the
newest ``<run dir>/checkpoints/step-N`` with a manifest); ``--max-starts`` bounds all starts (SLURM's restart
count + 1, preemptions included). Without ``--run-dir`` (a script written by hand) every start counts as one
without progress, so ``--max-retries`` bounds the requeues in all.

The teardown keeps the job's own record, ``<run dir>/slurm/<job>/teardown.json`` (:func:`record_path`): each
start's exit status, newest sealed step, whether it advanced it, the decision and the rule that ended the job,
the starts without progress in a row, and the version of a start that finished. ``status`` reads it.

A start ended by the hang watchdog (:mod:`gwenlake_hpc.job.watchdog`: the step killed, a new
``<run dir>/hangs/<start>/verdict.json``) is requeued like any killed step, within the same budgets, unless the
start before it in this job hung at the same step: a hang that recurs at one step is deterministic (a deadlock
in the code, a corrupt sample) and the job ends FAILED, naming the stacks, with no third start.

``--secrets FILE`` (the job's 0600 file of secret values) is removed once the job ends for good (finished,
failed, out of budget, or ended by SLURM without a requeue: scancel, SLURM's own time limit) and kept across
requeues.

The module uses the standard library only and runs as a plain file too (``python3 requeue.py --rc ...``): a job
in a container image runs its teardown on the host, whose Python may not have gwenlake_hpc
(:mod:`gwenlake_hpc.launch.container` copies this file into the job's folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: The exit status of an evicted training (:data:`gwenlake_hpc.base.errors.EXIT_EVICTED`; a test checks they agree).
EXIT_EVICTED = 75
#: The exit status of a start that refused its settings or its run (:data:`gwenlake_hpc.base.errors.EXIT_USAGE`).
EXIT_USAGE = 2
#: ``launcher.max_starts`` by default: starts of one job in all, progress or not.
DEFAULT_MAX_STARTS = 100
#: The job's own record in ``<run dir>/slurm/<job>/`` (see :func:`record_path`).
RECORD_NAME = "teardown.json"

log = logging.getLogger("gwenlake_hpc.launch.requeue")

#: An eviction with at most signal_delay_s + this many seconds left is a time limit: SLURM may send the
#: warning signal up to 60 s early, and the checkpoint and exit take some seconds more.
TIME_LIMIT_SLACK_S = 90
_STEP_DIR = re.compile(r"^step-(\d{9,})$")


@dataclass(frozen=True)
class Decision:
    """``action``: ``done`` (success), ``requeue``, ``leave`` (SLURM decides) or ``fail``; ``reason`` says why;
    ``rule``: the setting that ended the job (``launcher.max_retries``, ``launcher.max_starts``), else None."""

    action: str
    reason: str
    rule: str | None = None


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
           state: str | None = None, stalled: int | None = None, max_starts: int = DEFAULT_MAX_STARTS,
           hang: dict | None = None, previous_hang: dict | None = None) -> Decision:
    """What to do after the job step ended with status ``rc``.

    Args:
        rc: the step's exit status as the batch shell sees it (0 done, 75 evicted, 1 the training raised,
            >128 or 137 killed by a signal).
        restarts: ``SLURM_RESTART_COUNT`` (0 on the first start).
        max_retries: the launcher's ``max_retries``: starts in a row without progress that are requeued.
        remaining_s: the job's remaining time from ``squeue -o %L``, None if unknown or unlimited.
        signal_delay_s: the ``--signal`` lead time.
        state: the job's state from ``squeue -o %T`` (None if unknown): anything but RUNNING means SLURM is
            ending the job (scancel, preemption, the time limit itself) and decides about it.
        stalled: starts in a row, this one included, that sealed no newer checkpoint (0: this one did); None
            when unknown, counted as ``restarts + 1`` (every start without progress).
        max_starts: the launcher's ``max_starts``: starts in all; the one numbered ``max_starts`` is the last.
        hang: this start's hang (:func:`new_hang`: ``{"folder", "step"}``), None when it did not hang;
            ``previous_hang``: the hang of the start before it in this job, if any.
    """
    if rc == 0:
        return Decision("done", "the training finished")
    if restarts + 1 > max_starts:  # SLURM requeued it past the cap itself; the job refused to train (exit 1)
        return Decision("fail", f"start {restarts + 1} is past launcher.max_starts={max_starts}: not run, not "
                                "requeued", "launcher.max_starts")
    if state and state != "RUNNING":
        return Decision("leave", f"the job is {state}: SLURM is ending it (scancel, preemption or time limit) "
                                 "and decides; no requeue from here")
    warned = rc in (128 + signal.SIGUSR2, -signal.SIGUSR2)  # killed by the time-limit warning before any handler
    if rc == EXIT_EVICTED or warned:
        if remaining_s is not None and remaining_s <= signal_delay_s + TIME_LIMIT_SLACK_S:
            return _budget(f"time limit ({remaining_s} s left)", restarts, max_retries, stalled, max_starts)
        if warned and remaining_s is not None:
            return _budget(f"job step killed by SIGUSR2 with {remaining_s} s left (the warning came before its "
                           "handlers existed)", restarts, max_retries, stalled, max_starts)
        return Decision("leave", f"evicted with {remaining_s} s left: a preemption or a cancel, SLURM decides")
    if rc == EXIT_USAGE:
        return Decision("fail", "the start refused its settings or its run (exit 2: the log above names the setting "
                                "or the start that holds the run): not requeued")
    if rc > 128 or rc < 0:
        sig = rc - 128 if rc > 128 else -rc
        if hang is not None:
            where = f"hang at step {hang['step']} (stacks: {hang['folder']}/rank*.txt)"
            if previous_hang is not None and previous_hang.get("step") == hang["step"]:
                return Decision("fail", f"{where}: the start before hung at the same step, so the hang recurs "
                                        "there: not requeued (fix the code or data at that step; the stacks show "
                                        "where every rank stood)", "job.hang_timeout_s")
            return _budget(where, restarts, max_retries, stalled, max_starts)
        return _budget(f"job step killed by signal {sig} (out of memory or killed)", restarts, max_retries, stalled,
                       max_starts)
    return Decision("fail", f"the training failed with exit status {rc} (traceback above)")


def _budget(what: str, restarts: int, max_retries: int, stalled: int | None, max_starts: int) -> Decision:
    starts = restarts + 1
    in_a_row = starts if stalled is None else stalled
    if starts >= max_starts:
        return Decision("fail", f"{what}: not requeued, this was start {starts} and launcher.max_starts={max_starts} "
                                "caps all starts", "launcher.max_starts")
    if in_a_row > max_retries:
        return Decision("fail", f"{what}: not requeued, {in_a_row} start(s) in a row sealed no newer checkpoint "
                                f"and launcher.max_retries={max_retries} requeues at most {max_retries} in a row",
                        "launcher.max_retries")
    progress = ("progress unknown, counted as none" if stalled is None else
                "this start sealed a newer checkpoint" if stalled == 0 else
                f"{stalled} start(s) in a row without a newer checkpoint")
    return Decision("requeue", f"{what}: requeue, start {starts + 1}/{max_starts} ({progress}; "
                               f"launcher.max_retries={max_retries} in a row allowed)")


def newest_sealed(run_dir: Path) -> tuple[int, float] | None:
    """(step, seal time in Unix seconds) of the newest sealed checkpoint of ``run_dir``: the highest
    ``checkpoints/step-N`` whose ``MANIFEST.json`` names step N (its ``created``, else the file's mtime).
    None when there is none."""
    root = Path(run_dir) / "checkpoints"
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = sorted((int(m.group(1)), name) for m, name in ((_STEP_DIR.match(n), n) for n in names) if m)
    for step, name in reversed(steps):
        manifest_path = root / name / "MANIFEST.json"
        try:
            manifest = json.loads(manifest_path.read_text())
            created = manifest.get("created") if isinstance(manifest, dict) else None
            if not isinstance(manifest, dict) or manifest.get("step") != step:
                continue
            return step, float(created) if isinstance(created, (int, float)) else manifest_path.stat().st_mtime
        except (OSError, ValueError):
            continue
    return None


def new_hang(run_dir: Path, record: dict, started: float | None) -> dict | None:
    """This start's hang: the newest ``<run_dir>/hangs/<start>/verdict.json`` (the hang watchdog's, see
    :mod:`gwenlake_hpc.job.hang_report`) that no earlier start in ``record`` claimed and that was written after
    ``started`` (the batch script's start, Unix s: a hang comes at least a step's limit after it, far more than
    two nodes' clocks differ), as ``{"folder": its folder, "step": the step where the first rank stopped}``;
    None when there is none."""
    claimed = {(s.get("hang") or {}).get("folder") for s in record.get("starts", []) if isinstance(s, dict)}
    root = Path(run_dir) / "hangs"
    try:
        names = sorted(os.listdir(root), reverse=True)  # <start> is YYYYmmdd-HHMMSS: newest first
    except OSError:
        return None
    for name in names:
        folder = root / name
        if str(folder) in claimed:
            return None  # the newest hang is an earlier start's: this one did not hang
        try:
            verdict = json.loads((folder / "verdict.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(verdict, dict) or not isinstance(verdict.get("step"), int):
            continue
        written = verdict.get("time")
        if started is not None and isinstance(written, (int, float)) and written < started:
            return None  # an earlier job's hang (another submission of this run)
        return {"folder": str(folder), "step": verdict["step"]}
    return None


def record_path(run_dir: Path, job_ref: str) -> Path:
    """The job's own record: ``<run_dir>/slurm/<job_ref>/teardown.json`` (``job_ref``: ``<id>`` or
    ``<array id>_<task>``)."""
    return Path(run_dir) / "slurm" / job_ref / RECORD_NAME


def read_record(run_dir: Path, job_ref: str) -> dict:
    """The job's record (see the module's docstring); ``{}`` when there is none or it is unreadable."""
    try:
        data = json.loads(record_path(run_dir, job_ref).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_record(path: Path, record: dict) -> None:
    """Replace the job's record durably: temporary file beside it, fsync, rename, fsync of the folder.

    This is :func:`gwenlake_hpc.base.fsutil.write_atomic` written out again, because this module must run as a
    plain file on a host without gwenlake_hpc (see the module's docstring) and so imports nothing from it.
    A reader sees the old record or the new one, never half of one; the record survives a crash of the node.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # the record's own durable write, as the docstring says
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a file system that cannot open a folder: the record itself is already synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def slurm_job_ref() -> str:
    """``<array job id>_<task id>`` for an array task, else ``SLURM_JOB_ID``."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def job_state(job_ref: str) -> tuple[str | None, int | None]:
    """The job's state and remaining seconds as SLURM reports them (``squeue -h -j REF -o "%T %L"``).

    ``(None, None)`` when squeue does not answer or no longer lists the job.
    """
    fields = _run(["squeue", "-h", "-j", job_ref, "-o", "%T %L"]).split()
    if len(fields) < 2:
        return None, None
    return fields[0], parse_slurm_time(fields[1])


def slurm_requeues(job_ref: str, restarts: int) -> bool | None:
    """Whether SLURM itself will start the ending job again (a preemption): ``scontrol show job`` then counts
    the next restart already and has no end time. False when it shows neither (a scancel, SLURM's time limit);
    None when it does not answer."""
    fields = dict(kv.split("=", 1) for kv in _run(["scontrol", "-o", "show", "job", job_ref]).split() if "=" in kv)
    if not fields.get("Restarts", "").isdigit():
        return None
    if int(fields["Restarts"]) > restarts or fields.get("EndTime", "Unknown") in ("Unknown", "None", ""):
        return True
    return False


def ends_for_good(d: Decision, state: str | None, job_ref: str, restarts: int, requeued: bool) -> bool:
    """Whether the job will not start again after this teardown (its secrets may go): done, failed, a failed
    ``scontrol requeue``, or SLURM ending it (not RUNNING) without a requeue of its own. When unsure: False."""
    if d.action in ("done", "fail"):
        return True
    if d.action == "requeue":
        return not requeued
    if state in (None, "RUNNING"):  # with a preemption's GraceTime, SLURM may still requeue a job that RUNs
        return False
    return slurm_requeues(job_ref, restarts) is False


def _progressed(newest: tuple[int, float] | None, record: dict, started: float | None) -> bool | None:
    """Whether this start sealed a newer checkpoint. After an earlier start of this job, by step numbers (no
    clock involved); on the job's first start, by the seal time against the batch script's start (a node's
    clock against another's: NTP keeps them within far less than a start lasts). None when unknown."""
    earlier = [s.get("newest_step") for s in record.get("starts", []) if isinstance(s, dict)]
    if earlier:
        before = max((s for s in earlier if isinstance(s, int)), default=-1)
        return newest is not None and newest[0] > before
    if started is None:
        return None
    return newest is not None and newest[1] >= started


def _completed_version(run_dir: Path) -> str | None:
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text())
        return (info.get("completed") or {}).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def _mark_run_failed(run_dir: Path) -> None:
    """A killed training that is not started again cannot end its MLflow run: mark it FAILED (and deliver what
    its spool holds) through ``gwenlake_hpc.stores.tracking.delivery.sync``, where this Python has gwenlake_hpc
    and the run reported to MLflow. Best effort: ``tracking sync`` does the same by hand."""
    import importlib.util

    if not (run_dir / "tracking" / "run_id").is_file():
        return
    if importlib.util.find_spec("gwenlake_hpc") is None:
        log.info("the MLflow run stays RUNNING: run `python -m gwenlake_hpc tracking sync %s` where gwenlake_hpc "
                 "is installed", run_dir)
        return
    try:
        proc = subprocess.run([sys.executable, "-m", "gwenlake_hpc.stores.tracking.delivery.sync", str(run_dir),
                               "--status", "FAILED", "--timeout", "60"], capture_output=True, text=True, timeout=120)
        log.info("MLflow run marked FAILED%s", "" if proc.returncode == 0 else f" (incomplete: {proc.stderr[-300:]})")
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not mark the MLflow run FAILED: %s", exc)


def main(argv: list[str] | None = None) -> int:
    """``python -m gwenlake_hpc.launch.requeue --rc RC --max-retries N --signal-delay S [--max-starts M]
    [--started UNIX_S] [--run-dir DIR] [--secrets FILE]``; returns the job's exit status."""
    logging.basicConfig(level=logging.INFO, format="[gwenlake requeue] %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser()
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--max-retries", type=int, required=True, help="starts in a row without progress requeued")
    p.add_argument("--max-starts", type=int, default=DEFAULT_MAX_STARTS, help="starts in all")
    p.add_argument("--signal-delay", type=int, required=True)
    p.add_argument("--started", default="", help="Unix seconds when the batch script began (this start)")
    p.add_argument("--run-dir", default="", help="the run directory, whose checkpoints tell progress")
    p.add_argument("--secrets", default="", help="the job's secrets file, removed when the job ends for good")
    a = p.parse_args(argv)
    ref = slurm_job_ref()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    state, remaining = job_state(ref) if a.rc != 0 else (None, None)
    run_dir = Path(a.run_dir) if a.run_dir else None
    started = float(a.started) if re.fullmatch(r"\d+(\.\d+)?", a.started) else None
    record = read_record(run_dir, ref) if run_dir and restarts > 0 else {}  # a first start's: another job's id
    newest = newest_sealed(run_dir) if run_dir else None
    progressed = _progressed(newest, record, started) if run_dir is not None else None
    before = int(record.get("stalled") or 0)
    stalled = None if progressed is None else 0 if progressed else before + 1
    hang = new_hang(run_dir, record, started) if run_dir is not None and (a.rc > 128 or a.rc < 0) else None
    starts = [s for s in record.get("starts", []) if isinstance(s, dict)]
    previous_hang = starts[-1].get("hang") if starts else None
    d = decide(a.rc, restarts, a.max_retries, remaining, a.signal_delay, state, stalled, a.max_starts, hang,
               previous_hang)
    log.info("job %s step ended with status %d: %s", ref, a.rc, d.reason)
    status = 0 if d.action == "done" else (a.rc if a.rc > 0 else 1)
    requeued = False
    if d.action == "requeue":
        proc = subprocess.run(["scontrol", "requeue", ref], capture_output=True, text=True)
        requeued = proc.returncode == 0
        if requeued:
            status = 0
        else:
            log.error("scontrol requeue %s failed: %s", ref, proc.stderr.strip())
    final = ends_for_good(d, state, ref, restarts, requeued)
    if run_dir is not None:
        # a start SLURM ended (preemption) counts only when it advanced: the stop was not the training's doing
        record["stalled"] = stalled if d.action in ("requeue", "fail") else (0 if progressed else before)
        record.setdefault("starts", []).append({
            "restart": restarts, "rc": a.rc, "started": started, "ended": time.time(), "state": state,
            "newest_step": newest[0] if newest else None, "progressed": progressed, "action": d.action,
            "reason": d.reason, "rule": d.rule, "final": final, "hang": hang})
        if d.action == "done":
            record["version"] = _completed_version(run_dir)
        try:
            _write_record(record_path(run_dir, ref), record)
        except OSError as exc:  # the decision stands without its record
            log.warning("could not write the job's record under %s: %s", run_dir, exc)
    if final and d.action == "fail" and run_dir is not None and (a.rc > 128 or a.rc < 0):
        _mark_run_failed(run_dir)
    if final and a.secrets:
        try:
            os.unlink(a.secrets)
            log.info("the job ended: its secrets file %s was removed", a.secrets)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the secrets file %s: %s", a.secrets, exc)
    return status


if __name__ == "__main__":
    sys.exit(main())
