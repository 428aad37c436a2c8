"""A checkpoint being written: :class:`PendingCheckpoint`, from its partial directory to its seal.

A checkpoint is written into a ``.partial-*`` directory beside its final place, every file and the directory
are fsynced, ``MANIFEST.json`` (each file's size and digest, the run key and the step) is written and fsynced
last, then the directory is renamed into place and the parent fsynced ("sealed", by the store's
:meth:`~.store.CheckpointStore.publish`). A kill at any point leaves either the old set of complete checkpoints
or the old set plus the new one; nothing is overwritten in place.

Files that :func:`~gwenlake_hpc.stores.checkpoints.state.save_state` writes into an open checkpoint are hashed while
they are written (the seal never re-reads them) and marked ``"verify": "on_load"``: a resume checks their
size up front and their digest while ``load_state`` reads them. Every other file is hashed when the checkpoint
is sealed and verified in full before a resume. In an asynchronous checkpoint ``save_state`` only takes a
snapshot (:class:`~gwenlake_hpc.stores.checkpoints.tensorfile.Snapshot`); :meth:`PendingCheckpoint.seal` writes it.

This module owns the writer's side: the partial directory and its mark (which proves to a later cleanup that it
is this run's), the open checkpoints ``save_state`` finds by path (:func:`open_checkpoint_of`), the snapshots,
staged and deferred sharded writes and the shards the ranks report, the manifest and the seal. Its names and
format are :mod:`.manifest`'s. Imports nothing of the store: the store passes itself (``store``: its ``root``,
``run_key`` and ``publish``) and begins each checkpoint (:meth:`~.store.CheckpointStore.begin`).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...base.errors import CheckpointError, ConfigError
from ...base.fsutil import atomic_file, fsync_dir
from .digest import DEFAULT_ALGORITHM, file_digest
from .manifest import FORMAT, MANIFEST, PARTIAL_MARK, PARTIAL_RE, RANKS_DIR, RUN_STATE, Checkpoint, writer_version

if TYPE_CHECKING:
    from .buffers import BufferPool
    from .tensorfile import Snapshot


def _fsync_file(path: Path) -> None:
    """fsync a file where it lies: a checkpoint's files are not renamed one by one (``publish``) but sealed
    together, their directory renamed into place once the manifest is written."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


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
    if any(PARTIAL_RE.match(parent.name) for parent in p.parents):
        raise ConfigError(f"{path} is inside a checkpoint whose `with run.checkpoint()` block has ended; write "
                          "checkpoint files inside the block")
    return None


class PendingCheckpoint:
    """A checkpoint being written: files go into :attr:`dir`; :meth:`commit` (or :meth:`prepare` then
    :meth:`seal`) makes it complete.

    Args:
        store: the run's store (:class:`~.store.CheckpointStore`).
        step: steps completed.
        scratch: a folder of a rank other than 0 of a multi-task run: files go there and are never sealed.
        shared: with ``scratch``, rank 0's partial directory of the same checkpoint: a sharded ``save_state``
            of this rank writes its shards there (:meth:`sharded_target`), and rank 0 seals them.
        buffers: a :class:`BufferPool` to make it asynchronous: ``save_state`` into it only takes a snapshot,
            and :meth:`seal` writes the snapshots.
    """

    def __init__(self, store: Any, step: int, scratch: Path | None = None,
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
