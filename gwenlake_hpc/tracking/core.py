"""Report one training into one MLflow run, across any number of restarts of the process.

A training on a SLURM cluster is preempted and restarted many times; it must show up as a
single MLflow run with exactly one point per logged step per metric, and the tracking server
being slow, down or unreachable must never crash or stall the training loop.

How it works:

* :class:`Tracker` puts points on an in-memory queue (:meth:`Tracker.log_metrics` never blocks
  and never raises for tracking problems). A daemon thread owns every conversation with MLflow,
  through :class:`mlflow.MlflowClient` (never the fluent API: ``mlflow.start_run`` registers an
  atexit hook that would mark an evicted run FINISHED).
* Everything that must outlive the process lives in ``state_dir`` (on the shared filesystem,
  e.g. ``<run_dir>/tracking/``)::

      tracking.json      {uri (password removed), experiment, run_name, artifact_location,
                          params, tags}; written by every Tracker at start, read by sync()
      run_id             the MLflow run id, written atomically once the run exists
      spool.jsonl        points not yet delivered, one JSON object a line:
                         {"key", "value", "step", "timestamp"} (timestamp in ms since the epoch)
      pending_status     {"status", "end_time"}: a terminal status not yet delivered
      pending_tags.json  tags not yet delivered (only when a finish/close could not deliver them)

* The next Tracker on the same ``state_dir`` reattaches to the run in ``run_id``, and both it and
  :func:`sync` deliver the spool. MLflow stores a repeated step as a second point and cannot
  delete points, so every delivery is filtered against the highest step the server already
  holds for each key (read with ``get_metric_history`` on every (re)connection), and
  ``log_metrics`` drops a step at or below the highest step already logged for that key (a
  resumed training replays the steps after its last checkpoint).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import hashlib
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError
from ..fsutil import write_atomic
from .sqlite import BrokenStoreError, ensure_sqlite_store, sqlite_uri

logger = logging.getLogger("gwenlake_hpc.tracking")

#: File names inside ``state_dir``.
TRACKING_JSON = "tracking.json"
RUN_ID_FILE = "run_id"
SPOOL_FILE = "spool.jsonl"
PENDING_STATUS_FILE = "pending_status"
PENDING_TAGS_FILE = "pending_tags.json"

#: Statuses accepted by :meth:`Tracker.finish`.
TERMINAL_STATUSES = ("FINISHED", "KILLED", "FAILED")
#: Run tag counting how many times a later process reattached to the run (0 at creation).
ATTACH_COUNT_TAG = "gwenlake.attach_count"

# MLflow's own limits (mlflow.utils.validation): a log_batch call takes at most 1000 metrics and
# at most 100 params or tags; longer param/tag values are refused, not truncated.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000

_ACCEPTED_SCHEMES = ("sqlite", "postgresql", "mysql", "http", "https", "databricks")
# The MLflow error code that says "this request will never succeed" (MLflow's own validation:
# bad metric name, a param changing value, a deleted run): the offending metric, param or tag is
# dropped instead of blocking everything behind it. Anything else (connection refused, 5xx, a
# proxy's bare 400, 401/403 from an expired token or a Host check, timeouts) is an outage: keep
# the points and retry.
_PERMANENT_ERROR_CODES = frozenset({"INVALID_PARAMETER_VALUE"})
# After finish()/close() times out, how long the caller still waits for a request in flight
# before it writes the spool itself.
_SHUTDOWN_GRACE_S = 1.0

Point = tuple[str, float, int, int]  # key, value, step, timestamp in ms


# --------------------------------------------------------------------------------------------
# URIs


def default_uri(runs_root: str | os.PathLike[str]) -> str:
    """Return the default tracking URI, a SQLite store next to the runs.

    Args:
        runs_root: folder holding the runs (the project's runs root); made absolute, so the URI
            does not depend on the working directory of the job.

    Returns:
        ``"sqlite:///<absolute runs_root>/mlflow.db"`` (four slashes for an absolute path), the path
        percent-encoded, so the store lands inside ``runs_root`` whatever characters it holds.
    """
    return sqlite_uri(Path(runs_root) / "mlflow.db")


def validate_uri(uri: str) -> str:
    """Check a tracking URI (config key ``tracking.uri``) and return it stripped.

    Accepted: ``sqlite:``, ``postgresql:``, ``mysql:`` (with an optional ``+driver``),
    ``http:``, ``https:`` and ``databricks``.

    Raises:
        ConfigError: for an empty value, a ``file:`` URI or a plain path (MLflow 3 refuses the
            filesystem store, "in maintenance mode"), or an unknown scheme. The message names
            ``tracking.uri`` and suggests ``sqlite:///<path>/mlflow.db`` or ``http://host:port``.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(
            "tracking.uri is empty: set it to sqlite:///<path>/mlflow.db or http://host:port"
        )
    uri = uri.strip()
    if uri == "databricks":
        return uri
    scheme = urlsplit(uri).scheme.lower()
    # A Windows drive letter parses as a one-letter scheme: it is a plain path too.
    if not scheme or len(scheme) == 1:
        path = Path(uri).expanduser().absolute()
        suggestion = f"sqlite:///{path}" if path.suffix == ".db" else f"sqlite:///{path}/mlflow.db"
        raise ConfigError(
            f"tracking.uri={uri!r} is a plain path; MLflow 3 no longer accepts the filesystem "
            f"tracking backend (it is in maintenance mode). Use {suggestion} or http://host:port"
        )
    if scheme == "file":
        path = Path(urlsplit(uri).path or ".").absolute()
        raise ConfigError(
            f"tracking.uri={_redact_uri(uri)!r}: MLflow 3 no longer accepts the filesystem "
            f"tracking backend ('file:' URIs, in maintenance mode). Use "
            f"sqlite:///{path}/mlflow.db or http://host:port"
        )
    if scheme.split("+", 1)[0] not in _ACCEPTED_SCHEMES:
        raise ConfigError(
            f"tracking.uri={_redact_uri(uri)!r} has an unsupported scheme {scheme!r}; use "
            f"sqlite:///<path>/mlflow.db, http://host:port, or one of: "
            f"{', '.join(_ACCEPTED_SCHEMES)}"
        )
    return uri


def is_sqlite(uri: str) -> bool:
    """Tell whether ``uri`` is a SQLite store (``sqlite:`` or ``sqlite+driver:``)."""
    return urlsplit(str(uri)).scheme.lower().split("+", 1)[0] == "sqlite"


def _redact_uri(uri: str, keep_user: bool = False) -> str:
    """Return ``uri`` without its password (and without its user unless ``keep_user``)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}@{host}" if keep_user and user else host
    return urlunsplit(parts._replace(netloc=netloc))


def _scrub(text: object, uri: str, limit: int = 300) -> str:
    """Return ``str(text)`` shortened, with the credentials of ``uri`` cut out.

    MLflow error messages repeat the URL they called, credentials included. A long message
    keeps its head and its tail: the cause ("Connection refused") comes last.
    """
    out = str(text)
    netloc = urlsplit(uri).netloc
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        out = out.replace(userinfo + "@", "")
        password = userinfo.split(":", 1)[1] if ":" in userinfo else ""
        if password:
            out = out.replace(password, "***")
    if len(out) <= limit:
        return out
    half = (limit - 5) // 2
    return f"{out[:half]} ... {out[-half:]}"


def _set_http_defaults() -> None:
    # We retry ourselves, with the spool; MLflow's own retry loop (7 tries with backoff by
    # default) would stall the tracking thread, and finish(), for minutes.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


# --------------------------------------------------------------------------------------------
# Params


def state_dir_for(run_dir: str | os.PathLike[str], uri: str) -> Path:
    """The tracking state folder of a run for ``uri``: ``<run_dir>/tracking`` for the URI the run first
    reported to, ``<run_dir>/tracking-<hash>`` for another one.

    An MLflow run lives in one store: after a change of ``tracking.uri`` the run reports into a run of its
    own in the new store (whole from then on) instead of re-pointing the first one's run id at a store that
    does not know it, and a later return to the first URI finds its run again.
    """
    base = Path(run_dir) / "tracking"
    stored = _read_json_dict(base / TRACKING_JSON).get("uri")
    if stored is None or stored == _redact_uri(validate_uri(uri), keep_user=True):
        return base
    digest = hashlib.sha256(_redact_uri(uri, keep_user=True).encode()).hexdigest()[:8]
    logger.warning("tracking.uri differs from the one this run first reported to (%s); reporting into a separate "
                   "MLflow run for %s (state in %s)", _redact_uri(stored), _redact_uri(uri), base.name + "-" + digest)
    return Path(run_dir) / f"tracking-{digest}"


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


# --------------------------------------------------------------------------------------------
# State files


def _read_run_id(state_dir: Path) -> str | None:
    try:
        run_id = (state_dir / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return run_id or None


def _read_pending_status(state_dir: Path) -> tuple[str, int | None] | None:
    try:
        text = (state_dir / PENDING_STATUS_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        status, end_time = str(data["status"]), data.get("end_time")
    except (ValueError, TypeError, KeyError):
        status, end_time = text, None  # a bare status word, written by hand
    status = status.upper()
    if status not in TERMINAL_STATUSES:
        logger.warning("tracking: ignoring unknown status %r in %s", status, state_dir)
        return None
    return status, (int(end_time) if end_time is not None else None)


def _read_json_dict(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError:
        logger.warning("tracking: ignoring unreadable %s", path)
        return {}
    return data if isinstance(data, dict) else {}


def _point_line(point: Point) -> str:
    key, value, step, timestamp = point
    # allow_nan: Python's json writes and reads NaN/Infinity, which MLflow accepts as values.
    return json.dumps({"key": key, "value": value, "step": step, "timestamp": timestamp}) + "\n"


def _append_spool(path: Path, points: Sequence[Point]) -> None:
    if not points:
        return
    data = "".join(_point_line(p) for p in points).encode("utf-8")
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end > 0:
            # A crash mid-append can leave a torn last line: start on a fresh line so that the
            # torn one does not swallow the first new point.
            f.seek(end - 1)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _iter_spool(path: Path) -> Iterator[tuple[Point | None, int]]:
    """Yield (point, byte offset of the end of its line); point is None for a malformed line."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                # Unterminated last line: an append in progress (make_durable from another thread) or
                # torn by a crash; the next append terminates a torn one, which is then malformed.
                return
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                d = json.loads(raw)
                point: Point | None = (
                    str(d["key"]),
                    float(d["value"]),
                    int(d["step"]),
                    int(d["timestamp"]),
                )
            except (ValueError, KeyError, TypeError):
                point = None
            yield point, offset


def _count_spool(path: Path) -> int:
    return sum(1 for point, _ in _iter_spool(path) if point is not None)


def _rewrite_spool_tail(path: Path, offset: int) -> None:
    """Keep only the bytes of the spool after ``offset`` (atomically); remove it if empty."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        src.seek(offset)
        shutil.copyfileobj(src, dst)
        dst.flush()
        os.fsync(dst.fileno())
        empty = dst.tell() == 0
    if empty:
        tmp.unlink()
        path.unlink(missing_ok=True)
    else:
        os.replace(tmp, path)


def _sync_hint(state_dir: Path) -> str:
    # The CLI takes the run directory; state_dir is normally <run_dir>/tracking.
    run_dir = state_dir.parent if state_dir.name == "tracking" else state_dir
    return f"python -m gwenlake_hpc tracking sync {run_dir}"


# --------------------------------------------------------------------------------------------
# Talking to MLflow


def _is_permanent(exc: BaseException) -> bool:
    """Tell whether MLflow refused a request for good (bad key, value, or a deleted run)."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.error_code in _PERMANENT_ERROR_CODES


class _Abandoned(Exception):
    """The caller of finish()/close() gave up waiting and persisted the state itself."""


class _RunSession:
    """One connection to the tracking store for one run.

    Holds the :class:`mlflow.MlflowClient`, the run id and ``marks``, the highest step the
    server stores for each metric key, which every delivery is filtered against.
    """

    def __init__(self, uri: str) -> None:
        from mlflow import MlflowClient

        if is_sqlite(uri):
            ensure_sqlite_store(uri)  # never let MLflow migrate a new SQLite file in place
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None
        self.marks: dict[str, int] = {}
        self.delivered = 0  # points stored by this session
        self.rejected: set[str] = set()  # keys the server refused (bad name): dropped

    @property
    def rid(self) -> str:
        """The run id, once open_run() has succeeded."""
        if self.run_id is None:
            raise RuntimeError("no MLflow run is open")
        return self.run_id

    # -- run ---------------------------------------------------------------------------------

    def open_run(
        self,
        cfg: Mapping[str, Any],
        run_id: str | None,
        state_dir: Path,
        *,
        resume: bool,
        update: bool,
        on_run_id: Callable[[str], None] | None = None,
    ) -> bool:
        """Attach to ``run_id`` or create the run; fetch the marks. Returns True if created.

        ``resume``: a new process takes the run over (status RUNNING, attach count + 1).
        ``update``: log the configured tags and the params the run lacks.
        A run the server does not know (or deleted) is replaced by a new one, with a warning.
        """
        from mlflow.exceptions import MlflowException

        params: Mapping[str, str] = cfg.get("params") or {}
        tags: Mapping[str, str] = cfg.get("tags") or {}
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                run = None
            if run is not None and run.info.lifecycle_stage == "deleted":
                run = None
            if run is not None:
                self.run_id = run_id
                if resume:
                    count = _to_int(run.data.tags.get(ATTACH_COUNT_TAG), 0) + 1
                    self.client.update_run(run_id, status="RUNNING")
                    self.log_tags({**tags, ATTACH_COUNT_TAG: str(count)})
                elif update:
                    self.log_tags(tags)
                if update or resume:
                    self.log_params(params, existing=run.data.params)
                self.fetch_marks(run)
                return False
            logger.warning(
                "tracking: run %s recorded in %s does not exist (or is deleted) on %s; "
                "starting a new run",
                run_id,
                state_dir,
                _redact_uri(self.uri),
            )
        experiment_id = self._experiment_id(str(cfg["experiment"]), cfg.get("artifact_location"))
        run = self.client.create_run(
            experiment_id, run_name=str(cfg["run_name"]), tags={ATTACH_COUNT_TAG: "0"}
        )
        self.run_id = run.info.run_id
        # Written before anything else can fail, so that a retry or the next process reattaches
        # to this run instead of creating a second one.
        write_atomic(state_dir / RUN_ID_FILE, self.run_id + "\n")
        if on_run_id is not None:
            on_run_id(self.run_id)
        # Tags and params go through log_batch rather than create_run, so that one bad name is
        # dropped with a warning instead of failing the creation forever.
        self.log_tags(tags)
        self.log_params(params, existing={})
        self.marks = {}
        return True

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(name, artifact_location=artifact_location)
            except MlflowException as exc:
                # Another training created it between our two calls.
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            raise RuntimeError(
                f"experiment {name!r} is deleted on the tracking server; restore it "
                f"(mlflow experiments restore) or set another tracking.experiment"
            )
        return experiment.experiment_id

    def fetch_marks(self, run: Any = None) -> None:
        """Read the highest stored step of every metric key of the run into ``marks``.

        From the run's latest metrics (one row a key, the point of the highest step: MLflow orders them by
        step, then timestamp), so reattaching costs the same after 20,000 steps as after 2,000,000; reading
        every key's whole history took a minute on long runs.
        """
        if run is None:
            run = self.client.get_run(self.rid)
        self.marks = {m.key: int(m.step) for m in run.data.to_proto().metrics}

    # -- data --------------------------------------------------------------------------------

    def log_points(self, points: Sequence[Point]) -> int:
        """Store the points the server does not hold yet, in order; return how many were stored.

        A point whose step is at or below the mark of its key is skipped. Raises on a transient
        failure; the marks then cover exactly what was stored before it.
        """
        from mlflow.entities import Metric

        seen = dict(self.marks)
        todo: list[Point] = []
        for point in points:
            key, _, step, _ = point
            if key in self.rejected or step <= seen.get(key, -math.inf):
                continue
            seen[key] = step
            todo.append(point)
        stored = 0
        for start in range(0, len(todo), MAX_METRICS_PER_BATCH):
            chunk = todo[start : start + MAX_METRICS_PER_BATCH]
            metrics = [Metric(key, value, ts, step) for key, value, step, ts in chunk]
            try:
                self.client.log_batch(self.rid, metrics=metrics, synchronous=True)
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
                stored += self._log_points_by_key(chunk)
                continue
            self._mark(chunk)
            stored += len(chunk)
        self.delivered += stored
        return stored

    def _log_points_by_key(self, chunk: Sequence[Point]) -> int:
        # One refused key must not block the others: send key by key, drop the refused ones.
        from mlflow.entities import Metric

        by_key: dict[str, list[Point]] = {}
        for point in chunk:
            by_key.setdefault(point[0], []).append(point)
        stored = 0
        for key, points in by_key.items():
            metrics = [Metric(k, value, ts, step) for k, value, step, ts in points]
            try:
                self.client.log_batch(self.rid, metrics=metrics, synchronous=True)
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
                self.rejected.add(key)
                logger.warning(
                    "tracking: the server refused metric %r, dropping its points: %s",
                    key,
                    _scrub(exc, self.uri),
                )
                continue
            self._mark(points)
            stored += len(points)
        return stored

    def _mark(self, points: Sequence[Point]) -> None:
        for key, _, step, _ in points:
            if step > self.marks.get(key, -math.inf):
                self.marks[key] = step

    def log_params(self, params: Mapping[str, str], existing: Mapping[str, str]) -> None:
        """Log the params the run lacks; warn about those whose value changed (immutable)."""
        from mlflow.entities import Param

        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            logger.warning(
                "tracking: %d param(s) differ from those run %s was created with and are left "
                "as they were (MLflow params are immutable): %s",
                len(changed),
                self.run_id,
                ", ".join(changed[:20]) + (" ..." if len(changed) > 20 else ""),
            )
        todo = [Param(k, v) for k, v in params.items() if k not in existing]
        self._log_entities("param", todo, lambda items: {"params": items})

    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (values cut to MLflow's 8000-character limit)."""
        from mlflow.entities import RunTag

        todo = [RunTag(k, str(v)[:MAX_TAG_VALUE_LENGTH]) for k, v in tags.items()]
        self._log_entities("tag", todo, lambda items: {"tags": items})

    def _log_entities(
        self, what: str, items: list[Any], kwargs: Callable[[list[Any]], dict[str, Any]]
    ) -> None:
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = items[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            try:
                self.client.log_batch(self.rid, synchronous=True, **kwargs(chunk))
                continue
            except Exception as exc:
                if not _is_permanent(exc):
                    raise
            for item in chunk:  # find and drop the refused ones
                try:
                    self.client.log_batch(self.rid, synchronous=True, **kwargs([item]))
                except Exception as exc:
                    if not _is_permanent(exc):
                        raise
                    logger.warning(
                        "tracking: the server refused %s %r, dropping it: %s",
                        what,
                        item.key,
                        _scrub(exc, self.uri),
                    )


def _to_int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def _deliver_spool(
    session: _RunSession,
    path: Path,
    lock: contextlib.AbstractContextManager[Any],
    abandoned: Callable[[], bool],
) -> int:
    """Deliver ``path`` in order, in chunks; return how many points were stored.

    On success the spool is removed. On failure it is rewritten (atomically) with what follows
    the last delivered chunk and the exception propagates. A crash in between leaves delivered
    points in the spool: the marks read from the server on the next connection drop them.
    """
    delivered = 0
    offset = 0  # end of the last delivered line
    last_end = 0
    chunk: list[Point] = []
    malformed = 0
    try:
        for point, end in _iter_spool(path):
            last_end = end
            if point is None:
                malformed += 1
                continue
            chunk.append(point)
            if len(chunk) >= MAX_METRICS_PER_BATCH:
                delivered += session.log_points(chunk)
                chunk = []
                offset = last_end
                if abandoned():
                    raise _Abandoned
        if chunk:
            delivered += session.log_points(chunk)
        offset = last_end
    except BaseException:
        with lock:
            if not abandoned() and offset > 0:
                _rewrite_spool_tail(path, offset)
        raise
    if malformed:
        logger.warning("tracking: skipped %d malformed line(s) in %s", malformed, path)
    with lock:
        if not abandoned():
            # Points appended meanwhile (Tracker.make_durable) stay; what was delivered goes.
            if path.exists() and path.stat().st_size > last_end:
                _rewrite_spool_tail(path, last_end)
            else:
                path.unlink(missing_ok=True)
    return delivered


# --------------------------------------------------------------------------------------------
# Tracker


class Tracker:
    """Report one training into one MLflow run, across restarts of the process.

    Args:
        uri: tracking URI (config ``tracking.uri``), checked with :func:`validate_uri`.
        experiment: MLflow experiment name; created if missing.
        run_name: name of the run when it is created (a reattached run keeps its name).
        state_dir: folder on the shared filesystem, normally ``<run_dir>/tracking``; created.
            Holds ``tracking.json``, ``run_id``, ``spool.jsonl``, ``pending_status`` and
            ``pending_tags.json`` (see the module docstring).
        params: run params, logged once when the run is created (MLflow params are immutable;
            on reattach, params the run lacks are added and changed ones are kept, with a
            warning). Use :func:`flatten` for a nested config. Values longer than 6000
            characters are cut.
        tags: run tags, set at creation and again at every reattach (e.g. the SLURM job id).
        artifact_location: artifact root of the experiment, only used when it is created.
        flush_interval_s: seconds between deliveries; 1000 waiting points trigger one sooner.
        retry_max_s: cap of the exponential backoff (seconds) between reconnection attempts.

    Nothing in the constructor talks to the server (an unreachable server must not stall
    start-up): a daemon thread connects, creates or reattaches to the run, and delivers.

    Raises:
        ConfigError: bad ``uri``, ``flush_interval_s`` or ``retry_max_s``.
        OSError: ``state_dir`` cannot be created or written.
    """

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        state_dir: str | os.PathLike[str],
        *,
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        artifact_location: str | None = None,
        flush_interval_s: float = 2.0,
        retry_max_s: float = 30.0,
    ) -> None:
        self._uri = validate_uri(uri)
        if not flush_interval_s > 0:
            raise ConfigError(f"tracking flush_interval_s must be > 0, got {flush_interval_s!r}")
        if not retry_max_s > 0:
            raise ConfigError(f"tracking retry_max_s must be > 0, got {retry_max_s!r}")
        _set_http_defaults()
        self._flush_interval_s = float(flush_interval_s)
        self._retry_max_s = float(retry_max_s)
        self._state_dir = Path(state_dir).expanduser().absolute()
        self._state_dir.mkdir(parents=True, exist_ok=True)
        self._spool_path = self._state_dir / SPOOL_FILE

        stored_uri = _redact_uri(self._uri, keep_user=True)
        cfg: dict[str, Any] = {
            # Never the password: the run dir is on a shared filesystem. sync() then relies on
            # .pgpass or the like, or on a uri passed to it.
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
        self._cfg = {**cfg, "uri": self._uri}
        self._run_id: str | None = _read_run_id(self._state_dir)

        # Caller side: per-key high-water marks. Seeded from a spool left by an earlier process,
        # raised by the thread to the server's marks once attached.
        self._marks: dict[str, int] = {}
        # Reentrant, and the queue is a SimpleQueue: a signal handler (SIGTERM on eviction) may
        # log or finish while the main thread is inside log_metrics.
        self._marks_lock = threading.RLock()
        for point, _ in _iter_spool(self._spool_path):
            if point is not None and point[2] > self._marks.get(point[0], -math.inf):
                self._marks[point[0]] = point[2]
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._n_put = 0  # points put by callers (approximate with several caller threads)
        self._n_taken = 0  # points taken by the thread
        self._warned_values: set[str] = set()
        self._closed = False

        # Thread side. _io_lock guards _pending, _pending_tags, _abandoned and the files; it is
        # never held during a network call, and log_metrics never takes it.
        self._io_lock = threading.Lock()
        self._pending: list[Point] = []  # newer than anything in the spool
        self._pending_tags: dict[str, str] = {}
        self._abandoned = False
        self._session: _RunSession | None = None
        self._system_monitor: Any = None
        self._opened = False
        self._created_here = False
        self._outage = False
        self._outage_delivered_mark = 0
        self._delivered_before = 0
        self._spool_warned = False
        # Whether spool.jsonl may hold points: saves a stat of the shared filesystem per flush.
        self._spool_maybe = self._spool_path.exists()

        # flush(): callers wait until every point put so far is delivered or in the spool.
        self._durable_cv = threading.Condition()
        self._durable = 0  # points taken by the thread and delivered or spooled
        self._flush_target = 0

        self._api_lock = threading.RLock()
        self._stop_req: tuple[str, str | None, float, int] | None = None
        self._result: bool | None = None
        self._wake = threading.Event()
        self._attached = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="gwenlake-tracking", daemon=True)
        self._thread.start()
        # At interpreter exit, spool what is left (never a terminal status: the fluent API's
        # hook marking evicted runs FINISHED is what we avoid).
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # -- public API --------------------------------------------------------------------------

    @property
    def run_id(self) -> str | None:
        """The MLflow run id: read from ``state_dir/run_id`` at start, or set once created."""
        return self._run_id

    @property
    def state_dir(self) -> Path:
        """The absolute ``state_dir``."""
        return self._state_dir

    def wait_attached(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until the run is created or reattached."""
        return self._attached.wait(timeout_s)

    def log_metrics(
        self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Queue one point per metric at ``step``; never blocks, never raises for tracking.

        Args:
            metrics: key -> value; values go through ``float()`` (a 0-d tensor works; NaN and
                inf are kept, MLflow stores them). A value that is not a number is dropped with
                one warning per key.
            step: the training step (int). A key's point is silently dropped if ``step`` is at
                or below the highest step already logged or stored for that key: a resumed
                training replays the steps after its last checkpoint, and MLflow would store
                them as second points.
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
        values: list[tuple[str, float]] = []
        for key, value in metrics.items():
            try:
                values.append((str(key), float(value)))
            except (TypeError, ValueError, OverflowError, RuntimeError):
                self._warn_value(str(key), repr(value)[:80])
        accepted: list[Point] = []
        with self._marks_lock:
            for key, value in values:
                if step <= self._marks.get(key, -math.inf):
                    continue
                self._marks[key] = step
                accepted.append((key, value, step, ts))
        if not accepted:
            return
        self._queue.put(("m", accepted))
        self._n_put += len(accepted)
        if self._n_put - self._n_taken >= MAX_METRICS_PER_BATCH:
            self._wake.set()

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Queue run tags (values turned to ``str``); delivered by the thread, never blocks."""
        if self._closed or not tags:
            return
        self._queue.put(("t", {str(k): str(v)[:MAX_TAG_VALUE_LENGTH] for k, v in tags.items()}))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every point logged so far is delivered or written to the spool.

        The Run calls it when a checkpoint is sealed, so that a SIGKILL after a checkpoint loses no point
        at or before it (the points after it are replayed by the resumed training). Bounded: with the
        server refusing connections the thread spools at once; a hung request is waited for at most
        ``timeout_s`` seconds. Returns True when everything is durable.
        """
        if self._closed:
            return False
        with self._durable_cv:
            target = self._n_put
            if self._durable >= target:
                return True
            self._flush_target = max(self._flush_target, target)
        self._wake.set()
        with self._durable_cv:
            return self._durable_cv.wait_for(lambda: self._durable >= target, timeout=max(timeout_s, 0.0))

    def make_durable(self, timeout_s: float = 5.0) -> bool:
        """Make every point logged so far durable: delivered, or written to the spool and fsynced.

        The Run calls it before it seals a checkpoint, so that no point at or before the checkpoint's step
        can be lost by a later SIGKILL (the steps after it are replayed on resume and logged again). Waits
        up to ``timeout_s`` seconds for the delivery thread (:meth:`flush`); if it is still busy (a slow or
        hung server, a store being created), the points it holds and those still queued are appended to the
        spool here. A point that is then also delivered by the thread is dropped at the next delivery of the
        spool (every delivery is filtered against the server's marks), so none is stored twice.

        Returns:
            True when everything was delivered or spooled; False only when the spool cannot be written
            (the points stay in memory, with a warning).
        """
        if self._closed:
            return False
        if self.flush(timeout_s):
            return True
        with self._io_lock:
            if self._abandoned:
                return False
            self._take_queue()
            try:
                _append_spool(self._spool_path, self._pending)  # a copy: the thread may be sending them
            except OSError as exc:
                logger.warning("tracking: cannot write %s (%s); points since the last delivery are in memory only",
                               self._spool_path, exc)
                return False
            self._spool_maybe = True
        logger.info("tracking: MLflow is slow to answer; points up to now are kept in %s", self._spool_path)
        return True

    def _note_durable(self) -> None:
        with self._io_lock:
            if self._pending:
                return
            taken = self._n_taken
        with self._durable_cv:
            if taken > self._durable:
                self._durable = taken
                self._durable_cv.notify_all()

    def finish(self, status: str, timeout_s: float = 30.0) -> bool:
        """Deliver everything, then mark the run ``status``; stop the thread either way.

        Args:
            status: ``"FINISHED"``, ``"KILLED"`` or ``"FAILED"``.
            timeout_s: seconds to wait for the server (plus up to 1 s for a request in flight).

        Returns:
            True when every point was delivered and the run terminated. False otherwise: the
            spool keeps the points, ``pending_status`` the status, the run stays RUNNING, and a
            WARNING says that ``python -m gwenlake_hpc tracking sync <run_dir>`` delivers them.
            Idempotent: a second call returns the first result (after close(): False).

        Raises:
            ConfigError: unknown ``status`` (a programming error, not a tracking problem).
        """
        status = str(status).upper()
        if status not in TERMINAL_STATUSES:
            raise ConfigError(f"tracking status must be one of {TERMINAL_STATUSES}, got {status!r}")
        return self._shutdown("finish", status, timeout_s)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread without a terminal status (e.g. on eviction); the run stays RUNNING.

        Tries to deliver what is waiting for up to ``timeout_s`` seconds; what is left goes to
        the spool for the next process or :func:`sync`. Returns True if everything was
        delivered. Idempotent.
        """
        return self._shutdown("close", None, timeout_s)

    # -- shutdown ----------------------------------------------------------------------------

    def _shutdown(self, kind: str, status: str | None, timeout_s: float) -> bool:
        timeout_s = max(float(timeout_s), 0.0)
        with self._api_lock:
            if self._stop_req is None:
                self._closed = True
                now_ms = int(time.time() * 1000)
                self._stop_req = (kind, status, time.monotonic() + timeout_s, now_ms)
                self._wake.set()
                with contextlib.suppress(Exception):
                    atexit.unregister(self._atexit)
            elif self._stop_req[0] != kind or self._stop_req[1] != status:
                logger.warning(
                    "tracking: %s(%s) after %s(%s) is ignored",
                    kind,
                    status or "",
                    self._stop_req[0],
                    self._stop_req[1] or "",
                )
                self._done.wait(timeout_s + _SHUTDOWN_GRACE_S)
                return False
            req = self._stop_req
        if not self._done.wait(timeout_s + _SHUTDOWN_GRACE_S):
            self._abandon(req)
        return bool(self._result)

    def _abandon(self, req: tuple[str, str | None, float, int]) -> None:
        # The thread is stuck in a request: write the state ourselves; the thread sees
        # _abandoned when its request returns and exits without touching anything.
        if not self._io_lock.acquire(timeout=5.0):
            logger.error("tracking: could not save the undelivered points to %s", self._spool_path)
            return
        try:
            if self._result is not None:
                return
            self._abandoned = True
            self._result = False
            self._take_queue()
            self._persist(req)
        finally:
            self._io_lock.release()

    def _persist(self, req: tuple[str, str | None, float, int]) -> None:
        """Write pending points, tags and status to state_dir. Caller holds _io_lock."""
        kind, status, _, end_time = req
        try:
            _append_spool(self._spool_path, self._pending)
            self._pending.clear()
            if self._pending_tags:
                path = self._state_dir / PENDING_TAGS_FILE
                tags = {**_read_json_dict(path), **self._pending_tags}
                write_atomic(path, json.dumps(tags, indent=2) + "\n")
                self._pending_tags.clear()
            if kind == "finish":
                write_atomic(
                    self._state_dir / PENDING_STATUS_FILE,
                    json.dumps({"status": status, "end_time": end_time}) + "\n",
                )
        except OSError as exc:
            logger.error(
                "tracking: could not save undelivered data in %s: %s", self._state_dir, exc
            )
            return
        waiting = _count_spool(self._spool_path)
        if kind == "finish":
            logger.warning(
                "tracking: could not deliver to MLflow at %s in time; %d point(s) and the %s "
                "status wait in %s and %s; `%s` will deliver them",
                _redact_uri(self._uri),
                waiting,
                status,
                self._state_dir,
                f"run {self._run_id} stays RUNNING" if self._run_id else "the run is not created",
                _sync_hint(self._state_dir),
            )
        elif waiting:
            logger.warning(
                "tracking: %d point(s) not delivered to MLflow at %s wait in %s; the next start "
                "or `%s` will deliver them",
                waiting,
                _redact_uri(self._uri),
                self._spool_path,
                _sync_hint(self._state_dir),
            )

    # -- thread ------------------------------------------------------------------------------

    def _warn_value(self, key: str, what: str) -> None:
        if key not in self._warned_values:
            self._warned_values.add(key)
            logger.warning("tracking: dropping metric %r: not a number (%s)", key, what)

    def _take_queue(self) -> None:
        """Move queued items to _pending/_pending_tags. Caller holds _io_lock."""
        taken = 0
        while True:
            try:
                kind, payload = self._queue.get_nowait()
            except queue.Empty:
                break
            if kind == "m":
                self._pending.extend(payload)
                taken += len(payload)
            else:
                self._pending_tags.update(payload)
        self._n_taken += taken

    def _drain(self) -> None:
        with self._io_lock:
            if self._abandoned:
                raise _Abandoned
            self._take_queue()

    def _is_abandoned(self) -> bool:
        return self._abandoned

    def _start_system_metrics(self) -> None:
        """MLflow's system metrics (``system/*``), when its own switch ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``
        is on, logged into this run by MLflow's monitor thread; steps continue after the last one a previous
        process logged (``resume_logging``)."""
        if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() not in ("true", "1"):
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(self._run_id, resume_logging=True, tracking_uri=self._uri)
            self._system_monitor.start()
        except Exception as exc:  # noqa: BLE001 - psutil missing, an old MLflow: say so, never fail the run
            self._system_monitor = None
            logger.warning("tracking: MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING is on but MLflow's system metrics "
                           "cannot start (%s: %s)", type(exc).__name__, exc)

    def _stop_system_metrics(self) -> None:
        monitor, self._system_monitor = self._system_monitor, None
        if monitor is not None:
            with contextlib.suppress(Exception):
                monitor.finish()

    def _main(self) -> None:
        try:
            self._loop()
        except _Abandoned:
            pass
        except BaseException:  # a bug must not lose the points: save them, then stop
            logger.exception("tracking: internal error in the tracking thread")
            self._closed = True  # nobody would take the queue any more
            with self._io_lock:
                if not self._abandoned and self._result is None:
                    self._result = False
                    self._take_queue()
                    self._persist(self._stop_req or ("close", None, 0.0, int(time.time() * 1000)))
        finally:
            self._stop_system_metrics()
            self._done.set()

    def _loop(self) -> None:
        backoff_min = min(1.0, self._retry_max_s)
        backoff = backoff_min
        next_try = 0.0  # first attempt at once
        next_flush = time.monotonic() + self._flush_interval_s
        while True:
            now = time.monotonic()
            wait = next_flush - now
            if self._session is None:
                wait = min(wait, next_try - now)
            if self._stop_req is None and wait > 0:
                self._wake.wait(wait)
            self._wake.clear()
            self._drain()
            if self._stop_req is not None:
                self._stop_system_metrics()  # its last points before the run's status
                self._stop(self._stop_req)
                return
            now = time.monotonic()
            flush_wanted = self._flush_target > self._durable
            if self._session is None and now < next_try:
                if flush_wanted or now >= next_flush or len(self._pending) >= MAX_METRICS_PER_BATCH:
                    # Still down: keep the spool on disk up to date, so that a crash loses
                    # nothing logged before the last flush, and memory stays bounded.
                    self._spool_pending()
                    self._note_durable()
                    next_flush = now + self._flush_interval_s
                continue
            due = flush_wanted or now >= next_flush or len(self._pending) >= MAX_METRICS_PER_BATCH
            if self._session is not None and not due:
                continue
            try:
                self._sync_once()
                backoff = backoff_min
            except _Abandoned:
                raise
            except Exception as exc:
                self._on_failure(exc)
                self._spool_pending()
                next_try = time.monotonic() + backoff
                backoff = min(backoff * 2, self._retry_max_s)
            self._note_durable()
            next_flush = time.monotonic() + self._flush_interval_s

    def _connect(self) -> _RunSession:
        session = _RunSession(self._uri)
        if not self._opened:

            def on_run_id(run_id: str) -> None:
                self._run_id = run_id
                self._created_here = True

            created = session.open_run(
                self._cfg,
                self._run_id,
                self._state_dir,
                resume=not self._created_here,
                update=True,
                on_run_id=on_run_id,
            )
            self._run_id = session.run_id
            self._opened = True
            if not created:
                # This process takes the run over: a status left by an earlier one is stale.
                with self._io_lock:
                    if not self._abandoned:
                        (self._state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
            self._attached.set()
            self._start_system_metrics()
        else:
            session.run_id = self._run_id
            session.fetch_marks()
        # Raise the caller's marks to the server's, so that replays are dropped at the source.
        with self._marks_lock:
            for key, step in session.marks.items():
                if step > self._marks.get(key, -math.inf):
                    self._marks[key] = step
        return session

    def _sync_once(self) -> None:
        """Connect if needed, then deliver the spool, the pending points and the tags."""
        if self._session is None:
            self._session = self._connect()
        session = self._session
        if self._spool_maybe:
            n = _deliver_spool(session, self._spool_path, self._io_lock, self._is_abandoned)
            self._spool_maybe = False
            if n and not self._outage:  # left by an earlier process
                logger.info("tracking: delivered %d spooled points from %s", n, self._spool_path)
        while True:
            with self._io_lock:
                if self._abandoned:
                    raise _Abandoned
                batch = self._pending[:MAX_METRICS_PER_BATCH]
            if not batch:
                break
            session.log_points(batch)
            with self._io_lock:
                if self._abandoned:
                    raise _Abandoned
                del self._pending[: len(batch)]
        with self._io_lock:
            tags = dict(self._pending_tags)
        if tags:
            session.log_tags(tags)
            with self._io_lock:
                for key, value in tags.items():
                    if self._pending_tags.get(key) == value:
                        del self._pending_tags[key]
        if self._outage:
            self._outage = False
            logger.info(
                "tracking: server back, delivered %d points",
                self._total_delivered() - self._outage_delivered_mark,
            )

    def _total_delivered(self) -> int:
        return self._delivered_before + (self._session.delivered if self._session else 0)

    def _on_failure(self, exc: Exception) -> None:
        if self._session is not None:
            self._delivered_before += self._session.delivered
            self._session = None  # reconnect, and re-read the server's marks
        if not self._outage and not self._abandoned:
            self._outage = True
            self._outage_delivered_mark = self._delivered_before
            if isinstance(exc, BrokenStoreError):
                logger.error("tracking: %s; points are kept in %s", exc, self._spool_path)
                return
            logger.warning(
                "tracking: MLflow at %s is not answering (%s: %s); spooling points to %s and "
                "retrying (every %.0f s at most); the training goes on",
                _redact_uri(self._uri),
                type(exc).__name__,
                _scrub(exc, self._uri),
                self._spool_path,
                self._retry_max_s,
            )

    def _spool_pending(self) -> None:
        with self._io_lock:
            if self._abandoned or not self._pending:
                return
            try:
                _append_spool(self._spool_path, self._pending)
            except OSError as exc:
                if not self._spool_warned:
                    self._spool_warned = True
                    logger.warning(
                        "tracking: cannot write %s (%s); keeping points in memory",
                        self._spool_path,
                        exc,
                    )
                return
            self._pending.clear()
            self._spool_maybe = True

    def _stop(self, req: tuple[str, str | None, float, int]) -> None:
        kind, status, deadline, end_time = req
        backoff = 0.25
        while True:
            self._drain()
            try:
                self._sync_once()
                if kind == "finish":
                    assert self._session is not None and self._run_id is not None
                    self._session.client.set_terminated(self._run_id, status, end_time=end_time)
                    with self._io_lock:
                        if self._abandoned:
                            raise _Abandoned
                        (self._state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
                with self._io_lock:
                    if self._abandoned:
                        raise _Abandoned
                    self._result = True
                return
            except _Abandoned:
                raise
            except Exception as exc:
                self._on_failure(exc)
            if time.monotonic() + backoff >= deadline:
                break
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        with self._io_lock:
            if self._abandoned:
                raise _Abandoned
            self._take_queue()
            self._result = False
            self._persist(req)


def _close_at_exit(ref: weakref.ReferenceType[Tracker]) -> None:
    tracker = ref()
    if tracker is not None:
        tracker.close(timeout_s=2.0)


class NullTracker:
    """A tracker that does nothing (``tracking=False``): touches no store, no file, no thread.

    Same interface as :class:`Tracker`; ``run_id`` is None; ``finish`` and ``close`` return
    True (nothing was left undelivered); ``wait_attached`` returns False.
    """

    run_id: str | None = None

    def log_metrics(
        self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
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

    def finish(self, status: str, timeout_s: float = 30.0) -> bool:
        """Check ``status`` like :meth:`Tracker.finish` and return True.

        Raises:
            ConfigError: unknown ``status``.
        """
        if str(status).upper() not in TERMINAL_STATUSES:
            raise ConfigError(f"tracking status must be one of {TERMINAL_STATUSES}, got {status!r}")
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Return True."""
        return True


# --------------------------------------------------------------------------------------------
# sync


def sync(
    state_dir: str | os.PathLike[str], uri: str | None = None, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Deliver what a Tracker left in ``state_dir``: the spool, pending tags, pending status.

    Used by ``python -m gwenlake_hpc tracking sync RUN_DIR`` when the server was down at the end
    of a training. Run it while no training uses ``state_dir``.

    Args:
        state_dir: the Tracker's ``state_dir`` (normally ``<run_dir>/tracking``).
        uri: tracking URI; default the one in ``tracking.json`` (stored without its password).
        timeout_s: seconds to keep retrying an unreachable server.

    Returns:
        ``{"run_id": str | None, "delivered": int (points stored), "remaining": int (points
        still in the spool), "status": the status applied, or None}``. If the run was never
        created (server unreachable from the start), it is created from ``tracking.json``.
        Points the server already holds (same key, step at or below its highest) are dropped.
        The status is applied only once the spool is empty; on timeout a WARNING is logged
        and ``remaining`` tells what is left.

    Raises:
        ConfigError: ``state_dir`` has no readable ``tracking.json``, or the URI is invalid.
        BrokenStoreError (a ConfigError): the SQLite store exists but cannot be opened.
    """
    state_dir = Path(state_dir).expanduser().absolute()
    cfg_path = state_dir / TRACKING_JSON
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict) or "uri" not in cfg:
            raise ValueError("not a tracking.json")
    except FileNotFoundError:
        raise ConfigError(
            f"{state_dir} has no {TRACKING_JSON}: not the tracking folder of a run "
            f"(expected <run_dir>/tracking)"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"{cfg_path} is unreadable ({exc})") from None
    uri = validate_uri(uri if uri is not None else cfg["uri"])
    cfg = {**cfg, "uri": uri}
    _set_http_defaults()
    spool_path = state_dir / SPOOL_FILE
    tags_path = state_dir / PENDING_TAGS_FILE
    run_id = _read_run_id(state_dir)
    pending = _read_pending_status(state_dir)
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    backoff = 0.5
    delivered = 0
    applied: str | None = None
    no_lock = contextlib.nullcontext()
    while True:
        session: _RunSession | None = None
        try:
            session = _RunSession(uri)
            session.open_run(cfg, run_id, state_dir, resume=False, update=False)
            run_id = session.run_id
            _deliver_spool(session, spool_path, no_lock, lambda: False)
            tags = _read_json_dict(tags_path)
            if tags:
                session.log_tags({str(k): str(v) for k, v in tags.items()})
                tags_path.unlink(missing_ok=True)
            if pending is not None:
                status, end_time = pending
                session.client.set_terminated(session.rid, status, end_time=end_time)
                (state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
                applied = status
            delivered += session.delivered
            break
        except BrokenStoreError:
            raise
        except Exception as exc:
            if session is not None:
                delivered += session.delivered
                run_id = session.run_id or run_id
            if time.monotonic() + backoff >= deadline:
                logger.warning(
                    "tracking: sync of %s to %s failed (%s: %s); run it again later",
                    state_dir,
                    _redact_uri(uri),
                    type(exc).__name__,
                    _scrub(exc, uri),
                )
                break
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
    return {
        "run_id": run_id,
        "delivered": delivered,
        "remaining": _count_spool(spool_path),
        "status": applied,
    }
