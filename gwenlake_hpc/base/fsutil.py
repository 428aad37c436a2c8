"""The one durable write, and the small file helpers around it.

Every place that replaces a file others read (checkpoints, datasets, run records, tracking state, model files)
goes through :func:`atomic_file` / :func:`write_atomic` (bytes in hand) or :func:`publish` (a temporary file a
library wrote, such as h5py or SQLite): the data goes to a temporary name *beside* the target (same file system,
so the rename is atomic), is fsynced, renamed over the target, and the directory is fsynced so that the rename
survives a crash of the node. A place that needs less says why in a comment where it writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import ConfigError

#: What a start writes inside its run directory, files and folders. None of them may be a symbolic link: a link
#: planted there (``checkpoints -> /elsewhere``) would make the start write the lock, its records, the tracking
#: spool, the model or whole checkpoints into a folder outside the run. (``run.json``, ``.fence``, ``.lease`` and
#: ``checkpoints/LATEST.json`` are replaced by a rename, which replaces a link rather than writing through it;
#: they are refused all the same: a start also reads them.)
RUN_DIR_ENTRIES = (".lock", "run.json", ".fence", ".lease", "ledger", "tracking", "output", "checkpoints", "slurm",
                   "hangs", ".ranks", "init_models")


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


def publish(tmp: str | os.PathLike, path: str | os.PathLike, *, best_effort_dir: bool = False) -> Path:
    """Make the closed file ``tmp`` (beside ``path``) durable and put it in place: fsync it, rename it over
    ``path``, fsync the directory.

    ``best_effort_dir`` tolerates a file system that cannot fsync a directory (see :func:`fsync_dir`).

    Raises:
        OSError: ``tmp`` cannot be synced or renamed (``tmp`` is then left for the caller to remove).
    """
    path = Path(path)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent, best_effort=best_effort_dir)
    return path


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, best_effort_dir: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on a clean exit flush, fsync, rename it over ``path``
    and fsync the directory. On an exception the temporary file is removed and ``path`` is untouched.

    ``mode`` is ``"wb"`` or ``"w"`` (text, UTF-8). The temporary file gets the mode a plain ``open()`` gives.
    A reader sees the old content or the new one, never a mix; a kill leaves at most a stray ``.<name>.*.tmp``.

    Raises:
        ValueError: ``mode`` is not a write mode above.
        OSError: the folder cannot be made, or the file written, synced or renamed.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file: mode {mode!r}; use 'wb' or 'w'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp(path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent, best_effort=best_effort_dir)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` durably through :func:`atomic_file` (str as UTF-8). Returns ``path``.

    Raises:
        OSError: as :func:`atomic_file`.
    """
    raw = data.encode() if isinstance(data, str) else data
    with atomic_file(path) as fh:
        fh.write(raw)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`write_atomic` of ``obj`` as indented, key-sorted JSON."""
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """Parse a JSON file, or return ``default`` when it does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


def refuse_symlinks(run_dir: str | os.PathLike, entries: Iterable[str] = RUN_DIR_ENTRIES) -> None:
    """Refuse a run directory that is itself a symbolic link, or that holds one among ``entries`` (the names a
    start writes, :data:`RUN_DIR_ENTRIES`). Looked at with ``lstat``, never followed; nothing is written.

    The folders above the run directory may be links (``paths.runs_root=/scratch/me`` where ``/scratch`` is a
    link, or a model's folder): only the run directory's own entry and what is inside it are checked.

    Raises:
        ConfigError: naming the path, where the link leads, and what to do.
    """
    run_dir = Path(run_dir)
    for path in (run_dir, *(run_dir / name for name in entries)):
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError:  # not there yet (made by this start), or the run directory is not: nothing to follow
            continue
        if not is_link:
            continue
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if path == run_dir:
            raise ConfigError(f"the run directory {path} is a symbolic link (to {target}): a start would write the "
                              "run's lock, records, model and checkpoints through it into another folder. Remove "
                              "the link (move that folder back in its place if it holds the run), or point "
                              "paths.runs_root at the real folder (a runs root reached through a link is fine)")
        raise ConfigError(f"{path} in the run directory is a symbolic link (to {target}): a start would write into "
                          f"that folder outside the run. Remove the link (rm {path}); if it holds this run's "
                          "files, move them back in its place first. To keep checkpoints on another disk, set "
                          "paths.runs_root there (or checkpoint.local_dir for a node-local level)")


def open_append(path: str | os.PathLike, read: bool = False) -> IO[str]:
    """Open ``path`` (made if missing) to append text, never through a symbolic link: ``O_NOFOLLOW``, so a link
    planted at that name is refused rather than written through. ``read``: also readable (``a+``).

    Raises:
        ConfigError: ``path`` is a symbolic link (naming it and the fix).
        OSError: it cannot be opened otherwise.
    """
    fd = open_nofollow(path, (os.O_RDWR if read else os.O_WRONLY) | os.O_CREAT | os.O_APPEND, 0o666)
    return os.fdopen(fd, "a+" if read else "a", encoding="utf-8")


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)``: a file descriptor, never through a symbolic link at ``path``.

    Raises:
        ConfigError: ``path`` is a symbolic link (naming it and the fix).
        OSError: it cannot be opened otherwise.
    """
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link: it is not written through; remove it (rm {path})") \
                from None
        raise
