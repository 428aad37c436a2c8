"""The checkpoints of a run in its run directory: :class:`CheckpointStore`, with retention that deletes only what
it can prove is ours.

The store owns the reader's and the keeper's side of the on-disk protocol (its names and format:
:mod:`.manifest`; the writer of one checkpoint: :class:`~.partial.PendingCheckpoint`, begun by
:meth:`CheckpointStore.begin`):

- the seal's last move (:meth:`CheckpointStore.publish`: the fence checked, the rename into place, the parent's
  fsync, the pointer moved), for a checkpoint written here and for a copy from the node-local level;
- the listing (:meth:`~CheckpointStore.complete`: only a sealed ``step-<n>`` with a manifest of this run key is a
  checkpoint, completed by the run's pointer, ``LATEST.json`` (:mod:`.pointer`), when a node's cached listing
  lags), verification against the manifest and the newest intact one (:meth:`~CheckpointStore.latest`);
- setting a damaged checkpoint aside (``.damaged-step-<n>-<id>``, kept for inspection);
- retention (:meth:`~CheckpointStore.retain`: a folder renamed away before it is deleted) and the cleanup of
  partials a killed process left (only a marked partial of this run is ours to remove).

Durable writes go through :mod:`gwenlake_hpc.base.fsutil`. Which checkpoint a job resumes from is the job's
decision (:mod:`gwenlake_hpc.job.resume`), made over these primitives.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...base.errors import CheckpointError, CheckpointExistsError, ConfigError
from ...base.fsutil import fsync_dir
from ...base.lease import check_fence
from . import pointer as _pointer
from .damage import entry_problem, manifest_problem, names_problem
from .manifest import COMPLETE_RE, FORMAT, MANIFEST, PARTIAL_MARK, PARTIAL_RE, RUN_STATE, Checkpoint, check_format
from .partial import PendingCheckpoint

if TYPE_CHECKING:
    from .buffers import BufferPool

log = logging.getLogger("gwenlake_hpc.checkpoints")

#: The run's pointer to its newest sealed checkpoint (``checkpoints/LATEST.json``; :mod:`.pointer`).
POINTER = _pointer.POINTER


class CheckpointStore:
    """The checkpoints of one run, in ``root`` (normally ``<run_dir>/checkpoints``).

    Args:
        root: the directory; created if missing.
        run_key: the run's key; a checkpoint whose manifest names another key is never read or deleted.
    """

    def __init__(self, root: str | os.PathLike, run_key: str):
        self.root = Path(root)
        self.run_key = run_key
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, step: int, buffers: BufferPool | None = None) -> PendingCheckpoint:
        """Start writing the checkpoint of ``step`` (steps completed); asynchronous when ``buffers`` is given."""
        return PendingCheckpoint(self, step, buffers=buffers)

    def publish(self, partial: Path, step: int) -> Path:
        """Seal the complete partial directory ``partial`` (files and manifest fsynced) as ``step-<step>``: the
        fence checked, the rename, the parent's fsync, the mark removed, the pointer moved. What
        :meth:`PendingCheckpoint.seal` and a copy from the node-local level (:mod:`.levels`) end with.

        Raises:
            FencedError: a newer start of the run holds it.
            CheckpointExistsError: an intact checkpoint of that step is there (kept as is), or the server has
                one this node's listing hid.
            CheckpointError: the rename failed otherwise.
        """
        final = self.root / f"step-{step:09d}"
        check_fence(f"sealing the checkpoint of step {step} in {self.root}")  # a start that lost the run seals nothing
        if final.exists():
            problem = self.problem_of(final)
            if problem is None:
                raise CheckpointExistsError(
                    f"a checkpoint for step {step} already exists at {final}; it is kept as is. This start "
                    "resumed from an older checkpoint than the run's newest (its node's cached listing of the shared "
                    "filesystem, with checkpoints/LATEST.json missing) or another start trains this run: run the "
                    "job again, the next start resumes from the newest")
            aside = self.set_aside_if_damaged(final, problem)
            # someone's folder renamed under their feet: say where it went
            log.warning("%s was in the way of this run's checkpoint of step %d (%s); set aside as %s, kept for "
                        "inspection", final, step, problem, aside)
        # A directory, so no publish (one file's fsync and os.replace, which would replace a rival's empty
        # folder): its files and folders are fsynced by the caller; the rename and the parent's fsync seal it.
        try:
            os.rename(partial, final)
        except OSError as exc:  # lost a race for the name, or the server has it: keep theirs, drop ours
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointExistsError(
                    f"could not seal the checkpoint of step {step}: {final} exists on the shared filesystem "
                    "(kept as is) though this node did not list it: this start resumed from an older checkpoint "
                    "than the run's newest, or another start trains this run; run the job again") from exc
            raise CheckpointError(f"could not seal the checkpoint of step {step} at {final}: {exc}") from exc
        fsync_dir(self.root)
        # The mark goes only now: a kill before the rename leaves a partial that cleanup can still prove ours.
        (final / PARTIAL_MARK).unlink(missing_ok=True)
        self.point_to(final)
        return final

    def _read_manifest(self, path: Path) -> dict[str, Any] | None:
        m = COMPLETE_RE.match(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            return None
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if isinstance(manifest, dict) and manifest.get("run_key") == self.run_key:  # a newer format: refused
            check_format(manifest.get("format"), FORMAT, f"checkpoint manifest {path / MANIFEST}",
                         manifest.get("writer"))
        # damaged (mistyped) or another run's: not a checkpoint of this run (.damage, .pointer set it aside)
        if manifest_problem(manifest, int(m.group(1))) is not None or manifest.get("run_key") != self.run_key:
            return None
        return manifest

    def open(self, name: str) -> Checkpoint | None:
        """The complete checkpoint ``<root>/<name>`` (e.g. ``step-000000100``) of this run, or None."""
        path = self.root / name
        manifest = self._read_manifest(path)
        return Checkpoint(path, int(manifest["step"]), manifest) if manifest is not None else None

    def complete(self, wait_s: float = 0.0, repair: bool = False) -> list[Checkpoint]:
        """Checkpoints of this run with a readable manifest, oldest first (files not hashed; see latest).

        The directory listing is completed by the checkpoint the run's pointer (:data:`POINTER`) names, opened by
        its path, when the listing does not show it (a cached listing on another node): :func:`.pointer.follow`.

        Args:
            wait_s: seconds to wait for that checkpoint to become visible by its path (``checkpoint.visible_wait_s``);
                0: take the listing as it is when it cannot be opened. Past the wait the pointer is damaged.
            repair: set aside what the pointer names when it is damaged (a manifest that is not valid JSON or
                lacks its fields, at once; a checkpoint the server does not have after ``wait_s``); without it,
                only logged (a reader that writes nothing).
        """
        found = []
        for p in self.root.iterdir() if self.root.is_dir() else ():
            manifest = self._read_manifest(p)
            if manifest is not None:
                found.append(Checkpoint(p, int(manifest["step"]), manifest))
        pointed = _pointer.follow(self, found, wait_s, repair)
        if pointed is not None:
            found.append(pointed)
        return sorted(found, key=lambda c: c.step)

    def pointer(self) -> dict[str, Any] | None:
        """The run's pointer (``{"run_key", "step", "name", "manifest_digest"}``), read from the file's content, or
        None (no pointer, an unreadable one, or one another run key wrote)."""
        return _pointer.read(self.root, self.run_key)

    def point_to(self, final: Path) -> None:
        """Make the pointer name the sealed checkpoint ``final`` (after its rename; one atomic write)."""
        _pointer.write(self.root, self.run_key, final, int(COMPLETE_RE.match(final.name).group(1)))  # type: ignore

    def verify(self, ck: Checkpoint, full: bool = False) -> str | None:
        """Check a checkpoint's files against its manifest. Returns None when intact, else what is wrong.

        Every file must exist with its recorded size. Files marked ``verify: on_load`` (written by
        ``save_state``) are hashed only with ``full=True``: otherwise ``load_state`` checks their digest while
        it reads them. All other files are hashed here. First of all, every name must stay inside the checkpoint
        folder (:func:`.damage.names_problem`: no ``..``, no absolute path, no symlink), so no file outside it is
        ever opened.
        """
        default_alg = ck.manifest.get("digest", "sha256")
        outside = names_problem(ck.path, ck.manifest.get("files", {}))
        if outside is not None:
            return outside
        for rel, info in ck.manifest.get("files", {}).items():
            problem = entry_problem(ck.path, rel, info, default_alg, hash_on_load=full)
            if problem is not None:
                return problem
        if RUN_STATE not in ck.manifest.get("files", {}):
            return f"{RUN_STATE} is missing"
        return None

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose files all match their manifest (see :meth:`verify`), or None.

        A damaged checkpoint newer than it is set aside (renamed ``.damaged-step-<n>-<id>``, kept for
        inspection) so that it is neither resumed from, nor counted by retention, nor in the way of the
        checkpoint the resumed run writes at that step.
        """
        for ck in reversed(self.complete(repair=True)):
            problem = self.verify(ck)
            if problem is None:
                return ck
            moved = self.set_aside_if_damaged(ck.path, problem)
            log.warning("checkpoint %s is damaged (%s); set aside as %s, using an older one", ck.path, problem,
                        moved.name if moved else "?")
        return None

    def set_aside_if_damaged(self, path: Path, problem: str | None = None) -> Path | None:
        """Rename a damaged checkpoint directory out of the way; None if it is intact (left in place)."""
        if problem is None:
            problem = self.problem_of(path)
        if problem is None:
            return None
        aside = self.root / f".damaged-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)
        ptr = self.pointer()
        if ptr is not None and ptr["name"] == path.name:  # it names nothing now: the listing decides again
            (self.root / POINTER).unlink(missing_ok=True)
        return aside

    def problem_of(self, path: Path) -> str | None:
        """What is wrong with the checkpoint directory ``path`` (all files hashed), or None when it is intact;
        a directory without a readable manifest of this run (a foreign folder) is ``"no readable manifest of this
        run"``."""
        manifest = self._read_manifest(path)
        if manifest is None:
            return "no readable manifest of this run"
        return self.verify(Checkpoint(path, int(manifest["step"]), manifest), full=True)

    def retain(self, keep: int, newest: int | None = None) -> list[Path]:
        """Delete all but the newest ``keep`` complete checkpoints of this run; returns what was deleted.

        Only directories named ``step-<n>`` whose manifest names this run key are candidates, so foreign or
        unrecognised directories are never touched. With ``newest`` (the step just written), only checkpoints
        older than it are candidates and it counts as the first kept one, so whatever lies beyond it (a
        checkpoint of an abandoned, longer history) can never make retention delete the one just written.
        A directory is renamed away before it is deleted, so a kill half-way never leaves something that
        looks complete.

        Raises:
            ConfigError: ``keep`` < 1.
        """
        if keep is None:
            return []
        if int(keep) < 1:
            raise ConfigError(f"run.checkpoint(keep={keep}): keep must be at least 1 (or None to keep all)")
        removed = []
        complete = self.complete()
        if newest is not None:
            older = [ck for ck in complete if ck.step < newest]
            doomed = older[: max(len(older) - (int(keep) - 1), 0)]
        else:
            doomed = complete[: -int(keep)]
        for ck in doomed:
            trash = self.root / f".deleting-{ck.path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(ck.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(ck.path)
        return removed

    def clean_partials(self) -> list[Path]:
        """Remove partial checkpoints left by killed processes of this run (proved by their mark file).

        Call only while no other process writes checkpoints of this run (the Run does it at start-up).
        """
        removed = []
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if p.name.startswith(".deleting-step-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)  # an interrupted retention
                continue
            if not PARTIAL_RE.match(p.name) or not p.is_dir():
                continue
            try:
                mark = json.loads((p / PARTIAL_MARK).read_text())
            except (OSError, ValueError):
                continue
            if mark.get("run_key") == self.run_key:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed
