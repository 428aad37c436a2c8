"""The spool: the points and tags of a run not yet delivered to MLflow, as files in its state folder.

The training process appends; the delivery process reads, delivers, and removes what it delivered. The spool is
the queue between them, and it is on disk: a point written there survives any kill of either process.

Layout (``<state_dir>/spool/``): segments named ``00000001.jsonl``, ``00000002.jsonl``... in the order they were
written. Each holds one JSON object a line, either a point ``{"key", "value", "step", "timestamp"}`` (timestamp
in ms since the epoch; NaN and Infinity as Python's json writes them) or tags ``{"tags": {name: value}}``.

- A writer (:class:`SpoolWriter`, one per training process) appends to a segment of its own, created at its
  start and again every 16 MiB, and holds an exclusive ``flock`` on it while it may still write there.
- A reader (:class:`SpoolReader`, in the one process that delivers) reads only whole lines, remembers how far
  it delivered, and removes a segment once everything in it is delivered and no writer holds its lock. A line
  left unterminated by a killed writer is counted as malformed and dropped with its segment.
- An artifact entry names a copy of the file under ``<state_dir>/artifacts/<id>/`` (:func:`stage_artifact`),
  which the delivery uploads and then removes.
- ``<state_dir>/spool.jsonl``, the single spool file of versions before the delivery process, is read first.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union

from ....base.fsutil import fsync_dir, publish

logger = logging.getLogger("gwenlake_hpc.tracking")

SPOOL_DIR = "spool"
LEGACY_SPOOL_FILE = "spool.jsonl"
#: A writer starts a new segment past this size (bytes), so that delivered points leave the disk.
ROTATE_BYTES = 16 << 20
_SEGMENT = re.compile(r"^(\d{8,})\.jsonl$")

Point = tuple[str, float, int, int]  # key, value, step, timestamp in ms
# a point, {"tags": {...}}, {"params": {...}}, {"artifact": {...}}, {"rollout": {...}}, {"rename_tags": {...}} or
# {"inputs": [...]}
Entry = Union[Point, dict]


# --------------------------------------------------------------------------------------------
# lines


_KEY_JSON: dict[str, str] = {}


def _key_json(key: str) -> str:
    text = _KEY_JSON.get(key)
    if text is None:
        text = json.dumps(key)
        if len(_KEY_JSON) < 100_000:
            _KEY_JSON[key] = text
    return text


def _float_json(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def encode(entries: Iterable[Entry]) -> bytes:
    """The spool lines of points (``(key, value, step, timestamp_ms)``) and tag sets (``{"tags": {...}}``)."""
    out = []
    for e in entries:
        if isinstance(e, dict):
            out.append(json.dumps(e) + "\n")
        else:
            key, value, step, ts = e
            out.append(f'{{"key": {_key_json(key)}, "value": {_float_json(value)}, "step": {step}, '
                       f'"timestamp": {ts}}}\n')
    return "".join(out).encode("utf-8")


def decode(raw: bytes) -> Entry | None:
    """Parse one spool line; None for a malformed one."""
    try:
        d = json.loads(raw)
        if "tags" in d:
            tags = d["tags"]
            if not isinstance(tags, dict):
                return None
            return {"tags": {str(k): str(v) for k, v in tags.items()}}
        if "params" in d:  # MLflow's own log_param(s) inside the training function (tracking/user_mlflow/)
            params = d["params"]
            return {"params": {str(k): str(v) for k, v in params.items()}} if isinstance(params, dict) else None
        if "artifact" in d:  # a file staged in the state folder, uploaded by the delivery
            art = d["artifact"]
            if not isinstance(art, dict) or not isinstance(art.get("file"), str):
                return None
            return {"artifact": {"file": art["file"], "path": str(art.get("path") or "")}}
        if "rename_tags" in d:  # {old: new}: the finished run's eviction tag kept as history (finish.py)
            renames = d["rename_tags"]
            return {"rename_tags": {str(k): str(v) for k, v in renames.items()}} if isinstance(renames, dict) \
                else None
        if "inputs" in d:  # MLflow's log_input(s) inside the training function: dataset inputs of the run
            inputs = d["inputs"]
            if not isinstance(inputs, list) or not all(_is_input(i) for i in inputs):
                return None
            return {"inputs": inputs}
        if "rollout" in d:  # one RL episode, made a trace by the delivery (tracking/rollouts.py)
            rollout = d["rollout"]
            if not isinstance(rollout, dict) or not isinstance(rollout.get("messages"), list) or "id" not in rollout:
                return None
            return {"rollout": rollout}
        return (str(d["key"]), float(d["value"]), int(d["step"]), int(d["timestamp"]))
    except (ValueError, KeyError, TypeError):
        return None


def _is_input(entry: object) -> bool:
    """A dataset input as :meth:`gwenlake_hpc.stores.tracking.tracker.Tracker.log_inputs` records it."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dataset"), dict):
        return False
    dataset, tags = entry["dataset"], entry.get("tags", {})
    return all(isinstance(dataset.get(k), str) for k in ("name", "digest", "source_type", "source")) \
        and isinstance(tags, dict)


# --------------------------------------------------------------------------------------------
# locks


def try_lock(fd: int) -> bool | None:
    """Take an exclusive ``flock`` on ``fd`` without waiting: True taken, False held by another process, None
    when the filesystem has no locks (then the caller decides from other facts)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def segment_paths(state_dir: Path) -> list[Path]:
    """Every spool file of ``state_dir``, oldest first: the legacy ``spool.jsonl``, then the segments."""
    out: list[tuple[int, Path]] = []
    legacy = state_dir / LEGACY_SPOOL_FILE
    if legacy.exists():
        out.append((-1, legacy))
    try:
        names = os.listdir(state_dir / SPOOL_DIR)
    except FileNotFoundError:
        names = []
    for name in names:
        m = _SEGMENT.match(name)
        if m:
            out.append((int(m.group(1)), state_dir / SPOOL_DIR / name))
    return [p for _, p in sorted(out)]


# --------------------------------------------------------------------------------------------
# writer


def stage_artifact(state_dir: Path, local_file: str | os.PathLike[str], artifact_path: str | None) -> dict[str, Any]:
    """Copy ``local_file`` to ``<state_dir>/artifacts/<uuid>/<its name>`` and return its spool entry
    ``{"artifact": {"file", "path"}}`` (``path``: the run's artifact folder, "" for its root).

    The copy is written under a temporary name and published (fsynced, renamed, its folders fsynced): the delivery
    never sees half a file, and the entry, once the spool is made durable, never names a file a crash of the node
    lost. Called by the Tracker and, in a forked process, by the user-MLflow sink.

    Raises:
        OSError: the file cannot be read or the copy written (no partial copy is left).
    """
    src = Path(local_file)
    folder = Path(state_dir) / "artifacts" / uuid.uuid4().hex
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".partial-{src.name}"
    try:
        shutil.copyfile(src, tmp)
        final = publish(tmp, folder / src.name)
        fsync_dir(folder.parent)  # the new <id> folder's own entry
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"artifact": {"file": str(final), "path": artifact_path or ""}}


class SpoolWriter:
    """Appends spool lines to a segment of this process's own (see the module docstring).

    Not thread-safe: the Tracker calls it under its lock.

    Args:
        state_dir: the tracking state folder; ``spool/`` is created in it.

    Raises:
        OSError: the folder cannot be written.
    """

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / SPOOL_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._size = 0
        self._torn = False
        self.path: Path | None = None
        self._open_next()

    def _open_next(self) -> None:
        seqs = [int(m.group(1)) for m in map(_SEGMENT.match, os.listdir(self.dir)) if m]
        seq = max(seqs, default=0) + 1
        # Created under its final name (O_EXCL: a name taken is skipped) and locked at once. One name only: on a
        # FUSE or NFS mount a second name (a hard link) is another inode to the client, whose size and lock a
        # reader opening the other name does not see, so it would remove a live segment as delivered (points
        # lost on an sshfs runs root). A reader keeps the newest segment while it is empty (the instant before
        # the lock).
        while True:
            path = self.dir / f"{seq:08d}.jsonl"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                seq += 1
        try:
            try_lock(fd)
        except BaseException:
            os.close(fd)
            raise
        fsync_dir(self.dir)
        old, self._fd, self.path, self._size, self._torn = self._fd, fd, path, 0, False
        if old is not None:
            os.fsync(old)
            os.close(old)  # releases its lock: the reader may remove it once delivered

    def append(self, data: bytes) -> None:
        """Append whole lines (not fsynced: see :meth:`sync`).

        Raises:
            OSError: the write failed (disk full...); the next append starts on a fresh line.
        """
        if not data:
            return
        if self._fd is None:
            raise OSError(errno.EBADF, "the spool writer is closed")
        if self._torn:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            self._torn = True
            raise
        self._torn = False
        self._size += len(data)
        if self._size >= ROTATE_BYTES:
            self._open_next()

    def sync(self) -> None:
        """fsync the current segment: everything appended so far survives a crash of the node."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close the segment, releasing its lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------------------------
# reader


class SpoolReader:
    """Reads the spool of ``state_dir`` for delivery and removes what was delivered.

    Offsets live in memory: a new reader starts each segment from its beginning, and the MLflow marks filter
    out what an earlier reader had delivered (see :class:`.session.RunSession`).
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.offsets: dict[Path, int] = {}
        self.malformed = 0

    def read(self, path: Path, max_entries: int) -> tuple[list[Entry], int]:
        """Up to ``max_entries`` entries from the whole lines of ``path`` after the delivered offset.

        Returns:
            (entries, end offset after them). The end equals the current offset when nothing new is there
            (or the file is gone).
        """
        start = self.offsets.get(path, 0)
        entries: list[Entry] = []
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return entries, start
        with f:
            f.seek(start)
            end = start
            while len(entries) < max_entries:
                raw = f.readline()
                if not raw.endswith(b"\n"):
                    break  # nothing more, or a line still being written
                end += len(raw)
                if not raw.strip():
                    continue
                entry = decode(raw)
                if entry is None:
                    self.malformed += 1
                else:
                    entries.append(entry)
        return entries, end

    def advance(self, path: Path, end: int) -> None:
        """Record that ``path`` is delivered up to byte ``end``."""
        self.offsets[path] = end

    def try_remove(self, path: Path, writer_closed: bool = False) -> bool:
        """Remove ``path`` if it is delivered to its end and no writer may still append to it.

        Args:
            writer_closed: the training told us it closed its writer; used only where the filesystem has no
                locks (then the newest segment is kept until then).

        Returns:
            True when removed (or already gone).
        """
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.offsets.pop(path, None)
            return True
        try:
            locked = try_lock(fd)
            if locked is False:
                return False
            offset = self.offsets.get(path, 0)
            size = os.fstat(fd).st_size
            if (locked is None or size == 0) and not writer_closed and path == segment_paths(self.state_dir)[-1]:
                return False  # no locks here, or a segment just created and not locked yet: kept for now
            if size > offset:
                tail = os.pread(fd, size - offset, offset)
                if b"\n" in tail:
                    return False  # whole lines not delivered yet
                self.malformed += 1  # torn by a killed writer
            os.unlink(path)
            self.offsets.pop(path, None)
            return True
        finally:
            os.close(fd)

    def remaining(self) -> int:
        """How many points wait in the spool past what this reader delivered (torn lines not counted)."""
        n = 0
        for path in segment_paths(self.state_dir):
            probe = SpoolReader(self.state_dir)
            probe.offsets[path] = self.offsets.get(path, 0)
            while True:
                entries, end = probe.read(path, 10_000)
                if end == probe.offsets[path]:
                    break
                n += sum(1 for e in entries if not isinstance(e, dict))
                probe.offsets[path] = end
        return n


def read_all(state_dir: Path) -> list[Entry]:
    """Every whole, well-formed entry of the spool, oldest first (for tests and tools)."""
    out: list[Entry] = []
    reader = SpoolReader(state_dir)
    for path in segment_paths(state_dir):
        while True:
            entries, end = reader.read(path, 10_000)
            if end == reader.offsets.get(path, 0):
                break
            out.extend(entries)
            reader.advance(path, end)
    return out


def points_of(entries: Sequence[Entry]) -> list[Point]:
    """The points among spool entries."""
    return [e for e in entries if not isinstance(e, dict)]  # type: ignore[misc]
