"""The default SQLite MLflow store: made whole or not at all, whatever kills or races its first use.

MLflow creates a SQLite store on first use by running its schema migrations in place, which takes a second or
more. A process killed in the middle, or two processes migrating the same new file at once (20 array tasks
starting together on one new ``runs_root``), leave a half-migrated file that every later run fails on ("table
... already exists", "Online migration expected to match one row"). Here the store is migrated in a temporary
file beside its final path, under an exclusive lock on ``<store>.lock``, fsynced and renamed into place: a
store either does not exist yet or is complete. An existing store is opened once per process and checked; a
broken one is reported with its path and what to do.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ...base.errors import ConfigError
from ...base.fsutil import publish

logger = logging.getLogger("gwenlake_hpc.tracking")

_READY: set[Path] = set()
_READY_LOCK = threading.Lock()


class BrokenStoreError(ConfigError):
    """The SQLite store exists but MLflow cannot use it (half-made by an older version, or damaged)."""


def sqlite_uri(path: str | os.PathLike[str]) -> str:
    """``sqlite:////ABSOLUTE/PATH`` of a file, with ``%``, ``?`` and ``#`` percent-encoded: in a folder name they
    would otherwise be read as an escape, a query or a fragment, and the store land elsewhere or not open.

    Spaces and non-ASCII letters stay as they are (SQLAlchemy reads them): MLflow creates the parent folder
    from the URI without decoding it, so each encoded character would leave an empty folder of that name.
    """
    text = str(Path(path).expanduser().absolute())
    return "sqlite:///" + text.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URI (percent-decoded), or None for another scheme or in-memory."""
    parts = urlsplit(uri)
    if parts.scheme.lower().split("+", 1)[0] != "sqlite":
        return None
    path = unquote(parts.path)[1:]  # sqlite:///rel.db is relative, sqlite:////abs.db absolute
    if not path or path == ":memory:":
        return None
    return Path(path)


def ensure_sqlite_store(uri: str) -> None:
    """Make sure the SQLite store of ``uri`` exists and is usable before MLflow touches it.

    Creates it whole (migrated in ``.<name>.<id>.tmp`` beside it, under ``<name>.lock``, renamed into place)
    when it does not exist; checks it once per process otherwise. Does nothing for other schemes.

    Raises:
        BrokenStoreError (exit 2): the file exists but MLflow cannot open it; the message names the file and
            how to start over.
        OSError: the folder cannot be written.
    """
    path = sqlite_path(uri)
    if path is None:
        return
    path = path.absolute()
    with _READY_LOCK:
        if path in _READY:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        # Under the lock no one is creating: a temporary store (and SQLite's journal of it) is a killed
        # creator's leftover.
        for stale in path.parent.glob(f".{path.name}.*.tmp*"):
            stale.unlink(missing_ok=True)
        if not path.exists():
            _create(path)
        else:
            _check(path)
    with _READY_LOCK:
        _READY.add(path)


def _store(uri: str, artifact_root: Path):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    return SqlAlchemyStore(uri, artifact_root.as_uri())


def _create(path: Path) -> None:
    """Migrate a new store at a temporary path beside ``path`` and publish it (SQLite writes the file itself, so
    :func:`~gwenlake_hpc.base.fsutil.publish` and not ``atomic_file``). Called under the store's lock."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        store = _store(sqlite_uri(tmp), path.parent / "mlartifacts")
        store.engine.dispose()  # every connection closed: the migrated store is a closed file to publish
        publish(tmp, path)
        logger.info("tracking: created the MLflow store %s", path)
    finally:
        for leftover in (tmp, *tmp.parent.glob(tmp.name + "-*")):  # the file, or SQLite's -journal/-wal/-shm
            leftover.unlink(missing_ok=True)


def _check(path: Path) -> None:
    try:
        _store(sqlite_uri(path), path.parent / "mlartifacts").engine.dispose()
    except Exception as exc:  # MLflow and SQLAlchemy raise many types here; all mean "unusable"
        raise BrokenStoreError(
            f"the MLflow store {path} cannot be opened ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            f"it was probably left half-made by a process killed while creating it. Move it away "
            f"(mv '{path}' '{path}.broken'); the next job creates a new store, and its runs start new MLflow "
            "runs there (checkpoints and model versions are not affected)") from exc
