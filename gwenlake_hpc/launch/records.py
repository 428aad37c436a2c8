"""The index of the jobs submitted from a runs root (``<runs_root>/.gwenlake-jobs.jsonl``): one JSON line per
job, appended at submission (SLURM, a sweep's tasks, a cluster over SSH), read by ``status``, ``logs`` and
``cancel``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

JOBS_INDEX = ".gwenlake-jobs.jsonl"


def record_job(p: Any, sub: Any, target: str, overrides: list[str] | None = None) -> None:
    """Append a submitted job to ``<runs_root>/.gwenlake-jobs.jsonl`` (read by status, logs, cancel)."""
    record = {"job_id": sub.job_id, "run_dir": str(p.run_dir), "model": p.model_name, "run_key": p.key,
              "target": target, "submitted": time.time(), "stdout": str(sub.stdout), "stderr": str(sub.stderr),
              "folder": str(sub.folder), "overrides": overrides or []}
    if getattr(sub, "secrets", None) is not None:  # the path of its secrets file (`cancel` removes it), no value
        record["secrets"] = str(sub.secrets)
    index = p.runs_root / JOBS_INDEX
    index.parent.mkdir(parents=True, exist_ok=True)
    with open(index, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def job_records(runs_root: Path) -> list[dict[str, Any]]:
    """Jobs submitted from here (newest last), from ``<runs_root>/.gwenlake-jobs.jsonl``."""
    path = Path(runs_root) / JOBS_INDEX
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
