"""What a start records of itself, in the run directory, for the starts after it and for ``status``/``report``.

- the run's record, ``run.json``: read as earlier starts left it (refused when damaged) or made from the plan
  (:func:`run_record`); this start's entry appended (time, host, pid, SLURM facts, container:
  :func:`record_start`) and its first step written as its loop begins (:func:`record_first_step`);
- the SLURM facts of this process (:func:`slurm_facts`, from its environment) and its queue times as the
  controller has them (:func:`slurm_queue_times`);
- this start's goodput ledger (:func:`start_ledger`, :mod:`gwenlake_hpc.runtime.ledger`), opened with those facts.

Called by the job (:mod:`gwenlake_hpc.job.execute`) under the run's lock; rank 0 alone writes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import ConfigError
from ..base.fsutil import read_json, write_json_atomic
from ..runtime import ledger as ledgers
from ..runtime.distributed import Dist
from .finish import Start
from .plan import JobPlan
from .run_environment import check_same_image, container_start

log = logging.getLogger("gwenlake_hpc.job")


# --- SLURM facts ----------------------------------------------------------------------------------------------

def slurm_facts() -> dict[str, str]:
    """SLURM job facts of this process from its environment (empty outside SLURM)."""
    keys = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT",
            "SLURM_JOB_PARTITION", "SLURM_JOB_NODELIST", "SLURM_PROCID")
    return {k: os.environ[k] for k in keys if k in os.environ}


def slurm_queue_times(job_id: str | None, run: Any = None) -> dict[str, Any]:
    """This start's times as the SLURM controller has them (``scontrol show job``: ``SubmitTime``,
    ``EligibleTime``, ``StartTime``, one clock) and ``queue_s``, its wait from eligible to started (seconds);
    {} outside SLURM or when scontrol does not answer within 10 s. ``run``: the command runner (tests)."""
    import re
    import subprocess
    from datetime import datetime

    if not job_id:
        return {}
    try:
        out = (run or (lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout))(
            ["scontrol", "show", "job", "-o", str(job_id)])
    except (OSError, subprocess.SubprocessError):
        return {}
    found = dict(re.findall(r"\b(SubmitTime|EligibleTime|StartTime)=(\S+)", out or ""))
    facts: dict[str, Any] = {k: found[n] for k, n in (("submitted", "SubmitTime"), ("eligible", "EligibleTime"),
                                                       ("started", "StartTime")) if n in found}
    try:
        facts["queue_s"] = max(0.0, (datetime.fromisoformat(found["StartTime"])
                                     - datetime.fromisoformat(found["EligibleTime"])).total_seconds())
    except (KeyError, ValueError):
        pass
    return facts


# --- run.json -------------------------------------------------------------------------------------------------

#: Seconds a start reads an unreadable ``run.json`` again before it calls it damaged (at most
#: ``checkpoint.visible_wait_s``): sshfs's and NFS's attribute caches last up to about 30 s.
RUN_JSON_WAIT_S = 40.0


def run_record(p: JobPlan, info_path: Path) -> dict[str, Any]:
    """The run's record (``run.json``) as earlier starts left it, or a new one from the plan.

    Raises:
        ConfigError: ``run.json`` is not a JSON object with a list of starts (edited, truncated by hand): the
            run is not touched.
    """
    # A node's cache of a network filesystem may show a run.json another node just replaced with the old size
    # (a cut read): read again for a while before calling it damaged.
    deadline = time.monotonic() + min(float(p.settings.checkpoint.visible_wait_s), RUN_JSON_WAIT_S)
    while True:
        try:
            info = read_json(info_path, default=None)
            break
        except ValueError as exc:
            info = exc
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
    if info is not None and not (isinstance(info, dict) and isinstance(info.get("starts", []), list)):
        why = f"not JSON ({info})" if isinstance(info, ValueError) else "not an object with a list of starts"
        raise ConfigError(f"{info_path} is damaged: {why}. Restore it from a copy, or move the run directory "
                          "aside to train the run anew")
    info = info or {
        "run_key": p.key, "model": p.model_name, "run_name": p.run_name, "target": p.tf.target,
        "params": p.params, "seed": p.seed, "datasets": p.dataset_facts, "init_models": p.model_versions,
        "created": time.time(), "starts": [], "completed": None,
    }
    # Tells this run directory from another one of the same run key (another runs_root): a version records it.
    info.setdefault("uid", uuid.uuid4().hex)
    return info


def record_start(p: JobPlan, info: dict[str, Any], info_path: Path, d: Dist) -> dict[str, Any] | None:
    """Append this start (time, host, pid, SLURM facts, container) to ``info`` and write it (rank 0).

    Returns the container this start runs in (``launcher.container``), None without one.

    Raises:
        ConfigError: the image changed while pinned (before anything is written).
    """
    start = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "first_step": None,
             **slurm_facts()}
    if d.enabled:
        start["world_size"] = d.world_size
    container = container_start()  # launcher.container: the image this start runs in (None without one)
    if container:
        check_same_image(info["starts"], container)  # warns, or refuses when pinned (before anything is written)
        start["container"] = container
    info["starts"].append(start)
    if d.is_main:
        write_json_atomic(info_path, info)
    log.info("run directory: %s (rank %d of %d)", p.run_dir, d.rank, d.world_size)
    return container


def record_first_step(start: Start, first: int, d: Dist) -> None:
    """Write this start's first step into its entry of ``run.json`` (rank 0) as its loop begins (a start that
    fails before, in the function's set-up, has none): ``report`` marks restarts there, not by comparing wall
    clocks of different hosts (a node whose clock is behind would put the mark at the wrong step)."""
    start.info["starts"][-1]["first_step"] = int(first)
    if d.is_main:
        write_json_atomic(start.info_path, start.info)


# --- the goodput ledger ---------------------------------------------------------------------------------------

def start_ledger(p: JobPlan, info: Mapping[str, Any], d: Dist) -> Any:
    """This start's goodput ledger (rank 0; None on the other ranks and for a short fit, which has no loop)."""
    if not d.is_main or getattr(p.tf, "is_short", False):
        return None
    index = ledgers.free_index(p.run_dir, len(info["starts"]) - 1)
    last = info["starts"][-1]
    facts = {"host": last.get("host"), "slurm_job_id": last.get("SLURM_JOB_ID"),
             "slurm_restart_count": last.get("SLURM_RESTART_COUNT"), "world_size": d.world_size,
             **slurm_queue_times(last.get("SLURM_JOB_ID"))}
    return ledgers.StartLedger(ledgers.start_path(p.run_dir, index), index, facts)
