"""Tracking: one MLflow run per training across restarts, one point per step.

- :mod:`.core`: the Tracker (queue, delivery thread, spool, reattach), ``sync``, URI checks (to be split
  further: URI, spool, session, delivery, sync).
- :mod:`.sqlite`: the default SQLite store, created whole under a lock or not at all.
"""

from .core import (ATTACH_COUNT_TAG, PENDING_STATUS_FILE, PENDING_TAGS_FILE, RUN_ID_FILE, SPOOL_FILE,
                   TERMINAL_STATUSES, TRACKING_JSON, NullTracker, Tracker, _redact_uri, default_uri, flatten,
                   is_sqlite, state_dir_for, sync, validate_uri)
from .sqlite import BrokenStoreError, ensure_sqlite_store, sqlite_path, sqlite_uri

__all__ = ["ATTACH_COUNT_TAG", "PENDING_STATUS_FILE", "PENDING_TAGS_FILE", "RUN_ID_FILE", "SPOOL_FILE",
           "TERMINAL_STATUSES", "TRACKING_JSON", "NullTracker", "Tracker", "default_uri", "flatten", "is_sqlite",
           "state_dir_for", "sync", "validate_uri", "BrokenStoreError", "ensure_sqlite_store", "sqlite_path", "sqlite_uri",
           "_redact_uri"]
