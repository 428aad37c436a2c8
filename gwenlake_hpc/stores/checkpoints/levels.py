"""Two levels of a run's checkpoints: a node-local first level, and the shared run directory.

With ``checkpoint.local_dir`` (default ``$SLURM_TMPDIR`` where SLURM sets it, else off) a checkpoint is sealed on
a node-local disk or RAM disk first, so the loop and an eviction's grace window pay only that write; a copier
thread then copies it to ``<run_dir>/checkpoints`` and seals it there. Responsibilities of this module:

- where a run's local level lies: ``<local_dir>/gwenlake-checkpoints/run-<digest>/checkpoints``, the digest of
  the run directory's absolute path, run key and ``run.json`` uid, so two runs never share one (nor a run
  directory deleted and made anew with the old one), and no run name becomes a path
  (:func:`local_store`); ``LEVEL.json`` beside it names the host, run directory and run key;
- the copy (:func:`copy_to_shared`): each file streamed into a partial directory of the shared level, its digest
  computed on the way and compared with the local manifest (a local copy damaged since its seal is never
  published), fsynced; the manifest copied byte for byte last, so both levels hold the same digests; then sealed
  by the shared store's :meth:`~.store.CheckpointStore.publish` (fence, rename, pointer);
- the copier (:class:`SharedCopier`): one thread, newest first (a checkpoint sealed locally while an older one
  is being copied replaces the older one in the queue, so the shared level never falls further behind than one
  copy), retention on both levels after each copy (a local checkpoint is deleted only once a newer one is on
  the shared level), a failed copy kept for the training thread;
- the levels' record ``checkpoints/LEVELS.json`` in the shared run directory (host, local newest step, shared
  newest step, the copy in flight), which ``status`` shows since a login node cannot see a compute node's disk.

Which level a start resumes from is the resume rule's (:mod:`.resume`): the local level's newest intact
checkpoint when it is newer than the shared level's, else the shared level's. A node-local level exists only
where every rank runs on one node (a checkpoint of several nodes' ranks is written into one shared directory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from ...base.errors import CheckpointError, CheckpointExistsError, ConfigError
from ...base.fsutil import atomic_file, fsync_dir, read_json
from ...base.waits import waiting_for
from .digest import entry_digest, file_digest, new_hasher
from .manifest import MANIFEST, PARTIAL_MARK, Checkpoint
from .store import CheckpointStore

log = logging.getLogger("gwenlake_hpc.checkpoints")

#: The record of the two levels in the shared checkpoints folder (read by ``status``).
LEVELS = "LEVELS.json"
#: What a local level's folder says of itself (host, run directory, run key).
LEVEL = "LEVEL.json"
#: ``checkpoint.shared_wait_s`` by default: SLURM's default KillWait is 30 s between SIGTERM and SIGKILL.
DEFAULT_SHARED_WAIT_S = 20.0
#: Bytes copied per read while a file goes to the shared level.
COPY_CHUNK = 8 << 20


def local_root(local_dir: str | os.PathLike, run_dir: str | os.PathLike, run_key: str, uid: str = "") -> Path:
    """The folder of run ``run_key`` (in ``run_dir``) on the node-local level ``local_dir``. ``uid``: the run
    directory's own id (``run.json``'s ``uid``), so a run directory deleted and made anew never resumes from
    what the old one left on a node.

    Raises:
        ConfigError: ``local_dir`` is not an absolute path.
    """
    base = Path(local_dir)
    if not base.is_absolute():
        raise ConfigError(f"checkpoint.local_dir={local_dir}: must be an absolute path to a node-local disk or RAM "
                          "disk (e.g. /tmp or $SLURM_TMPDIR), or off")
    digest = hashlib.sha256(f"{Path(run_dir).absolute()}\0{run_key}\0{uid}".encode()).hexdigest()[:16]
    return base / "gwenlake-checkpoints" / f"run-{digest}"


def local_store(root: Path, run_dir: str | os.PathLike, run_key: str) -> CheckpointStore:
    """The run's checkpoint store on the local level ``root`` (see :func:`local_root`), made if missing.

    A level last written by another host (``checkpoint.local_dir`` on a filesystem that is not node-local, or
    a copied disk) is emptied first: its checkpoints are not this node's to resume from.

    Raises:
        ConfigError: the folder cannot be made or written (names ``checkpoint.local_dir``).
    """
    host = socket.gethostname()
    try:
        root.mkdir(parents=True, exist_ok=True)
        level = read_json(root / LEVEL, default=None) if (root / LEVEL).is_file() else None
        if isinstance(level, dict) and level.get("host") not in (None, host):
            log.warning("the local checkpoint level %s was written on host %s, this is %s: emptied (is "
                        "checkpoint.local_dir node-local?)", root, level.get("host"), host)
            shutil.rmtree(root / "checkpoints", ignore_errors=True)
        if not isinstance(level, dict) or level.get("host") != host:
            with atomic_file(root / LEVEL, "w") as fh:
                json.dump({"host": host, "run_dir": str(Path(run_dir).absolute()), "run_key": run_key}, fh)
        _hold(root)
        return CheckpointStore(root / "checkpoints", run_key)
    except OSError as exc:
        raise ConfigError(f"checkpoint.local_dir: cannot use {root} ({exc.strerror or exc}); give a writable "
                          "node-local path, or checkpoint.local_dir=off") from exc


#: ``.in-use`` files this process holds a ``flock`` on (a local level's folder it trains with), for its lifetime.
_HELD: dict[Path, Any] = {}
IN_USE = ".in-use"


def _hold(root: Path) -> None:
    """Hold ``<root>/.in-use`` with a ``flock`` (node-local: it works there) until this process ends, so that no
    sweep of another start on this node removes a level in use (:func:`in_use`)."""
    import fcntl

    if root in _HELD:
        return
    fh = open(root / IN_USE, "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process of this run on this node: the run's lease decides, not this
        fh.close()
        return
    _HELD[root] = fh


def release(root: Path) -> None:
    """Let go of the ``flock`` :func:`local_store` took on ``root``."""
    fh = _HELD.pop(root, None)
    if fh is not None:
        fh.close()


def local_levels(local_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The runs' folders under the local level ``local_dir`` that this host wrote, with their ``LEVEL.json``."""
    found = []
    for folder in sorted((Path(local_dir) / "gwenlake-checkpoints").glob("run-*")):
        level = read_json(folder / LEVEL, default=None) if (folder / LEVEL).is_file() else None
        if isinstance(level, dict) and level.get("host") == socket.gethostname():
            found.append((folder, level))
    return found


def in_use(folder: Path) -> bool:
    """Whether a process holds the local level ``folder`` (its ``.in-use`` flock), this one included."""
    import fcntl

    if folder in _HELD:
        return True
    try:
        fh = open(folder / IN_USE, "a+")
    except OSError:
        return False
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        fh.close()
    return False


def sweep(folder: Path) -> bool:
    """Remove the local level ``folder`` unless a process holds it; True when removed."""
    if in_use(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def _copy_file(src: Path, dst: Path, entry: dict[str, Any], algorithm: str) -> None:
    """Stream ``src`` to ``dst``, hashing it on the way; fsync ``dst``.

    Raises:
        CheckpointError: ``src`` does not match its manifest entry (size or digest).
        OSError: a read or write failed.
    """
    alg, want = entry_digest(entry, algorithm)
    h = new_hasher(alg)
    size = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    buf = bytearray(COPY_CHUNK)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while n := fin.readinto(buf):
            h.update(view[:n])
            fout.write(view[:n])
            size += n
        os.fsync(fout.fileno())
    if size != int(entry["size"]) or h.hexdigest() != want:
        raise DamagedLocalCopy(f"{src} does not match its manifest ({size} bytes, {entry['size']} recorded, or its "
                              f"{alg} digest differs): the local copy is damaged; it is not copied to the shared level")


def copy_to_shared(ck: Checkpoint, shared: CheckpointStore) -> Checkpoint:
    """Copy the sealed local checkpoint ``ck`` to the shared level and seal it there; the same manifest.

    Nothing is done when the shared level already holds this checkpoint (the same manifest's digest).

    Raises:
        CheckpointError: a file of ``ck`` fails its digest (nothing published); CheckpointExistsError: the shared
            level holds another checkpoint of that step; FencedError: a newer start holds the run.
        OSError: the shared level cannot be written.
    """
    there = shared.open(ck.path.name)
    if there is not None:
        if file_digest(there.path / MANIFEST) == file_digest(ck.path / MANIFEST):
            return there
        raise CheckpointExistsError(f"the shared level already holds another checkpoint of step {ck.step} at "
                                    f"{there.path}; the local one ({ck.path}) is not copied over it")
    partial = shared.root / f".partial-{ck.step:09d}-{uuid.uuid4().hex[:12]}"
    partial.mkdir(parents=True)
    try:
        (partial / PARTIAL_MARK).write_text(json.dumps({"run_key": shared.run_key, "pid": os.getpid()}))
        algorithm = ck.manifest.get("digest", "sha256")
        for rel, entry in sorted(ck.manifest.get("files", {}).items()):
            _copy_file(ck.path / rel, partial / rel, entry, algorithm)
        raw = (ck.path / MANIFEST).read_bytes()
        if json.loads(raw) != dict(ck.manifest):
            raise CheckpointError(f"{ck.path / MANIFEST} changed since it was read; not copied")
        with open(partial / MANIFEST, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        for d in sorted((p for p in partial.rglob("*") if p.is_dir()), reverse=True):
            fsync_dir(d)
        fsync_dir(partial)
        final = shared.publish(partial, ck.step)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Checkpoint(final, ck.step, ck.manifest)


class DamagedLocalCopy(CheckpointError):
    """A file of a sealed local checkpoint no longer matches its manifest: the copy is not published."""


class SharedCopier:
    """The thread that copies sealed local checkpoints to the shared level, newest first (see the module).

    Args:
        local: the run's local level.
        shared: the run's shared level (``<run_dir>/checkpoints``).
        shared_newest: the newest step on the shared level at start, or None.

    Attributes:
        copied: the newest checkpoint this copier sealed on the shared level (or None).
        error: the last copy's error (kept until :meth:`raise_if_failed` raises it).
    """

    def __init__(self, local: CheckpointStore, shared: CheckpointStore, shared_newest: int | None):
        self.local, self.shared = local, shared
        self.copied: Checkpoint | None = None
        self.shared_step = shared_newest
        self.local_step: int | None = None
        self.error: BaseException | None = None
        self._wanted: tuple[Checkpoint, int | None] | None = None
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        #: called with the copied checkpoint after each copy (tests, the ledger); None: nothing
        self.on_copied: Callable[[Checkpoint], None] | None = None

    def submit(self, ck: Checkpoint, keep: int | None) -> None:
        """Queue the sealed local checkpoint ``ck`` (replacing any older one not yet begun); ``keep``: retention
        on both levels after its copy (None: keep all)."""
        with self._lock:
            self.local_step = ck.step
            self._wanted = (ck, keep)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="gwenlake-checkpoint-copier", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    @property
    def pending(self) -> bool:
        """True while a copy runs or waits."""
        with self._lock:
            return self._busy or self._wanted is not None

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._wanted is None:
                    self._thread = None
                    self._lock.notify_all()
                    return
                (ck, keep), self._wanted = self._wanted, None
                self._busy = True
            try:
                self._record(copying=ck.step)
                done = copy_to_shared(ck, self.shared)
                with self._lock:
                    self.copied, self.shared_step = done, ck.step
                if keep is not None:
                    self._retain(keep, ck.step)
                self._record(copying=None)
                if self.on_copied is not None:
                    self.on_copied(done)
            except DamagedLocalCopy as exc:  # the node's copy rotted: set aside; the next checkpoint is copied
                moved = self.local.set_aside_if_damaged(ck.path, str(exc)) if ck.path.is_dir() else None
                intact = self.local.complete()
                self.local_step = intact[-1].step if intact else None
                self._record(copying=None)
                log.warning("checkpoint %s on the local level is damaged (%s); set aside as %s, not copied to the "
                            "shared level (its newest stays step %s)", ck.path.name, exc, moved.name if moved else "?",
                            self.shared_step)
            except BaseException as exc:  # kept for the training thread
                log.error("the copy of checkpoint %s to the shared level failed: %s", ck.path.name, exc)
                with self._lock:
                    self.error = exc
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _retain(self, keep: int, step: int) -> None:
        for store in (self.shared, self.local):
            try:
                store.retain(keep, newest=step)
            except OSError as exc:  # both are sealed: an old one left behind is no failure
                log.warning("an older checkpoint in %s could not be deleted (keep=%s): %s", store.root, keep, exc)

    def _record(self, copying: int | None) -> None:
        """Write ``LEVELS.json`` in the shared checkpoints folder (best effort: a record, not a checkpoint)."""
        try:
            with atomic_file(self.shared.root / LEVELS, "w") as fh:
                json.dump({"host": socket.gethostname(), "local_dir": str(self.local.root),
                           "local_step": self.local_step, "shared_step": self.shared_step, "copying": copying,
                           "time": time.time()}, fh, sort_keys=True)
        except OSError as exc:
            log.debug("could not write %s: %s", self.shared.root / LEVELS, exc)

    def raise_if_failed(self) -> None:
        """Raise the error of a failed copy once (the run stops at its next checkpoint).

        Raises:
            CheckpointError: naming the step copied and the error.
        """
        with self._lock:
            error, self.error = self.error, None
        if isinstance(error, ConfigError):  # a fence or a step the shared level holds: exit 2 as it is
            raise error
        if error is not None:
            raise CheckpointError(f"the copy of a checkpoint to the shared level {self.shared.root} failed: {error}; "
                                  f"the newest checkpoint on it is step {self.shared_step}") from error

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no copy runs or waits, at most ``timeout_s`` seconds (None: no bound). True when done."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        with self._lock, waiting_for(self._thread):  # a hang's verdict names the copier, not the condition
            while self._busy or self._wanted is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left if left is None else min(left, 1.0))
        return True


def drop_local(local: CheckpointStore, shared: CheckpointStore) -> None:
    """Remove a run's local level (its folder, ``LEVEL.json`` included) and the levels' record: at the end of a
    run whose newest checkpoint is on the shared level, so no node keeps a finished run's checkpoints."""
    release(local.root.parent)
    shutil.rmtree(local.root.parent, ignore_errors=True)
    (shared.root / LEVELS).unlink(missing_ok=True)


def levels_record(shared_root: Path) -> dict[str, Any] | None:
    """The two levels' record of a run (``LEVELS.json`` in its shared checkpoints folder), or None."""
    try:
        record = json.loads((Path(shared_root) / LEVELS).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
