"""One conversation with an MLflow tracking store for one run: create or reattach, log points once, params, tags.

Only the delivery process (:mod:`.deliverer`) and ``tracking sync`` use it: the training process never imports
MLflow for tracking. Every MLflow call goes through :class:`mlflow.MlflowClient`, never the fluent API
(``mlflow.start_run`` registers an atexit hook that would mark an evicted run FINISHED).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ....base.fsutil import write_atomic
from ..sqlite import ensure_sqlite_store
from .state import RUN_ID_FILE
from ..uri import is_sqlite, redact_uri, scrub

logger = logging.getLogger("gwenlake_hpc.tracking")

#: Run tag counting how many times a later process reattached to the run (0 at creation).
ATTACH_COUNT_TAG = "gwenlake.attach_count"

# MLflow's own limits (mlflow.utils.validation): a log_batch call takes at most 1000 metrics and
# at most 100 params or tags; longer param/tag values are refused, not truncated.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000

# The MLflow error code that says "this request will never succeed" (MLflow's own validation:
# bad metric name, a param changing value, a deleted run): the offending metric, param or tag is
# dropped instead of blocking everything behind it. Anything else (connection refused, 5xx, a
# proxy's bare 400, 401/403 from an expired token or a Host check, timeouts) is an outage: keep
# the points and retry.
_PERMANENT_ERROR_CODES = frozenset({"INVALID_PARAMETER_VALUE"})

#: MLflow's HTTP settings for our clients, unless the user set them: we retry ourselves from the spool, and
#: MLflow's own retry loop (7 tries with backoff by default) would hold a delivery, or a finish, for minutes.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

Point = tuple[str, float, int, int]  # key, value, step, timestamp in ms


def http_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process that talks to MLflow: ``base`` (default ``os.environ``) plus
    :data:`HTTP_DEFAULTS` where unset. MLflow reads these settings from the environment at each request and has
    no per-client argument for them, so the delivery process gets them in its own environment."""
    env = dict(os.environ if base is None else base)
    for key, value in HTTP_DEFAULTS.items():
        env.setdefault(key, value)
    return env


@contextlib.contextmanager
def http_settings() -> Iterator[None]:
    """Apply :data:`HTTP_DEFAULTS` (where unset) for the duration of a block, then restore the environment.

    For the short MLflow conversations of a command (``tracking sync``) or of the end of a training (the model
    registration), which run in the caller's process.
    """
    added = [k for k in HTTP_DEFAULTS if k not in os.environ]
    for key in added:
        os.environ[key] = HTTP_DEFAULTS[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def is_permanent(exc: BaseException) -> bool:
    """Tell whether MLflow refused a request for good (bad key, value, or a deleted run)."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.error_code in _PERMANENT_ERROR_CODES


def _to_int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


class RunSession:
    """One connection to the tracking store for one run.

    Holds the :class:`mlflow.MlflowClient`, the run id and ``marks``, the highest step the
    server stores for each metric key, which every delivery is filtered against: MLflow stores a repeated step
    as a second point and cannot delete points, so this filter is what makes a delivery exactly-once.

    Raises:
        BrokenStoreError: the SQLite store of ``uri`` exists but cannot be opened.
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
        self._refusal = ""  # MLflow's reason for the last refused batch
        self._run_experiment: str | None = None  # the run's experiment id, for rollout traces

    @property
    def rid(self) -> str:
        """The run id, once open_run() has succeeded."""
        if self.run_id is None:
            raise RuntimeError("no MLflow run is open")
        return self.run_id

    # -- run ---------------------------------------------------------------------------------

    def open_run(self, cfg: Mapping[str, Any], run_id: str | None, state_dir: Path, *, resume: bool,
                 update: bool) -> bool:
        """Attach to ``run_id`` or create the run; fetch the marks. Returns True if created.

        Args:
            cfg: the contents of ``tracking.json`` (experiment, run_name, artifact_location, params, tags).
            run_id: the run recorded in ``state_dir/run_id``, or None.
            state_dir: where a created run's id is written (atomically, before anything else can fail).
            resume: a new process takes the run over (status RUNNING, attach count + 1).
            update: log the configured tags and the params the run lacks.

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
            logger.warning("tracking: run %s recorded in %s does not exist (or is deleted) on %s; starting a new "
                           "run", run_id, state_dir, redact_uri(self.uri))
        experiment_id = self._experiment_id(str(cfg["experiment"]), cfg.get("artifact_location"))
        run = self.client.create_run(experiment_id, run_name=str(cfg["run_name"]), tags={ATTACH_COUNT_TAG: "0"})
        self.run_id = run.info.run_id
        # Written before anything else can fail, so that a retry or the next process reattaches
        # to this run instead of creating a second one.
        write_atomic(state_dir / RUN_ID_FILE, self.run_id + "\n")
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
            if self._send_points(chunk) is None:
                # One refused key must not block the others: send key by key, drop the refused ones.
                by_key: dict[str, list[Point]] = {}
                for point in chunk:
                    by_key.setdefault(point[0], []).append(point)
                for key, points in by_key.items():
                    sent = self._send_points(points) if len(by_key) > 1 else None
                    if sent is None:
                        self.rejected.add(key)
                        logger.warning("tracking: the server refused metric %r, dropping its points: %s", key,
                                       self._refusal)
                        continue
                    stored += sent
                continue
            stored += len(chunk)
        self.delivered += stored
        return stored

    def _send_points(self, points: Sequence[Point]) -> int | None:
        """log_batch ``points`` and raise their marks; None when MLflow refused them for good (a bad key; the
        reason is kept in ``_refusal``). Raises on a transient failure."""
        from mlflow.entities import Metric

        try:
            self.client.log_batch(self.rid, metrics=[Metric(k, v, ts, step) for k, v, step, ts in points],
                                  synchronous=True)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            self._refusal = scrub(exc, self.uri)
            return None
        self._mark(points)
        return len(points)

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

    def run_params(self) -> dict[str, str]:
        """The params the run holds now (read from the store)."""
        return dict(self.client.get_run(self.rid).data.params)

    def log_artifact(self, file: str, artifact_path: str) -> None:
        """Upload a staged file (:func:`.spool.stage_artifact`) into the run's ``artifact_path`` folder, then
        remove the copy. A file already gone was uploaded before a kill: nothing to do (uploading the same
        path twice would only overwrite it)."""
        path = Path(file)
        if not path.is_file():
            return
        self.client.log_artifact(self.rid, str(path), artifact_path or None)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()

    def log_rollout(self, rollout: Mapping[str, Any]) -> None:
        """Create the trace of one RL rollout, linked to this run, unless it exists already
        (:func:`gwenlake_hpc.stores.tracking.rollouts.deliver_rollout`)."""
        from ..rollouts import deliver_rollout

        if self._run_experiment is None:
            self._run_experiment = self.client.get_run(self.rid).info.experiment_id
        deliver_rollout(self.client, self.uri, self._run_experiment, self.rid, rollout)

    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (values cut to MLflow's 8000-character limit)."""
        from mlflow.entities import RunTag

        todo = [RunTag(k, str(v)[:MAX_TAG_VALUE_LENGTH]) for k, v in tags.items()]
        self._log_entities("tag", todo, lambda items: {"tags": items})

    def rename_tags(self, renames: Mapping[str, str]) -> None:
        """Give each new tag name the value of the old one, then delete the old tag; a tag the run does not hold
        is left alone, so a delivery repeated after a kill changes nothing more."""
        held = self.client.get_run(self.rid).data.tags
        moved = {new: held[old] for old, new in renames.items() if old in held}
        if moved:
            self.log_tags(moved)
        for old in renames:
            if old in held:
                self.client.delete_tag(self.rid, old)

    def log_inputs(self, inputs: Sequence[Mapping[str, Any]]) -> None:
        """Record dataset inputs of the run (see :meth:`gwenlake_hpc.stores.tracking.tracker.Tracker.log_inputs`);
        MLflow keeps one input per dataset name and digest, so a repeated delivery adds nothing. Inputs the server
        refuses are dropped with a warning."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        datasets = [DatasetInput(Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"],
                                         source=d["source"], schema=d.get("schema"), profile=d.get("profile")),
                                 tags=[InputTag(str(k), str(v)) for k, v in (i.get("tags") or {}).items()])
                    for i in inputs for d in (i["dataset"],)]
        try:
            self.client.log_inputs(self.rid, datasets=datasets)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            logger.warning("tracking: the server refused dataset input(s) %s, dropping them: %s",
                           ", ".join(repr(d.dataset.name) for d in datasets), scrub(exc, self.uri))

    def _log_entities(self, what: str, items: list[Any], kwargs: Callable[[list[Any]], dict[str, Any]]) -> None:
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = items[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            try:
                self.client.log_batch(self.rid, synchronous=True, **kwargs(chunk))
                continue
            except Exception as exc:
                if not is_permanent(exc):
                    raise
            for item in chunk:  # find and drop the refused ones
                try:
                    self.client.log_batch(self.rid, synchronous=True, **kwargs([item]))
                except Exception as exc:
                    if not is_permanent(exc):
                        raise
                    logger.warning("tracking: the server refused %s %r, dropping it: %s", what, item.key,
                                   scrub(exc, self.uri))

    def terminate(self, status: str, end_time: int | None) -> None:
        """Mark the run ``status`` (FINISHED, KILLED or FAILED) with ``end_time`` in ms since the epoch."""
        self.client.set_terminated(self.rid, status, end_time=end_time)
