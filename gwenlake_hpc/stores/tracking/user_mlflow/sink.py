"""Where MLflow calls made inside a training function go (see :mod:`.fluent`): the job's Tracker in the
training process, a spool segment of its own in a process forked from it, or nowhere when tracking is off.
Shared by :mod:`.fluent` (which registers the job's Tracker) and :mod:`.mlflow_plugin` (MLflow's side);
imports no MLflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..delivery.state import read_run_id

logger = logging.getLogger("gwenlake_hpc.tracking")

SCHEME = "gwenlake-job"
ARTIFACT_SCHEME = "gwenlake-job-artifacts"
#: The run id MLflow is given before the delivery process has created the run (first start, server down).
PENDING_RUN_ID = "gwenlake-job-run"
#: How long a first start whose code imports MLflow waits for the delivery process to create the run (seconds).
ATTACH_WAIT_S = 30.0

_lock = threading.Lock()
_sinks: dict[str, tuple[int, Any, Callable[[], int]]] = {}  # state folder -> (pid, tracker, current step)
_warned: set[str] = set()
_off_reason = ["tracking is off"]  # the warning's reason, set by fluent.reporting


def warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log ``message`` (a warning by default) the first time ``key`` is given in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.log(level, message, *args)


def register(state_dir: str, tracker: Any, current_step: Callable[[], int]) -> None:
    """Send the calls of this process for ``state_dir`` to ``tracker`` (the job's, while its function runs)."""
    with _lock:
        _sinks[state_dir] = (os.getpid(), tracker, current_step)


def unregister(state_dir: str) -> None:
    """Undo :func:`register`."""
    with _lock:
        _sinks.pop(state_dir, None)


def set_off_reason(reason: str) -> None:
    """The reason the one warning gives when tracking is off and the function calls MLflow."""
    _off_reason[0] = reason


class _Sink:
    """Where one process's MLflow calls go: the job's Tracker in the training process, a spool writer of its
    own in a process forked from it (a DataLoader worker), or nowhere (tracking off)."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.tracker: Any = None
        self.step: Callable[[], int] = lambda: 0
        self._writer: Any = None
        self._writer_pid = 0
        self._run_id: str | None = None
        self._marks: dict[str, int] = {}

    def _resolve(self) -> bool:
        if not self.state_dir:
            warn_once("off", "%s: MLflow calls in the training function go nowhere", _off_reason[0])
            return False
        with _lock:
            found = _sinks.get(self.state_dir)
        if found is not None and found[0] == os.getpid():
            self.tracker, self.step = found[1], found[2]
            return True
        self.tracker = None  # another process: append to a spool segment of its own
        if self._writer is None or self._writer_pid != os.getpid():
            from ..delivery.spool import SpoolWriter

            self._writer, self._writer_pid, self._marks = SpoolWriter(Path(self.state_dir)), os.getpid(), {}
        return True

    def run_id(self) -> str:
        """The job's MLflow run id once the delivery process created the run, else :data:`PENDING_RUN_ID`.
        Read from the state folder until found, then kept: MLflow checks the run id at every call."""
        if self._run_id is None and self.state_dir:
            with contextlib.suppress(OSError):
                self._run_id = read_run_id(Path(self.state_dir))
        return self._run_id or PENDING_RUN_ID

    def log(self, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        if not self._resolve():
            return
        if self.tracker is not None:
            for m in metrics:
                self.tracker.log_metrics({m.key: m.value}, step=self._step_of(m), timestamp_ms=m.timestamp)
            if params:
                self.tracker.log_params({p.key: p.value for p in params})
            if tags:
                self.tracker.set_tags({t.key: t.value for t in tags})
            return
        from ..delivery.spool import encode

        entries: list[Any] = []
        for m in metrics:
            step = int(m.step or 0)
            if step > self._marks.get(m.key, -1):
                self._marks[m.key] = step
                entries.append((m.key, float(m.value), step, int(m.timestamp or time.time() * 1000)))
        if params:
            entries.append({"params": {p.key: str(p.value) for p in params}})
        if tags:
            entries.append({"tags": {t.key: str(t.value) for t in tags}})
        self._writer.append(encode(entries))

    def log_inputs(self, inputs: list[dict[str, Any]]) -> None:
        """Dataset inputs of the run (the form of :meth:`gwenlake_hpc.stores.tracking.tracker.Tracker.log_inputs`)."""
        if not inputs or not self._resolve():
            return
        if self.tracker is not None:
            self.tracker.log_inputs(inputs)
            return
        from ..delivery.spool import encode

        self._writer.append(encode([{"inputs": inputs}]))

    def _step_of(self, metric: Any) -> int:
        step = int(metric.step or 0)
        if step == 0:  # MLflow's default for a point without a step: the training's own step
            with contextlib.suppress(Exception):
                return int(self.step())
        return step

    def log_artifact(self, local_file: str, artifact_path: str | None) -> None:
        if not self._resolve():
            return
        if self.tracker is not None:
            self.tracker.log_artifact(local_file, artifact_path)
            return
        from ..delivery.spool import encode, stage_artifact

        self._writer.append(encode([stage_artifact(Path(self.state_dir), local_file, artifact_path)]))


_sink_cache: dict[str, _Sink] = {}


def sink(state_dir: str) -> _Sink:
    """The sink of the state folder ``state_dir`` ("" with tracking off), one per folder and process."""
    with _lock:
        if state_dir not in _sink_cache:
            _sink_cache[state_dir] = _Sink(state_dir)
        return _sink_cache[state_dir]
