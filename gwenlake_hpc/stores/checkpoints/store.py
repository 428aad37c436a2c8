"""Atomic checkpoints in a run directory, with retention that deletes only what it can prove is ours.

Layout under ``<run_dir>/checkpoints/``::

    step-000001000/            a complete checkpoint: the function's files, the Run's state, MANIFEST.json
    .partial-000002000-<id>/   being written (or left by a killed process); never read as a checkpoint

A checkpoint is written into a ``.partial-*`` directory beside its final place, every file and the directory
are fsynced, ``MANIFEST.json`` (each file's size and digest, the run key and the step) is written and fsynced
last, then the directory is renamed into place and the parent fsynced ("sealed"). A kill at any point leaves
either the old set of complete checkpoints or the old set plus the new one; nothing is overwritten in place.

Files that :func:`~gwenlake_hpc.stores.checkpoints.state.save_state` writes into an open checkpoint are hashed while
they are written (the seal never re-reads them) and marked ``"verify": "on_load"``: a resume checks their
size up front and their digest while ``load_state`` reads them. Every other file is hashed when the checkpoint
is sealed and verified in full before a resume. In an asynchronous checkpoint ``save_state`` only takes a
snapshot (:class:`~gwenlake_hpc.stores.checkpoints.tensorfile.Snapshot`); :meth:`PendingCheckpoint.seal` writes it.

Manifest format 2 (this version) records ``digest`` (the algorithm, XXH3-128) and per file ``size`` and
``digest``; format 1 manifests (sha256) still load. A manifest or state file of a newer format is refused with
:class:`CheckpointFormatError` (exit 2) instead of being misread.

One concern, kept in one module past 500 lines: the on-disk protocol of a run's checkpoints. The writer
(:class:`PendingCheckpoint`: partial directory, mark, manifest, seal) and the reader (:class:`CheckpointStore`:
listing, verification, set-aside, retention, cleanup of partials) share its names, its manifest and its
invariants (only a sealed ``step-<n>`` with a manifest of this run key is a checkpoint; only a marked partial of
this run is ours to remove), and the seal itself asks the store about a folder in its way. Durable writes go
through :mod:`gwenlake_hpc.base.fsutil`. Which checkpoint a job resumes from is the job's decision
(:mod:`gwenlake_hpc.job.resume`), made over these primitives.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...base.errors import CheckpointError, CheckpointExistsError, CheckpointFormatError, ConfigError
from ...base.fsutil import atomic_file, fsync_dir
from ...base.lease import check_fence
from . import pointer as _pointer
from .damage import manifest_problem, names_problem
from .digest import DEFAULT_ALGORITHM, entry_digest, file_digest

if TYPE_CHECKING:
    from .buffers import BufferPool
    from .tensorfile import Snapshot

log = logging.getLogger("gwenlake_hpc.checkpoints")

MANIFEST = "MANIFEST.json"
#: The run's pointer to its newest sealed checkpoint (``checkpoints/LATEST.json``; :mod:`.pointer`).
POINTER = _pointer.POINTER
PARTIAL_MARK = ".gwenlake-partial"
RUN_STATE = "gwenlake-run-state.json"
#: Per-rank state of a multi-task run (RNG, data position): ``gwenlake-ranks/rank-00001.json``.
RANKS_DIR = "gwenlake-ranks"
#: Manifest format written by this version; a reader refuses a larger one.
FORMAT = 2
_COMPLETE_RE = re.compile(r"^step-(\d{9,})$")
_PARTIAL_RE = re.compile(r"^\.partial-(\d{9,})-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk.

    Attributes:
        path: its directory.
        step: the number of training steps completed when it was written (1-based steps, so step k means
            steps 1..k are done).
        manifest: the parsed MANIFEST.json (``files``: relative path -> {size, sha256}, ``metrics``,
            ``created`` as Unix seconds).
    """

    path: Path
    step: int
    manifest: Mapping[str, Any] = field(repr=False)

    @property
    def metrics(self) -> dict[str, float]:
        """Metrics attached when it was written (``ck.metrics``), empty if none."""
        return dict(self.manifest.get("metrics") or {})

    def run_state(self) -> dict[str, Any]:
        """The Run's own state saved with it (step, epoch, data position, RNG states, tracking run id)."""
        return json.loads((self.path / RUN_STATE).read_text())

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        """The state rank ``rank`` of a multi-task run saved with it (RNG, data position), or None."""
        p = self.path / rank_state_name(rank)
        return json.loads(p.read_text()) if p.is_file() else None


def rank_state_name(rank: int) -> str:
    """Relative path of rank ``rank``'s state inside a checkpoint."""
    return f"{RANKS_DIR}/rank-{int(rank):05d}.json"


def _fsync_file(path: Path) -> None:
    """fsync a file where it lies: a checkpoint's files are not renamed one by one (``publish``) but sealed
    together, their directory renamed into place once the manifest is written."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


@functools.lru_cache(maxsize=1)
def writer_version() -> str:
    """``gwenlake_hpc <version>``, recorded in manifests and state files (read once per process: the package
    metadata lookup costs milliseconds, inside every checkpoint block)."""
    try:
        from importlib.metadata import version

        return f"gwenlake_hpc {version('gwenlake_hpc')}"
    except Exception:  # not installed as a distribution (a bare checkout on PYTHONPATH)
        return "gwenlake_hpc (unknown version)"


def check_format(found: Any, known: int, what: str, writer: Any) -> None:
    """Refuse ``found`` > ``known`` with a :class:`CheckpointFormatError` naming ``what`` and its ``writer``."""
    if isinstance(found, int) and found > known:
        raise CheckpointFormatError(
            f"{what} has format {found}, written by {writer or 'a newer gwenlake_hpc'}; this {writer_version()} "
            f"reads formats up to {known}: run the job with the gwenlake_hpc version that wrote it or a newer one "
            "(update the commit the job is pinned to)")


# --- open checkpoints: where save_state finds the checkpoint a path belongs to ----------------------------------
_OPEN: dict[Path, "PendingCheckpoint"] = {}
_OPEN_LOCK = threading.Lock()


def open_checkpoint_of(path: str | os.PathLike) -> "PendingCheckpoint | None":
    """The checkpoint being written whose directory holds ``path`` (inside a ``with run.checkpoint()``), or None.

    Raises:
        ConfigError: ``path`` is inside a partial checkpoint whose block has ended (it is being sealed, or
            was left by another process): a file written there now would not match its manifest.
    """
    p = Path(path).absolute()
    with _OPEN_LOCK:
        for parent in p.parents:
            if parent in _OPEN:
                return _OPEN[parent]
    if any(_PARTIAL_RE.match(parent.name) for parent in p.parents):
        raise ConfigError(f"{path} is inside a checkpoint whose `with run.checkpoint()` block has ended; write "
                          "checkpoint files inside the block")
    return None


class PendingCheckpoint:
    """A checkpoint being written: files go into :attr:`dir`; :meth:`commit` (or :meth:`prepare` then
    :meth:`seal`) makes it complete.

    Args:
        store: the run's store.
        step: steps completed.
        scratch: a folder of a rank other than 0 of a multi-task run: files go there and are never sealed.
        shared: with ``scratch``, rank 0's partial directory of the same checkpoint: a sharded ``save_state``
            of this rank writes its shards there (:meth:`sharded_target`), and rank 0 seals them.
        buffers: a :class:`BufferPool` to make it asynchronous: ``save_state`` into it only takes a snapshot,
            and :meth:`seal` writes the snapshots.
    """

    def __init__(self, store: "CheckpointStore", step: int, scratch: Path | None = None,
                 buffers: BufferPool | None = None, shared: Path | None = None):
        self.store = store
        self.step = step
        self.metrics: dict[str, float] = {}
        #: rel path -> manifest entry of files hashed while written (save_state)
        self._recorded: dict[str, dict[str, Any]] = {}
        #: rel path -> manifest entry of the sharded files this rank wrote (reported to rank 0)
        self._shards: dict[str, dict[str, Any]] = {}
        self._shared = Path(shared) if shared is not None else None
        self._snapshots: list[tuple[Path, Snapshot]] = []
        #: writes of staged sharded states left to the background writer (see :meth:`defer`)
        self._deferred: list[Callable[[Any], None]] = []
        self._staged: list[Any] = []  # their staging copies' Futures
        #: one signature (path in the checkpoint, parts) per sharded save_state of this rank, in order
        self.sharded_calls: list[str] = []
        self._buffers = buffers
        self._registered: Path | None = None
        self._closed = False
        self._discard = scratch is not None
        if scratch is not None:  # a rank other than 0: files go to a folder that is never sealed
            self.dir = Path(scratch)
            self.dir.mkdir(parents=True, exist_ok=True)
            self._register()
            return
        self.dir = store.root / f".partial-{step:09d}-{uuid.uuid4().hex[:12]}"
        self.dir.mkdir(parents=True)
        # The mark proves to a later cleanup that this directory is a partial checkpoint of this run. Not
        # fsynced: a mark lost in a crash leaves a partial cleanup will not touch, never a checkpoint misread.
        (self.dir / PARTIAL_MARK).write_text(json.dumps({"run_key": store.run_key, "pid": os.getpid()}))
        if buffers is not None:
            buffers.reset()
        self._register()

    def _register(self) -> None:
        self._registered = self.dir.absolute()
        with _OPEN_LOCK:
            _OPEN[self._registered] = self

    @property
    def asynchronous(self) -> bool:
        """True when ``save_state`` into it takes a snapshot that :meth:`seal` writes later."""
        return self._buffers is not None

    def path(self, name: str) -> Path:
        """Path of file ``name`` inside the checkpoint (sub-folders allowed, created on demand).

        Raises:
            ConfigError: the name is absolute, escapes the checkpoint with ``..``, or is reserved.
        """
        if self._closed:
            raise ConfigError(f"ck.path({name!r}) after its `with run.checkpoint()` block ended: the checkpoint of "
                              f"step {self.step} is being sealed; write every file inside the block")
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ConfigError(f"checkpoint file name {name!r} must be a relative path inside the checkpoint")
        if rel.parts[0] in (MANIFEST, PARTIAL_MARK, RUN_STATE, RANKS_DIR):
            raise ConfigError(f"checkpoint file name {name!r} is reserved by gwenlake_hpc; choose another name")
        target = self.dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def put_tensors(self, path: Path, tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> Path:
        """Store a safetensors file at ``path`` inside the checkpoint (what ``save_state`` calls).

        Asynchronous: copies the tensors into a reused host buffer and returns; :meth:`seal` writes them.
        Otherwise: streams the file now, hashed on the way. Either way the seal does not re-read it. In the
        scratch folder of a rank other than 0 nothing is written: rank 0's copy is the checkpoint.
        """
        if self._discard:
            return Path(path)
        rel = Path(path).absolute().relative_to(self.dir.absolute()).as_posix()
        if self._buffers is not None:
            self._snapshots = [(p, s) for p, s in self._snapshots if p != Path(path)]
            from .tensorfile import Snapshot

            self._snapshots.append((Path(path), Snapshot(tensors, metadata, self._buffers.take())))
            self._recorded.pop(rel, None)
            return Path(path)
        from .tensorfile import write_tensors

        size, digest = write_tensors(path, tensors, metadata)
        self._recorded[rel] = {"size": size, "digest": digest, "verify": "on_load"}
        return Path(path)

    def sharded_target(self, path: Path) -> Path:
        """Where this rank writes its shards of the sharded state ``path`` (a path inside :attr:`dir`): ``path``
        itself on rank 0, the same place in rank 0's partial directory on the other ranks.

        Raises:
            CheckpointError: a rank other than 0 of a checkpoint opened without rank 0's directory.
        """
        if not self._discard:
            return Path(path)
        if self._shared is None:
            raise CheckpointError(f"{path}: this rank's checkpoint has no shared directory to write shards into")
        return self._shared / Path(path).absolute().relative_to(self.dir.absolute())

    def stage(self, state: Mapping[str, Any]) -> Any:
        """Start a copy of the sharded state dict ``state`` into this checkpoint's reused host memory (an
        asynchronous checkpoint's; see :meth:`BufferPool.stage`); returns its Future. The training goes on at
        once: the next optimizer step waits for the copy."""
        if self._buffers is None:
            raise CheckpointError(f"the checkpoint of step {self.step} is synchronous: nothing is staged")
        return self._buffers.stage(state)

    def defer(self, write: Callable[[Any], None], staged: Any = None) -> None:
        """Leave ``write(group)`` (the write of a staged sharded state, a collective over process group
        ``group``) to :meth:`write_deferred`, which the background writer runs after the block; ``staged``: the
        Future of its staging copy, which :meth:`wait_staged` waits for."""
        self._deferred.append(write)
        if staged is not None:
            self._staged.append(staged)

    def note_sharded(self, signature: str) -> None:
        """Record one sharded ``save_state`` of this rank (its path in the checkpoint and parts): the ranks'
        lists must be equal (compared by the Run's vote at the end of the block)."""
        self.sharded_calls.append(signature)

    def wait_staged(self) -> None:
        """Wait for the staging copies of the deferred writes.

        Raises:
            the first failed copy's error (out of host memory...).
        """
        for future in self._staged:
            future.result()

    @property
    def deferred(self) -> int:
        """How many writes left by :meth:`defer` have not run."""
        return len(self._deferred)

    def write_deferred(self, group: Any = None) -> None:
        """Run the writes left by :meth:`defer`, in order, with DCP's collectives over ``group`` (None: the
        default group, or none in a single process). Each records its files (:meth:`record_shard`).

        Raises:
            whatever a write raises (DCP's ``CheckpointException`` on every rank when one rank failed).
        """
        self.wait_staged()
        writes, self._deferred, self._staged = self._deferred, [], []
        for write in writes:
            write(group)

    def record_shard(self, path: Path, size: int, digest: str) -> None:
        """Record a file of a sharded state this rank wrote, fsynced and hashed (``path`` inside the checkpoint's
        real directory): in the manifest it is ``verify: on_load``; rank 0 learns those of the other ranks by
        :meth:`add_shards`."""
        root = (self._shared if self._discard else self.dir).absolute()
        rel = Path(path).absolute().relative_to(root).as_posix()
        entry = {"size": int(size), "digest": digest, "verify": "on_load"}
        self._shards[rel] = entry
        if not self._discard:
            self._recorded[rel] = entry

    def shards(self) -> dict[str, dict[str, Any]]:
        """This rank's sharded files: relative path -> manifest entry (size, digest, ``verify``)."""
        return dict(self._shards)

    def add_shards(self, shards: Mapping[str, Mapping[str, Any]], rank: int) -> None:
        """Rank 0: record the sharded files rank ``rank`` reported (see :meth:`shards`) in this manifest.

        Raises:
            CheckpointError: a reported file is not in this checkpoint's directory or has another size.
        """
        for rel, entry in shards.items():
            p = self.dir / rel
            if not p.is_file() or p.stat().st_size != entry["size"]:
                raise CheckpointError(f"rank {rank} reported {rel} ({entry['size']} bytes) in the checkpoint of "
                                      f"step {self.step}, but {p} is not there with that size")
            self._recorded[rel] = dict(entry)

    def close(self) -> None:
        """End of the ``with`` block on a rank that writes no Run state here: later ``save_state`` calls no
        longer land in this checkpoint (:meth:`prepare` does it too)."""
        self._unregister()

    def _unregister(self) -> None:
        self._closed = True
        if self._registered is not None:
            with _OPEN_LOCK:
                _OPEN.pop(self._registered, None)
            self._registered = None

    def prepare(self, run_state: Mapping[str, Any]) -> None:
        """End of the ``with`` block: write the Run's state; later ``save_state`` calls no longer land here."""
        self._unregister()
        # Written in place, fsynced by the seal with the other files (the directory is what gets renamed).
        with open(self.dir / RUN_STATE, "w") as fh:
            fh.write(json.dumps(run_state, sort_keys=True))  # dumps: the C encoder (dump to a file is pure Python)

    def seal(self) -> Checkpoint:
        """Write the snapshots, hash and fsync the other files, write the manifest, rename into place.

        Runs in the background writer thread of an asynchronous checkpoint, in the caller's otherwise.
        On failure the partial directory is removed and the error raised; older checkpoints are untouched.

        Raises:
            CheckpointError: a checkpoint for this step already exists (it is left untouched), or the
                directory contains something that is not a regular file.
            OSError: a write failed (disk full, quota, permissions); its message names the path.
        """
        try:
            return self._seal()
        except BaseException:
            self.abort()
            raise

    def _seal(self) -> Checkpoint:
        self.write_deferred()  # a single process's staged sharded states (a multi-rank run wrote them already)
        for path, snap in self._snapshots:
            size, digest = snap.write(path)
            self._recorded[path.absolute().relative_to(self.dir.absolute()).as_posix()] = {
                "size": size, "digest": digest, "verify": "on_load"}
        self._snapshots = []
        files: dict[str, dict[str, Any]] = {}
        for p in sorted(self.dir.rglob("*")):
            rel = p.relative_to(self.dir).as_posix()
            if rel == PARTIAL_MARK:
                continue
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                raise CheckpointError(f"checkpoint entry {rel} is not a regular file")
            if p.is_dir():
                continue
            if rel in self._recorded:  # written and fsynced by save_state: never read again
                files[rel] = self._recorded[rel]
                continue
            _fsync_file(p)
            files[rel] = {"size": p.stat().st_size, "digest": file_digest(p)}
        manifest = {"format": FORMAT, "writer": writer_version(), "digest": DEFAULT_ALGORITHM,
                    "run_key": self.store.run_key, "step": self.step, "created": time.time(), "files": files,
                    "metrics": self.metrics}
        with atomic_file(self.dir / MANIFEST, "w") as fh:
            json.dump(manifest, fh, sort_keys=True, indent=1)
        for d in sorted((p for p in self.dir.rglob("*") if p.is_dir()), reverse=True):
            fsync_dir(d)
        fsync_dir(self.dir)
        final = self.store.publish(self.dir, self.step)
        return Checkpoint(final, self.step, manifest)

    def commit(self, run_state: Mapping[str, Any]) -> Checkpoint:
        """:meth:`prepare` and :meth:`seal` in one call (a synchronous checkpoint)."""
        try:
            self.prepare(run_state)
        except BaseException:
            self.abort()
            raise
        return self.seal()

    def abort(self) -> None:
        """Remove the partial directory (after an exception inside the ``with`` block, or a failed seal)."""
        self._unregister()
        self._snapshots = []
        self._deferred, self._staged = [], []
        shutil.rmtree(self.dir, ignore_errors=True)


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
        m = _COMPLETE_RE.match(path.name)
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
        _pointer.write(self.root, self.run_key, final, int(_COMPLETE_RE.match(final.name).group(1)))  # type: ignore

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
            p = ck.path / rel
            if not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != info["size"]:
                return f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']}"
            if info.get("verify") == "on_load" and not full:
                continue
            alg, digest = entry_digest(info, default_alg)
            if file_digest(p, alg) != digest:
                return f"{rel} does not match its {alg} digest"
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
            if not _PARTIAL_RE.match(p.name) or not p.is_dir():
                continue
            try:
                mark = json.loads((p / PARTIAL_MARK).read_text())
            except (OSError, ValueError):
                continue
            if mark.get("run_key") == self.run_key:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed


def manifest_entry(path: str | os.PathLike) -> tuple[Path, str, str, int] | None:
    """What the manifest of the complete checkpoint holding ``path`` says of it, if it is in one.

    Returns:
        ``(checkpoint directory, algorithm, hex digest, size)``, or None when ``path`` is not a file listed
        in the manifest of a ``step-<n>`` directory among its parents.

    Raises:
        CheckpointFormatError: the manifest is of a newer format.
    """
    p = Path(path).absolute()
    for parent in p.parents:
        if not _COMPLETE_RE.match(parent.name):
            continue
        try:
            manifest = json.loads((parent / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        check_format(manifest.get("format"), FORMAT, f"checkpoint manifest {parent / MANIFEST}", manifest.get("writer"))
        info = manifest.get("files", {}).get(p.relative_to(parent).as_posix())
        if info is None:
            return None
        alg, digest = entry_digest(info, manifest.get("digest", "sha256"))
        return parent, alg, digest, int(info["size"])
    return None
