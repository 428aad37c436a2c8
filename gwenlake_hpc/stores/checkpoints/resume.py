"""The resume rule over a run's checkpoint store: which sealed checkpoint a start resumes from.

One rule, two readers: :func:`gwenlake_hpc.job.resume.resume_point` (before a job is submitted or trains:
manifests only, ``verify=False``) and the Run as it starts (``verify=True``: the files are checked against
their manifests and a damaged newer checkpoint is set aside). ``resume`` is the ``job.resume`` setting:

- ``auto``: the newest sealed checkpoint (with ``verify``, the newest intact one);
- ``never``: none, and a store that already holds checkpoints of this run is refused (nothing is deleted).

The job's own rules (a finished run, ``job.steps`` below the newest step) are in :mod:`gwenlake_hpc.job.resume`.
"""

from __future__ import annotations

from ...base.errors import ConfigError
from .manifest import Checkpoint
from .store import CheckpointStore

#: The accepted values of ``job.resume``.
RESUME_CHOICES = ("auto", "never")


def resume_from(store: CheckpointStore, resume: str, *, verify: bool, wait_s: float = 0.0,
                local: CheckpointStore | None = None, repair: bool | None = None) -> Checkpoint | None:
    """The checkpoint of ``store`` a start resumes from under ``job.resume=resume``, or None (from step 0).

    With a node-local level ``local`` (``checkpoint.local_dir``, see :mod:`.levels`): its newest checkpoint
    when it is newer than the shared level's newest (with ``verify``: newer and intact; a damaged one is set aside
    and the next one tried), else the shared level's. An equal step resumes from the shared level.

    With ``verify`` the files are hashed (:meth:`CheckpointStore.latest`) and damaged checkpoints set aside;
    without, only manifests are read and nothing is written. ``wait_s``: how long to wait for the checkpoint the
    run's pointer names when this node's listing does not show it (:meth:`CheckpointStore.complete`); a pointer
    whose checkpoint is damaged, or still not there after ``wait_s``, is set aside when ``repair`` (default:
    ``verify``; one process of the start), else only logged, and the listing decides.

    Raises:
        ConfigError: ``resume`` is ``never`` and the store holds checkpoints of this run, or ``resume`` is not
            one of :data:`RESUME_CHOICES`.
    """
    resume_from_nothing(resume)
    existing = store.complete(wait_s, repair=verify if repair is None else repair) if store.root.is_dir() else []
    near = local.complete() if local is not None and local.root.is_dir() else []
    if resume == "never":
        held = store if existing else local if near else None
        if held is not None:
            raise ConfigError(f"job.resume=never but {held.root} already holds checkpoints of this run; nothing is "
                              "deleted: move them away or use job.resume=auto")
        return None
    far = existing[-1].step if existing else -1
    mine = (local.latest() if verify else near[-1]) if local is not None and near else None
    if mine is not None and mine.step > far:
        return mine
    if not existing:
        return None
    shared = store.latest() if verify else existing[-1]
    # the shared newest damaged and set aside: an intact local one newer than what is left wins
    if mine is not None and (shared is None or mine.step > shared.step):
        return mine
    return shared


def resume_from_nothing(resume: str) -> None:
    """The rule where a run has no checkpoint folder yet: every start trains from step 0 (returns None).

    Raises:
        ConfigError: ``resume`` is not one of :data:`RESUME_CHOICES`.
    """
    if resume not in RESUME_CHOICES:
        raise ConfigError(f"job.resume={resume!r}: use one of {', '.join(RESUME_CHOICES)}")
    return None
