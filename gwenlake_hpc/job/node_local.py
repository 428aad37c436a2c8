"""The node-local level of checkpoints as the job sees it, before the Run is built.

- :func:`local_level`: where this run's folder on this node's local level is (``checkpoint.local_dir``, else
  ``$SLURM_TMPDIR``), keyed to this run directory by the ``uid`` of ``run.json``, or None when it is off (and
  why, when ``$SLURM_TMPDIR`` cannot serve);
- :func:`sweep_local_levels`: rank 0 removes, before it trains, what other runs left on this node's level.

The level itself (the local store, the copy to the shared level, ``LEVELS.json``) is
:mod:`gwenlake_hpc.stores.checkpoints.levels`; the Run uses it (:mod:`gwenlake_hpc.runtime.run`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import GwenlakeError
from ..base.fsutil import read_json
from ..stores.checkpoints import CheckpointStore
from ..stores.checkpoints.levels import local_levels, local_root, sweep
from .plan import JobPlan

log = logging.getLogger("gwenlake_hpc.job")


def local_level(p: JobPlan, info: Mapping[str, Any]) -> Path | None:
    """The run's folder on this node's local level of checkpoints (``checkpoint.local_dir``, else
    ``$SLURM_TMPDIR``), or None when off; ``info``: the run's record, whose ``uid`` keys the folder to this run
    directory."""
    base = p.settings.checkpoint.local_level()
    if base is None and p.settings.checkpoint.local_dir is None and os.environ.get("SLURM_TMPDIR"):
        log.warning("SLURM_TMPDIR=%s is not an absolute path: no node-local checkpoint level (set "
                    "checkpoint.local_dir, or checkpoint.local_dir=off to silence this)", os.environ["SLURM_TMPDIR"])
    if base is not None and p.settings.checkpoint.local_dir is None and \
            (base.resolve() == p.runs_root.resolve() or p.runs_root.resolve() in base.resolve().parents):
        log.warning("SLURM_TMPDIR=%s is inside paths.runs_root=%s: no node-local checkpoint level (set "
                    "checkpoint.local_dir to a node-local path, or checkpoint.local_dir=off)", base, p.runs_root)
        return None
    return local_root(base, p.run_dir, p.key, str(info.get("uid") or "")) if base is not None else None


def sweep_local_levels(mine: Path) -> None:
    """Remove what other runs left on this node's local level (best effort, rank 0, before training): a folder
    of a run directory that is gone or was made anew (another ``run.json`` uid), or of a run whose shared level
    holds everything it has (finished, or trained on with ``checkpoint.local_dir=off``). A folder a process holds
    (:func:`~gwenlake_hpc.stores.checkpoints.levels.in_use`) is never touched; one whose newest checkpoint the
    shared level lacks (an eviction before its copy) stays for that run's next start on this node."""
    base = mine.parent.parent
    for folder, level in local_levels(base):
        if folder == mine:
            continue
        try:
            run_dir, key = Path(str(level.get("run_dir") or "")), str(level.get("run_key") or "")
            info = read_json(run_dir / "run.json", default=None) if run_dir.is_absolute() else None
            uid = info.get("uid") if isinstance(info, dict) else None
            why = "its run directory is gone" if uid is None else \
                "its run directory was made anew" if local_root(base, run_dir, key, str(uid)) != folder else None
            if why is None:
                near = CheckpointStore(folder / "checkpoints", key).complete() if (folder / "checkpoints").is_dir() \
                    else []
                far = CheckpointStore(run_dir / "checkpoints", key).complete() \
                    if (run_dir / "checkpoints").is_dir() else []
                if near and (not far or far[-1].step < near[-1].step):
                    continue  # it has what the shared level lacks
                why = "the shared level holds all it has"
            if sweep(folder):
                log.info("removed %s from the node-local checkpoint level: %s (run %s)", folder, why, run_dir)
        except (OSError, ValueError, GwenlakeError) as exc:  # another run's files: never a reason to fail this one
            log.debug("could not sweep %s: %s", folder, exc)
