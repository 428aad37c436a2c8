"""Small durable-file helpers shared by the run directory's writers."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; else set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def mkstemp(dir: str | os.PathLike, prefix: str, suffix: str = ".tmp") -> tuple[int, str]:
    """:func:`tempfile.mkstemp`, but the file gets the mode a plain ``open()`` would give (0644 with the usual
    umask), not 0600: it is renamed into a place teammates on the shared filesystem read (datasets, run
    records, checkpoints, tracking state). Returns (fd, path)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=dir)
    os.fchmod(fd, 0o666 & ~umask())
    return fd, path


def mkdtemp(dir: str | os.PathLike, prefix: str) -> str:
    """:func:`tempfile.mkdtemp` with the mode of a plain ``mkdir()`` (0755 with the usual umask), not 0700."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    os.chmod(path, 0o777 & ~umask())
    return path


def fsync_dir(path: str | os.PathLike, *, best_effort: bool = False) -> None:
    """fsync a directory, so a rename or a new entry in it survives a crash of the node.

    Raises OSError when the directory cannot be opened or synced, unless ``best_effort`` (some platforms and
    file systems do not allow opening a directory: the data already written is then as durable as they make it).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        if best_effort:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not best_effort:
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsync, rename, fsync dir.

    A reader sees the old content or the new one, never a mix; a kill leaves at most a stray ``.tmp`` file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = mkstemp(path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`write_atomic` of ``obj`` as indented, key-sorted JSON."""
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """Parse a JSON file, or return ``default`` when it does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
