"""Tracking: one MLflow run per training across restarts, one point per step, delivered out of the loop.

Data flows one way: the training's :class:`Tracker` appends to the spool; the delivery process reads it and
talks to MLflow; ``tracking sync`` finishes what a training could not. Two sub-packages, one per side:

- :mod:`.delivery`: getting the job's points into MLflow reliably: the spool, the state folder, the delivery
  process (both ends), the MLflow session, ``tracking sync``.
- :mod:`.user_mlflow`: MLflow's own API inside a training function, reporting into the job's run (the
  ``gwenlake-job:`` URI, where its calls go, MLflow's plug-ins).

At the root, what the Run, the job and the commands use:

- :mod:`.tracker`: the training side (:class:`Tracker`, :func:`flatten`, :func:`~.tracker.hook_reference`).
- :mod:`.null_tracker`: :class:`NullTracker`, the tracker of a job with tracking off.
- :mod:`.uri`: checking tracking URIs, the default SQLite store's URI, credentials kept out of logs.
- :mod:`.sqlite`: the default SQLite store, created whole under a lock or not at all.
- :mod:`.metric_tags`, :mod:`.custom_metrics` (StatsD), :mod:`.rollouts` (RL episodes as MLflow traces).

Importing this package does not import MLflow. ``python -m gwenlake_hpc.stores.tracking`` and the module
``mlflow_plugin`` here are the paths of older command lines and installs, forwarded to the sub-packages.
"""

from .delivery.session import ATTACH_COUNT_TAG
from .delivery.spool import LEGACY_SPOOL_FILE, SPOOL_DIR
from .delivery.state import (PENDING_STATUS_FILE, PENDING_TAGS_FILE, RUN_ID_FILE, TERMINAL_STATUSES, TRACKING_JSON,
                             state_dir_for)
from .delivery.sync import sync
from .null_tracker import NullTracker
from .sqlite import BrokenStoreError, ensure_sqlite_store, sqlite_path, sqlite_uri
from .tracker import Tracker, flatten
from .uri import default_uri, is_sqlite, redact_uri, validate_uri

__all__ = ["ATTACH_COUNT_TAG", "PENDING_STATUS_FILE", "PENDING_TAGS_FILE", "RUN_ID_FILE", "SPOOL_DIR",
           "LEGACY_SPOOL_FILE", "TERMINAL_STATUSES", "TRACKING_JSON", "NullTracker", "Tracker", "default_uri",
           "flatten", "is_sqlite", "state_dir_for", "sync", "validate_uri", "BrokenStoreError",
           "ensure_sqlite_store", "sqlite_path", "sqlite_uri", "redact_uri"]
