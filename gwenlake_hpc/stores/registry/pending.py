"""Registrations to do later: versions a training committed but could not register in MLflow yet
(``<state_dir>/pending_registrations.json``), completed by ``tracking sync`` or the next start."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from ...base.errors import GwenlakeError
from ..versioning import read_file
from .aliases import current_aliases
from .load import load_model
from .mlflow_registry import mlflow_set_alias, register_version, version_tags

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["PENDING_REGISTRATIONS", "add_pending", "complete_pending_registrations", "warn_if_pending"]


#: In a run's tracking state folder: versions committed but not registered yet (a JSON list).
PENDING_REGISTRATIONS = "pending_registrations.json"


@contextlib.contextmanager
def _pending_lock(state_dir: Path) -> Any:
    # The list is read and rewritten by the end of a training and by the delivery process of the next start (or
    # tracking sync) at once: one at a time, or an entry added meanwhile would be lost.
    import fcntl

    with open(Path(state_dir) / (PENDING_REGISTRATIONS + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def add_pending(state_dir: Path, entry: Mapping[str, str]) -> None:
    from ...base.fsutil import read_json, write_json_atomic

    path = Path(state_dir) / PENDING_REGISTRATIONS
    with _pending_lock(state_dir):
        todo = [e for e in (read_json(path, default=None) or []) if e.get("version") != entry["version"]]
        write_json_atomic(path, todo + [dict(entry)])


def complete_pending_registrations(state_dir: str | os.PathLike[str], tracking_uri: str) -> list[str]:
    """Register the versions a training committed but could not register (``pending_registrations.json``).

    Called by ``tracking sync`` and, in the delivery process, by the next start of the training once its run is
    attached. Each is registered with the run id now in ``<state_dir>/run_id``, its git aliases mirrored to
    MLflow, and taken off the list. Returns the versions registered; those that fail stay listed (with a
    warning).
    """
    from ...base.fsutil import read_json, write_json_atomic

    state_dir = Path(state_dir)
    path = state_dir / PENDING_REGISTRATIONS
    todo = read_json(path, default=None) or []
    run_file = state_dir / "run_id"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    done: list[str] = []
    for entry in todo:
        try:
            if not run_id:
                raise GwenlakeError("the training's MLflow run does not exist yet")
            m = load_model(entry["model"], entry["version"], repo=entry.get("repo"))
            extra = {rel: read_file(entry.get("repo"), entry["model"], entry["version"], rel)
                     for rel in ("metrics.json", "lineage.json")}
            register_version(tracking_uri, entry["model"], m.version, run_id, m.path, version_tags(m.lineage), extra)
            for alias, sha in current_aliases(entry["model"], entry.get("repo")).items():
                if sha == m.version:
                    mlflow_set_alias(tracking_uri, entry["model"], alias, sha)
            done.append(m.version)
        except Exception as exc:  # noqa: BLE001 - kept on the list, said why
            log.warning("could not register %s version %s yet: %s", entry.get("model"), entry.get("version"), exc)
    if done:
        with _pending_lock(state_dir):  # entries added meanwhile stay
            left = [e for e in (read_json(path, default=None) or []) if e.get("version") not in done]
            if left:
                write_json_atomic(path, left)
            else:
                path.unlink(missing_ok=True)
        log.info("registered the pending version(s) %s", ", ".join(v[:12] for v in done))
    return done


def warn_if_pending(state_dir: Path, model_name: str, version: str) -> bool:
    """After a deferred registration (:func:`after_commit` with ``defer``): warn, naming the command that
    completes it, when ``version`` is still on ``<state_dir>/pending_registrations.json`` (MLflow unreachable,
    no run attached, the delivery process out of time). Returns True when it is still pending."""
    from ...base.fsutil import read_json

    try:
        todo = read_json(Path(state_dir) / PENDING_REGISTRATIONS, default=None) or []
    except (OSError, ValueError):
        todo = []
    if not any(e.get("version") == version for e in todo):
        return False
    run_dir = state_dir.parent if state_dir.name.startswith("tracking") else state_dir
    log.warning("%s version %s is committed but not registered in the MLflow Model Registry yet; "
                "`python -m gwenlake_hpc tracking sync %s` registers it once MLflow answers (the next start of "
                "this training does too)", model_name, version[:12], run_dir)
    return True
