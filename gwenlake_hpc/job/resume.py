"""Where a start of a job resumes: the one owner of the resume decision.

A start of a run either finishes nothing (the run already committed a version for these ``job.steps`` /
``job.epochs``: :func:`finished_with`), starts afresh, or resumes from a sealed checkpoint of its run directory.
:func:`resume_point` decides which, and why, from the job's settings (``job.resume``, ``job.steps``) over the
checkpoint store's primitives and its resume rule (:func:`~gwenlake_hpc.stores.checkpoints.resume.resume_from`,
shared with the Run: ``auto``/``never``), the store (:class:`~gwenlake_hpc.stores.checkpoints.CheckpointStore`: ``complete`` lists
the sealed checkpoints, ``latest`` verifies them newest first and sets damaged ones aside,
``set_aside_if_damaged``). The store knows nothing of the job's settings; the rules live here:

- ``job.resume=never`` with checkpoints of this run is refused (nothing is deleted);
- ``job.steps`` below the newest checkpoint's step is refused (the run cannot go back);
- ``job.resume=auto``: the newest intact checkpoint; a damaged newer one is set aside (renamed
  ``.damaged-step-<n>-<id>``) and the previous one is used; one found damaged only while ``load_state`` reads it
  is set aside too and the training function starts again from the previous one (:func:`retry_after_damaged_load`).

The launchers call :func:`resume_point` before they submit (a refused setting fails at once, not after hours in
the queue) and the job calls it again where it runs; both read manifests only (no file is hashed; nothing is
written but, by rank 0 of a start, a damaged pointer or the damaged checkpoint it names set aside:
:mod:`gwenlake_hpc.stores.checkpoints.pointer`). The Run then opens the checkpoint: it verifies the files
(``CheckpointStore.latest``) and sets aside a damaged one. Imports no torch, no launcher.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..base.errors import ConfigError
from ..base.fsutil import read_json
from ..stores.checkpoints import Checkpoint, CheckpointStore, DamagedFileError
from ..stores.checkpoints.resume import resume_from, resume_from_nothing

if TYPE_CHECKING:
    from ..runtime.run import Run
    from .plan import JobPlan

log = logging.getLogger("gwenlake_hpc.job")


def finished_with(info: Mapping[str, Any], steps: int | None, epochs: int | None) -> dict[str, Any] | None:
    """The completion in ``run.json`` (``info``) of a training of ``steps``/``epochs`` that committed a version,
    newest first; None when there is none (the run must train)."""
    for done in reversed(info.get("completions") or ([info["completed"]] if info.get("completed") else [])):
        if done.get("steps") == steps and done.get("epochs") == epochs and done.get("version"):
            return dict(done)
    return None


@dataclass(frozen=True)
class ResumePoint:
    """What a start of a run does with the run directory's checkpoints.

    Attributes:
        checkpoint: the newest sealed checkpoint of this run (its manifest read, its files not yet hashed: the
            Run verifies them when it opens it, and falls back to the previous intact one if they are damaged),
            or None when the start trains from step 0 or does not train.
        finished: the run already committed a version for these ``steps``/``epochs``: nothing to train.
        why: one line for the log: which checkpoint and why, or why none.
    """

    checkpoint: Checkpoint | None
    finished: bool
    why: str


def resume_point(p: JobPlan, wait_s: float = 0.0, local: Path | None = None, repair: bool = False) -> ResumePoint:
    """Decide where this start of ``p``'s run resumes (see the module docstring), before it trains or is
    submitted.

    Reads ``<run_dir>/run.json`` and the checkpoints' manifests; hashes no file and writes nothing unless
    ``repair`` (rank 0 of a start holding the run: a damaged pointer or the damaged checkpoint it names is set
    aside, :func:`~gwenlake_hpc.stores.checkpoints.pointer.follow`; otherwise only logged). ``wait_s``
    (``checkpoint.visible_wait_s`` for a start that trains; 0 for a submission): how long to wait for a checkpoint
    the run's pointer names but this node's listing does not show. ``local``: the run's folder on this node's
    local level (``checkpoint.local_dir``; :func:`~gwenlake_hpc.stores.checkpoints.levels.local_root`), whose newer
    checkpoint the start resumes from; None: the shared level alone (a submission cannot see a node's disk).

    Raises:
        ConfigError: ``job.resume=never`` with checkpoints of this run, or ``job.steps`` below the newest
            checkpoint's step (nothing is deleted; the message says what to change).
    """
    done = finished_with(read_json(p.run_dir / "run.json", default=None) or {}, p.steps, p.epochs)
    if done is not None:
        return ResumePoint(None, True, f"finished at step {done.get('final_step')} as version {done['version']}")
    folder = p.run_dir / "checkpoints"  # not created here: a refused or dry-run submission writes nothing
    near = CheckpointStore(local / "checkpoints", p.key) if local is not None and (local / "checkpoints").is_dir() \
        else None
    newest = resume_from(CheckpointStore(folder, p.key), p.resume, verify=False, wait_s=wait_s, local=near,
                         repair=repair) \
        if folder.is_dir() or near is not None else resume_from_nothing(p.resume)
    if p.steps is not None and newest is not None and newest.step > p.steps:
        raise ConfigError(f"job.steps={p.steps} is below step {newest.step} of this run's newest checkpoint; "
                          f"use job.steps>={newest.step}, or a new run name (job.model=...)")
    if newest is None:
        return ResumePoint(None, False, f"no checkpoint of this run yet (job.resume={p.resume}): from step 0")
    level = " on this node's local level" if near is not None and newest.path.parent == near.root else ""
    return ResumePoint(newest, False, f"job.resume=auto: the newest sealed checkpoint, {newest.path.name}{level} "
                                      "(an older one if its files are damaged)")


def retry_after_damaged_load(run: Run, exc: DamagedFileError) -> bool:
    """A file of the checkpoint the run resumed from failed its digest while ``load_state`` read it.

    Sets that checkpoint aside (as a damaged one found up front is) so the next Run resumes from the previous
    intact checkpoint. Returns False when the training cannot simply start again: the damaged file is not in
    the resume checkpoint, the loop already ran, or the run has several tasks (the job then fails; rerun it).
    """
    if exc.checkpoint is None or run.resume_path is None or exc.checkpoint.absolute() != run.resume_path.absolute():
        return False
    if run.is_main:  # the store of the level it is on (the shared one, or this node's local one)
        moved = CheckpointStore(run.resume_path.parent, run.run_key).set_aside_if_damaged(run.resume_path, str(exc))
        log.warning("checkpoint %s is damaged (%s); set aside as %s", run.resume_path, exc,
                    moved.name if moved else "?")
    if run.dist.enabled:
        log.error("rerun the job: it resumes from the previous intact checkpoint")
        return False
    if run.loop_started:
        return False
    log.warning("starting the training function again from the previous intact checkpoint")
    return True
