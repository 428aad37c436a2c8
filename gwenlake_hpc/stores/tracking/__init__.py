"""Tracking: one MLflow run per training across restarts, one point per step, delivered out of the loop.

Data flows one way: the training's :class:`Tracker` appends to the spool; the delivery process reads it and
talks to MLflow; ``tracking sync`` finishes what a training could not.

- :mod:`.uri`: checking tracking URIs, the default SQLite store's URI, credentials kept out of logs.
- :mod:`.sqlite`: the default SQLite store, created whole under a lock or not at all.
- :mod:`.state`: the run's tracking state folder (``tracking.json``, ``run_id``, ``pending_status``).
- :mod:`.spool`: the on-disk queue of points and tags (segments, writer, reader).
- :mod:`.session`: one MLflow conversation for one run (create or reattach, exactly-once points).
- :mod:`.delivery`: the delivery process and the :class:`.delivery.Deliverer` it runs.
- :mod:`.tracker`: the training side (:class:`Tracker`, :class:`NullTracker`, :func:`flatten`).
- :mod:`.sync`: ``tracking sync``.

Importing this package does not import MLflow.
"""

from .session import ATTACH_COUNT_TAG
from .spool import LEGACY_SPOOL_FILE, SPOOL_DIR
from .sqlite import BrokenStoreError, ensure_sqlite_store, sqlite_path, sqlite_uri
from .state import (PENDING_STATUS_FILE, PENDING_TAGS_FILE, RUN_ID_FILE, TERMINAL_STATUSES, TRACKING_JSON,
                    state_dir_for)
from .sync import sync
from .tracker import NullTracker, Tracker, flatten
from .uri import default_uri, is_sqlite, redact_uri, validate_uri

__all__ = ["ATTACH_COUNT_TAG", "PENDING_STATUS_FILE", "PENDING_TAGS_FILE", "RUN_ID_FILE", "SPOOL_DIR",
           "LEGACY_SPOOL_FILE", "TERMINAL_STATUSES", "TRACKING_JSON", "NullTracker", "Tracker", "default_uri",
           "flatten", "is_sqlite", "state_dir_for", "sync", "validate_uri", "BrokenStoreError",
           "ensure_sqlite_store", "sqlite_path", "sqlite_uri", "redact_uri"]
