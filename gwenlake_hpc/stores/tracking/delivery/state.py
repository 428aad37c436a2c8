"""The tracking state folder of a run (``<run_dir>/tracking``): what outlives the training process.

Everything lives on the shared filesystem, so the next start of the training, on any node, and ``tracking
sync`` find it::

    tracking.json      {uri (password removed), experiment, run_name, artifact_location, params, tags};
                       written by every Tracker at start, read by the delivery process and by sync
    run_id             the MLflow run id, written atomically once the run exists
    spool/             the points and tags not delivered yet (see :mod:`.spool`)
    pending_status     {"status", "end_time"}: a terminal status not delivered yet
    deliver.lock       held by the one process delivering this folder (the delivery process, or sync)
    pending_registrations.json   versions committed but not registered yet (written by the registry)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ....base.fsutil import write_atomic
from ..uri import redact_uri, validate_uri

logger = logging.getLogger("gwenlake_hpc.tracking")

TRACKING_JSON = "tracking.json"
RUN_ID_FILE = "run_id"
PENDING_STATUS_FILE = "pending_status"
#: Written by versions before the delivery process (tags now travel in the spool); still delivered by sync.
PENDING_TAGS_FILE = "pending_tags.json"
DELIVER_LOCK = "deliver.lock"

#: Statuses accepted by ``Tracker.finish``.
TERMINAL_STATUSES = ("FINISHED", "KILLED", "FAILED")


def read_run_id(state_dir: Path) -> str | None:
    """The run id in ``state_dir/run_id``, or None when the run was never created."""
    try:
        run_id = (state_dir / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return run_id or None


def read_pending_status(state_dir: Path) -> tuple[str, int | None] | None:
    """The terminal status waiting in ``state_dir/pending_status`` and its end time (ms), or None."""
    try:
        text = (state_dir / PENDING_STATUS_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        status, end_time = str(data["status"]), data.get("end_time")
    except (ValueError, TypeError, KeyError):
        status, end_time = text, None  # a bare status word, written by hand
    status = status.upper()
    if status not in TERMINAL_STATUSES:
        logger.warning("tracking: ignoring unknown status %r in %s", status, state_dir)
        return None
    return status, (int(end_time) if end_time is not None else None)


def write_pending_status(state_dir: Path, status: str, end_time: int) -> None:
    """Record a terminal status to deliver later (atomically)."""
    write_atomic(state_dir / PENDING_STATUS_FILE, json.dumps({"status": status, "end_time": end_time}) + "\n")


def read_json_dict(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` when it is missing or unreadable (with a warning)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError:
        logger.warning("tracking: ignoring unreadable %s", path)
        return {}
    return data if isinstance(data, dict) else {}


def sync_hint(state_dir: Path) -> str:
    """The command that delivers what ``state_dir`` holds (it takes the run directory)."""
    run_dir = state_dir.parent if state_dir.name.startswith("tracking") else state_dir
    return f"python -m gwenlake_hpc tracking sync {run_dir}"


def state_dir_for(run_dir: str | os.PathLike[str], uri: str) -> Path:
    """The tracking state folder of a run for ``uri``: ``<run_dir>/tracking`` for the URI the run first
    reported to, ``<run_dir>/tracking-<hash>`` for another one.

    An MLflow run lives in one store: after a change of ``tracking.uri`` the run reports into a run of its
    own in the new store (whole from then on) instead of re-pointing the first one's run id at a store that
    does not know it, and a later return to the first URI finds its run again.
    """
    base = Path(run_dir) / "tracking"
    stored = read_json_dict(base / TRACKING_JSON).get("uri")
    if stored is None or stored == redact_uri(validate_uri(uri), keep_user=True):
        return base
    digest = hashlib.sha256(redact_uri(uri, keep_user=True).encode()).hexdigest()[:8]
    logger.warning("tracking.uri differs from the one this run first reported to (%s); reporting into a separate "
                   "MLflow run for %s (state in %s)", redact_uri(stored), redact_uri(uri), base.name + "-" + digest)
    return Path(run_dir) / f"tracking-{digest}"
