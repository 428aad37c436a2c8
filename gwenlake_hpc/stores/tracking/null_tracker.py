"""The tracker of a job with tracking off (``tracking=False``, ``job.tracking=false``, ``fit.local()``).

:class:`NullTracker` has :class:`~.tracker.Tracker`'s interface and does nothing: no store, no file, no process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

from ...base.errors import ConfigError
from .delivery.state import TERMINAL_STATUSES


class NullTracker:
    """A tracker that does nothing (``tracking=False``): touches no store, no file, no process.

    Same interface as :class:`~.tracker.Tracker`; ``run_id`` is None; ``finish`` and ``close`` return
    True (nothing was left undelivered); ``wait_attached`` returns False.
    """

    run_id: str | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Do nothing."""

    def log_rollout(self, entry: Mapping[str, Any]) -> None:
        """Do nothing."""

    def rename_tags(self, renames: Mapping[str, str]) -> None:
        """Do nothing."""

    def log_inputs(self, inputs: Sequence[Mapping[str, Any]]) -> None:
        """Do nothing."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Do nothing."""

    def log_artifact(self, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Do nothing."""

    def wait_attached(self, timeout_s: float) -> bool:
        """Return False at once: there is no run."""
        return False

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Return True: nothing is waiting."""
        return True

    def make_durable(self, timeout_s: float = 5.0) -> bool:
        """Return True: nothing is waiting."""
        return True

    def finish(self, status: str, timeout_s: float = 30.0,
               after_finish: Callable[[Path, str], Any] | None = None) -> bool:
        """Check ``status`` like :meth:`.tracker.Tracker.finish` and return True (``after_finish`` is not called).

        Raises:
            ConfigError: unknown ``status``.
        """
        if str(status).upper() not in TERMINAL_STATUSES:
            raise ConfigError(f"tracking status must be one of {TERMINAL_STATUSES}, got {status!r}")
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Return True."""
        return True
