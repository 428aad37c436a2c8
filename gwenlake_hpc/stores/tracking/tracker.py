"""The training side of tracking: :class:`Tracker` writes points to the spool; a delivery process sends them.

A training on a SLURM cluster is preempted and restarted many times; it must show up as a single MLflow run
with exactly one point per logged step per metric, and the tracking server being slow, down or unreachable must
never crash or stall the training loop. The training process therefore never talks to MLflow (nor imports it):

* :meth:`Tracker.log_metrics` appends to a list in memory. A small thread writes that list to the spool (a
  file in the run's state folder, see :mod:`.delivery.spool`) every ``flush_interval_s`` or every 1000 points, and
  :meth:`Tracker.make_durable` writes and fsyncs it at once (the Run calls it before sealing a checkpoint).
* A delivery process, started by the Tracker (:mod:`.delivery.deliverer`), imports MLflow, creates or reattaches to the
  run, and delivers the spool, filtered against the highest step MLflow holds for each key so that every point
  arrives exactly once, however often either process is killed.
* At the end, :meth:`Tracker.finish` closes the spool and asks the delivery process to deliver everything, then
  mark the run; if that cannot happen in time, the status waits in ``pending_status`` and
  ``python -m gwenlake_hpc tracking sync RUN_DIR`` (or the next start) completes it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

from ...base.errors import ConfigError
from ...base.fsutil import write_atomic
from ...base.lease import FencedError, check_fence
from .delivery.delivery_process import DeliveryProcess
from .delivery.session import MAX_METRICS_PER_BATCH, MAX_PARAM_VALUE_LENGTH, MAX_TAG_VALUE_LENGTH
from .delivery.spool import Entry, SpoolReader, SpoolWriter, encode, stage_artifact
from .delivery.state import TERMINAL_STATUSES, TRACKING_JSON, read_run_id, sync_hint, write_pending_status
from .uri import redact_uri, validate_uri

logger = logging.getLogger("gwenlake_hpc.tracking")

# Points kept in memory at most while the spool cannot be written (disk full); older ones are dropped.
_MAX_BUFFERED = 1_000_000


def hook_reference(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a module-level function: how the delivery process, another process, finds a hook
    the training passed as a callable (``after_attach``, ``after_finish``).

    Raises:
        ValueError: ``fn`` cannot be imported by that name (a lambda, a nested function, a bound method).
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise ValueError(f"tracking hook {fn!r}: give a module-level function (the delivery process imports it)")
    return f"{module}:{qualname}"


def flatten(d: Mapping[Any, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config mapping into MLflow params.

    Args:
        d: a mapping, possibly nested (a dict, an OmegaConf ``DictConfig``...).
        prefix: prepended to every key (e.g. ``"model."``).

    Returns:
        ``{"a.b.c": "value"}``: keys joined with dots, values turned to ``str`` and cut to
        MLflow's param value limit (6000 characters). An empty nested mapping gives ``"{}"``.
    """
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if len(value) == 0:
                out[name] = "{}"
            else:
                out.update(flatten(value, prefix=f"{name}."))
        else:
            out[name] = str(value)[:MAX_PARAM_VALUE_LENGTH]
    return out


class Tracker:
    """Report one training into one MLflow run, across restarts of the process.

    Args:
        uri: tracking URI (config ``tracking.uri``), checked with :func:`.uri.validate_uri`.
        experiment: MLflow experiment name; created if missing.
        run_name: name of the run when it is created (a reattached run keeps its name).
        state_dir: folder on the shared filesystem, normally ``<run_dir>/tracking``; created. Holds
            ``tracking.json``, ``run_id``, ``spool/`` and ``pending_status`` (see :mod:`.delivery.state`).
        params: run params, logged once when the run is created (MLflow params are immutable; on reattach,
            params the run lacks are added and changed ones are kept, with a warning). Use :func:`flatten` for
            a nested config. Values longer than 6000 characters are cut.
        tags: run tags, set at creation and again at every reattach (e.g. the SLURM job id).
        artifact_location: artifact root of the experiment, only used when it is created.
        flush_interval_s: seconds between two writes of the spool (and deliveries); 1000 waiting points
            trigger one sooner.
        retry_max_s: cap of the exponential backoff (seconds) between reconnection attempts.
        after_attach: a module-level function called as ``function(state_dir, uri)`` in the delivery process
            once the run is attached, in a thread of its own (the job passes the registry's completion of pending
            registrations); its failures are logged as warnings. The delivery process imports it by its
            ``module:qualname`` (:func:`hook_reference`): tracking itself names no module above it.

    Nothing here talks to MLflow: the constructor writes ``tracking.json``, opens a spool segment and starts
    the delivery process, which connects, creates or reattaches to the run, and delivers.

    Raises:
        ConfigError: bad ``uri``, ``flush_interval_s`` or ``retry_max_s``.
        OSError: ``state_dir`` cannot be created or written.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, state_dir: str | os.PathLike[str], *,
                 params: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None,
                 artifact_location: str | None = None, flush_interval_s: float = 2.0,
                 retry_max_s: float = 30.0, after_attach: Callable[[Path, str], Any] | None = None) -> None:
        self._uri = validate_uri(uri)
        if not flush_interval_s > 0:
            raise ConfigError(f"tracking flush_interval_s must be > 0, got {flush_interval_s!r}")
        if not retry_max_s > 0:
            raise ConfigError(f"tracking retry_max_s must be > 0, got {retry_max_s!r}")
        self._flush_interval_s = float(flush_interval_s)
        self._retry_max_s = float(retry_max_s)
        self._after_attach = hook_reference(after_attach) if after_attach is not None else None
        self._state_dir = Path(state_dir).expanduser().absolute()
        self._state_dir.mkdir(parents=True, exist_ok=True)

        stored_uri = redact_uri(self._uri, keep_user=True)
        cfg: dict[str, Any] = {
            # Never the password: the run dir is on a shared filesystem. The delivery process gets the URI
            # on its standard input; sync() relies on .pgpass or the like, or on a uri passed to it.
            "uri": stored_uri,
            "experiment": str(experiment),
            "run_name": str(run_name),
            "artifact_location": artifact_location,
            "params": {str(k): str(v)[:MAX_PARAM_VALUE_LENGTH] for k, v in (params or {}).items()},
            "tags": {str(k): str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in (tags or {}).items()},
        }
        if stored_uri != self._uri:
            cfg["uri_password_removed"] = True
        write_atomic(self._state_dir / TRACKING_JSON, json.dumps(cfg, indent=2) + "\n")
        self._run_id: str | None = read_run_id(self._state_dir)

        # Per-key high-water marks: a step at or below the last one logged for a key is dropped here (a
        # resumed training replays the steps after its checkpoint; the delivery drops those MLflow holds).
        self._marks: dict[str, int] = {}
        # Reentrant: a signal handler may log while the main thread is inside log_metrics.
        self._lock = threading.RLock()
        self._buf: list[Entry] = []
        self._warned_values: set[str] = set()
        self._closed = False
        # _io_lock orders the writes of the spool (the writer thread, make_durable, the end).
        self._io_lock = threading.RLock()
        self._writer = SpoolWriter(self._state_dir)
        self._spool_warned = False
        self._fenced: str | None = None  # why this start's points are dropped: a newer start took the run
        self._dropped = 0

        self._api_lock = threading.Lock()
        self._final: tuple[str, str | None, bool] | None = None
        self._delivery = DeliveryProcess(
            {"state_dir": str(self._state_dir), "uri": self._uri, "flush_interval_s": self._flush_interval_s,
             "retry_max_s": self._retry_max_s, "after_attach": self._after_attach}, self._on_attached)
        self._delivery.start()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._write_loop, name="gwenlake-spool", daemon=True)
        self._thread.start()
        # At interpreter exit, write what is left and let the delivery process finish (never a terminal
        # status: the fluent API's hook marking evicted runs FINISHED is what we avoid).
        atexit.register(self._at_exit)

    # -- public API --------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The MLflow run id: read from ``state_dir/run_id`` at start, or told by the delivery process."""
        return self._run_id

    @property
    def state_dir(self) -> Path:
        """The absolute ``state_dir``."""
        return self._state_dir

    def wait_attached(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the delivery process created or reattached to the run.

        Returns False at once when the delivery process reported that MLflow does not answer (waiting longer
        would only delay the end of the job; what needs the run is recorded as pending)."""
        attached, outage = self._delivery.attached, self._delivery.outage
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while not attached.is_set() and not outage.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attached.wait(min(left, 0.2))
        return attached.is_set()

    def _on_attached(self, run_id: str, marks: Mapping[str, int]) -> None:
        """The delivery process attached the run: its id, and the steps MLflow holds (dropped here too)."""
        self._run_id = run_id
        with self._lock:
            for key, step in marks.items():
                if step > self._marks.get(key, -math.inf):
                    self._marks[key] = int(step)

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Record one point per metric at ``step``; never blocks on tracking, never raises for it.

        Args:
            metrics: key -> value; values go through ``float()`` (a 0-d tensor works; NaN and inf are kept,
                MLflow stores them). A value that is not a number is dropped with one warning per key.
            step: the training step (int). A key's point is silently dropped if ``step`` is at or below the
                highest step already logged for that key in this process; steps MLflow already holds are
                dropped by the delivery (a resumed training replays the steps after its last checkpoint, and
                MLflow would store them as second points).
            timestamp_ms: milliseconds since the epoch; default now.
        """
        if self._closed:
            return
        try:
            step = int(step)
            ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        except (TypeError, ValueError, OverflowError):
            self._warn_value("<step>", f"step={step!r}, timestamp_ms={timestamp_ms!r}")
            return
        with self._lock:
            marks, buf = self._marks, self._buf
            for key, value in metrics.items():
                key = str(key)
                try:
                    value = float(value)
                except (TypeError, ValueError, OverflowError, RuntimeError):
                    self._warn_value(key, repr(value)[:80])
                    continue
                if step <= marks.get(key, -math.inf):
                    continue
                marks[key] = step
                buf.append((key, value, step, ts))
            if len(buf) >= MAX_METRICS_PER_BATCH:
                self._wake.set()

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Record run tags (values turned to ``str``), delivered in order with the points; never blocks."""
        if self._closed or not tags:
            return
        with self._lock:
            self._buf.append({"tags": {str(k): str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in tags.items()}})

    def rename_tags(self, renames: Mapping[str, str]) -> None:
        """Rename run tags (old name -> new name), in order with the points: the delivery gives each new name
        the old tag's value, then deletes the old tag; a tag the run does not hold is left alone. Never
        blocks."""
        if self._closed or not renames:
            return
        with self._lock:
            self._buf.append({"rename_tags": {str(k): str(v) for k, v in renames.items()}})

    def log_inputs(self, inputs: Sequence[Mapping[str, Any]]) -> None:
        """Record dataset inputs of the run (MLflow's ``log_input``), delivered in order with the points.

        Args:
            inputs: ``{"dataset": {"name", "digest", "source_type", "source", "schema", "profile"}, "tags":
                {key: value}}`` each, the fields of MLflow's ``Dataset`` entity (strings; ``schema`` and
                ``profile`` may be None) and its input tags (e.g. ``mlflow.data.context``). The store keeps
                one input per dataset name and digest, so a resumed training logging it again adds nothing.
        """
        if self._closed or not inputs:
            return
        with self._lock:
            self._buf.append({"inputs": [dict(i) for i in inputs]})

    def log_rollout(self, entry: Mapping[str, Any]) -> None:
        """Record one RL rollout (``{"rollout": {...}}`` from :func:`.rollouts.rollout_entry`), delivered in order
        with the points as an MLflow trace; never blocks."""
        if self._closed:
            return
        with self._lock:
            self._buf.append(dict(entry))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record run params (values turned to ``str``, cut to 6000 characters), delivered in order with the
        points; one the run holds already with another value keeps its first value, with a warning (MLflow
        params are immutable). Never blocks."""
        if self._closed or not params:
            return
        with self._lock:
            self._buf.append({"params": {str(k): str(v)[:MAX_PARAM_VALUE_LENGTH] for k, v in params.items()}})

    def log_artifact(self, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Copy ``local_file`` into the state folder (``artifacts/``, atomically) and record it; the delivery
        process uploads it to the run's ``artifact_path`` folder, in order with the points, then removes the
        copy.

        Raises:
            OSError: ``local_file`` cannot be read or the copy cannot be written (the caller's own error).
        """
        if self._closed:
            return
        entry = stage_artifact(self._state_dir, local_file, artifact_path)
        with self._lock:
            self._buf.append(entry)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Write every point logged so far to the spool (not fsynced) and wake the delivery process.

        Returns False when the spool cannot be written. ``timeout_s`` is kept for compatibility.
        """
        ok = self._write(sync=False)
        self._delivery.send({"op": "wake"})
        return ok

    def make_durable(self, timeout_s: float = 5.0) -> bool:
        """Make every point logged so far durable: written to the spool and fsynced, in this thread.

        The Run calls it before it seals a checkpoint, so that no point at or before the checkpoint's step can
        be lost by a later SIGKILL (the steps after it are replayed on resume and logged again). It does not
        wait for MLflow: the delivery process sends the spool. ``timeout_s`` is kept for compatibility.

        Returns:
            True when everything is in the spool; False when the spool cannot be written (the points stay in
            memory, with a warning).
        """
        if self._closed:
            return False
        return self._write(sync=True)

    def finish(self, status: str, timeout_s: float = 30.0,
               after_finish: Callable[[Path, str], Any] | None = None) -> bool:
        """Deliver everything, then mark the run ``status``; stop the delivery process either way.

        Args:
            status: ``"FINISHED"``, ``"KILLED"`` or ``"FAILED"``.
            timeout_s: seconds to wait for the delivery (plus up to 1 s for its answer).
            after_finish: a module-level function called as ``function(state_dir, uri)`` in the delivery
                process (imported there by :func:`hook_reference`) once every point is delivered and the run
                marked (e.g. the registration of the committed version: MLflow is loaded there already, the
                training does not load it). Within ``timeout_s``; its failures are logged as warnings and do not
                change the result.

        Returns:
            True when every point was delivered and the run terminated. False otherwise: the spool keeps the
            points, ``pending_status`` the status, the run stays RUNNING, and a WARNING says that
            ``python -m gwenlake_hpc tracking sync <run_dir>`` delivers them. Idempotent: a second call returns
            the first result (after close(): False).

        Raises:
            ConfigError: unknown ``status`` (a programming error, not a tracking problem).
        """
        status = str(status).upper()
        if status not in TERMINAL_STATUSES:
            raise ConfigError(f"tracking status must be one of {TERMINAL_STATUSES}, got {status!r}")
        return self._shutdown("finish", status, timeout_s,
                              hook_reference(after_finish) if after_finish is not None else None)

    def close(self, timeout_s: float = 5.0) -> bool:
        """End without a terminal status (e.g. on eviction); the run stays RUNNING.

        The delivery process delivers what is waiting for up to ``timeout_s`` seconds; what is left stays in
        the spool for the next start or :func:`.delivery.sync.sync`. Returns True if everything was delivered.
        Idempotent.
        """
        return self._shutdown("close", None, timeout_s)

    # -- the spool ---------------------------------------------------------------------------

    def _warn_value(self, key: str, what: str) -> None:
        if key not in self._warned_values:
            self._warned_values.add(key)
            logger.warning("tracking: dropping metric %r: not a number (%s)", key, what)

    def _write(self, sync: bool) -> bool:
        """Append the buffered entries to the spool, in order; fsync when ``sync``. False on a write error."""
        with self._io_lock:
            with self._lock:
                buf, self._buf = self._buf, []
            if buf or sync:
                try:
                    check_fence("writing the tracking spool")
                except FencedError as exc:
                    self._fenced = str(exc)  # the points of a start that lost its run are dropped
                    return False
            try:
                self._writer.append(encode(buf))
                if sync:
                    self._writer.sync()
            except OSError as exc:
                with self._lock:
                    self._buf[:0] = buf  # kept for the next try, in order
                    extra = len(self._buf) - _MAX_BUFFERED
                    if extra > 0:
                        del self._buf[:extra]
                        self._dropped += extra
                if not self._spool_warned:
                    self._spool_warned = True
                    logger.warning("tracking: cannot write the spool in %s (%s); points are kept in memory "
                                   "(the newest %d at most)", self._state_dir, exc, _MAX_BUFFERED)
                return False
            if self._spool_warned:
                self._spool_warned = False
                logger.info("tracking: the spool in %s is written again%s", self._state_dir,
                            f" ({self._dropped} point(s) were dropped)" if self._dropped else "")
            return True

    def _write_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                wrote = bool(self._buf)
                self._write(sync=False)
                if wrote:
                    self._delivery.send({"op": "wake"})
                if not self._closed:
                    self._delivery.check()
            except Exception:  # noqa: BLE001 - a bug here must not stop the training; the end writes again
                logger.exception("tracking: internal error in the spool writer")

    # -- the end -----------------------------------------------------------------------------

    def _at_exit(self) -> None:
        self.close(timeout_s=5.0)

    def _shutdown(self, kind: str, status: str | None, timeout_s: float, after: str | None = None) -> bool:
        timeout_s = max(float(timeout_s), 0.0)
        with self._api_lock:
            if self._final is not None:
                if (self._final[0], self._final[1]) != (kind, status):
                    logger.warning("tracking: %s(%s) after %s(%s) is ignored", kind, status or "", self._final[0],
                                   self._final[1] or "")
                    return False
                return self._final[2]
            with contextlib.suppress(Exception):
                atexit.unregister(self._at_exit)
            end_time = int(time.time() * 1000)
            self._closed = True
            self._wake.set()
            try:
                check_fence(f"marking the MLflow run {status}" if status else "delivering the spool")
            except FencedError as exc:  # the run belongs to a newer start now: its status is not ours to set
                logger.error("tracking: %s", exc)
                self._delivery.stop()
                self._final = (kind, status, False)
                return False
            with self._io_lock:
                written = self._write(sync=True)
                with contextlib.suppress(OSError):
                    self._writer.close()
            result = self._delivery.end(kind, status, end_time, timeout_s, after) and written
            self._delivery.stop()
            if not result:
                self._record_pending(kind, status, end_time)
            self._final = (kind, status, result)
            return result

    def _record_pending(self, kind: str, status: str | None, end_time: int) -> None:
        if kind == "finish" and status is not None:
            try:
                write_pending_status(self._state_dir, status, end_time)
            except OSError as exc:
                logger.error("tracking: could not save the pending status in %s: %s", self._state_dir, exc)
        waiting = SpoolReader(self._state_dir).remaining()
        if kind == "finish":
            logger.warning("tracking: could not deliver to MLflow at %s in time; the %s status and the spool "
                           "(%d point(s), some perhaps delivered) wait in %s, %s; `%s` will deliver them",
                           redact_uri(self._uri), status, waiting, self._state_dir,
                           f"run {self._run_id} stays RUNNING" if self._run_id else "the run is not created",
                           sync_hint(self._state_dir))
        elif waiting:
            logger.warning("tracking: %d point(s) may not be delivered to MLflow at %s yet; they wait in %s; the "
                           "next start or `%s` will deliver them", waiting, redact_uri(self._uri),
                           self._state_dir / "spool", sync_hint(self._state_dir))
