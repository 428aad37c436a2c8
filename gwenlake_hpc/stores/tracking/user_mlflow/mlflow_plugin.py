"""MLflow plug-ins of the ``gwenlake-job:`` schemes: the job's run as seen by MLflow's fluent API inside a training
function (see :mod:`.fluent`, which sets the URI, and :mod:`.sink`, where the calls go). Loaded by MLflow
through the entry points ``mlflow.tracking_store`` and ``mlflow.artifact_repository`` declared in
``pyproject.toml``, so only a process whose code calls MLflow imports it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mlflow.store.artifact.artifact_repo import ArtifactRepository
from mlflow.store.tracking.abstract_store import AbstractStore

from .sink import ARTIFACT_SCHEME, PENDING_RUN_ID, SCHEME, sink, warn_once


def _state_dir_of(uri: str, scheme: str) -> str:
    return uri[len(scheme) + 1:] if uri.startswith(f"{scheme}:") else ""


def _refuse(what: str) -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException(
        f"{what} is not available inside a gwenlake_hpc training function: MLflow calls there report into the "
        "job's own run. Use mlflow.MlflowClient(tracking_uri=...) with the job's tracking URI to read runs, "
        "and start no other run.", error_code="INVALID_PARAMETER_VALUE")


class JobStore(AbstractStore):
    """MLflow tracking store of the ``gwenlake-job:`` scheme: the job's one run, written through the spool.

    Built by MLflow as ``JobStore(store_uri=..., artifact_uri=...)``; ``store_uri`` is
    ``gwenlake-job:<state folder>`` (empty with tracking off).
    """

    def __init__(self, store_uri: str | None = None, artifact_uri: str | None = None) -> None:
        super().__init__()
        self.state_dir = _state_dir_of(store_uri or "", SCHEME)
        self.sink = sink(self.state_dir)

    # -- the run ----------------------------------------------------------------------------------
    def _check(self, run_id: str) -> None:
        if run_id not in (PENDING_RUN_ID, self.sink.run_id()):
            raise _refuse(f"run {run_id}")

    def _info(self) -> Any:
        from mlflow.entities import RunInfo

        return RunInfo(run_id=self.sink.run_id(), experiment_id="0", user_id="", status="RUNNING",
                       start_time=int(time.time() * 1000), end_time=None, lifecycle_stage="active",
                       artifact_uri=f"{ARTIFACT_SCHEME}:{self.state_dir}", run_name=None)

    def get_run(self, run_id: str) -> Any:
        """The job's run (status RUNNING, no data: read the server for that)."""
        from mlflow.entities import Run, RunData

        self._check(run_id)
        return Run(self._info(), RunData())

    def update_run_info(self, run_id: str, run_status: Any, end_time: Any, run_name: Any) -> Any:
        """Ignored: the job marks its run (KILLED when evicted, FINISHED at the end)."""
        self._check(run_id)
        return self._info()

    def log_batch(self, run_id: str, metrics: Any, params: Any, tags: Any) -> None:
        """Points, params and tags into the job's spool (see the module docstring)."""
        self._check(run_id)
        self.sink.log(list(metrics or []), list(params or []), list(tags or []))

    def log_inputs(self, run_id: str, datasets: Any = None, models: Any = None) -> None:
        """Dataset inputs (``mlflow.log_input``, autolog's training data) into the job's spool, delivered as the
        run's inputs; model inputs (logged models, which the job refuses) are left out."""
        self._check(run_id)
        self.sink.log_inputs([{"dataset": {"name": d.dataset.name, "digest": d.dataset.digest,
                                           "source_type": d.dataset.source_type, "source": d.dataset.source,
                                           "schema": d.dataset.schema, "profile": d.dataset.profile},
                               "tags": {t.key: t.value for t in (d.tags or [])}} for d in (datasets or [])])

    def delete_tag(self, run_id: str, key: str) -> None:
        """Ignored with one warning."""
        warn_once("delete_tag", "mlflow.delete_tag inside a gwenlake_hpc training is ignored")

    def get_experiment(self, experiment_id: str) -> Any:
        """The run's experiment, as far as this process knows it (id ``0``)."""
        from mlflow.entities import Experiment

        return Experiment(experiment_id, "gwenlake-job", f"{ARTIFACT_SCHEME}:{self.state_dir}", "active")

    def create_run(self, experiment_id: Any = None, user_id: Any = None, start_time: Any = None, tags: Any = None,
                   run_name: Any = None) -> Any:
        """The job's run again: a ``mlflow.start_run()`` after ``end_run``, or in a process started by the
        training (MLflow's fluent state does not cross a fork) continues the job's run. A nested run is refused.

        Raises:
            MlflowException: a nested run (``mlflow.start_run(nested=True)``).
        """
        from mlflow.entities import Run, RunData

        if any(getattr(t, "key", None) == "mlflow.parentRunId" for t in (tags or [])):
            raise _refuse("a nested run")
        return Run(self._info(), RunData())

    def create_logged_model(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the job's model is its Output, committed as a version (see the message, which names
        ``mlflow.<flavor>.autolog(log_models=False)`` when autolog logged the model)."""
        from mlflow.exceptions import MlflowException

        flavor, autolog = _caller_flavor()
        fix = ("save the model's files in the function's Output folder (output.file(...)); the job commits them as "
               "the model's version and registers it in MLflow's Model Registry")
        if autolog:
            # MLflow reports this inside "Encountered unexpected error during <flavor> autologging": name the fix
            raise MlflowException(
                f"autolog's model is not stored by a gwenlake_hpc training: call mlflow.{flavor}.autolog("
                "log_models=False) (a refused model also loses the metrics autolog logs after it) and "
                f"{fix}", error_code="INVALID_PARAMETER_VALUE")
        raise MlflowException(
            f"MLflow logged models (mlflow.{flavor}.log_model) are not stored by a gwenlake_hpc training: {fix}",
            error_code="INVALID_PARAMETER_VALUE")

    def search_logged_models(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("searching logged models")

    def get_logged_model(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("reading a logged model")

    def get_metric_history(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("reading a metric's history")

    def _search_runs(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("searching runs")

    def search_experiments(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("searching experiments")

    def create_experiment(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("creating an experiment")

    def delete_experiment(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("deleting an experiment")

    def restore_experiment(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("restoring an experiment")

    def rename_experiment(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("renaming an experiment")

    def delete_run(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("deleting a run")

    def restore_run(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("restoring a run")

    def link_traces_to_run(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("linking traces")


#: MLflow's own packages: a frame in any other ``mlflow.<name>`` module is a flavor's (``mlflow.sklearn``).
_NOT_FLAVORS = frozenset({"tracking", "store", "models", "utils", "entities", "artifacts", "data", "exceptions",
                          "environment_variables", "protos", "telemetry", "tracing"})


def _caller_flavor() -> tuple[str, bool]:
    """The MLflow flavor whose code is logging a model (``"<flavor>"`` when none is found) and whether autolog
    is doing it, from the calling frames (MLflow does not hand the flavor to the store)."""
    flavor, autolog = "<flavor>", False
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        parts = module.split(".")
        if module.startswith("mlflow.utils.autologging_utils"):
            autolog = True
        elif flavor == "<flavor>" and len(parts) > 1 and parts[0] == "mlflow" and parts[1] not in _NOT_FLAVORS \
                and not parts[1].startswith("_"):
            flavor = ".".join(parts[1:3]) if parts[1] == "pyspark" else parts[1]  # mlflow.pyspark.ml.autolog
        frame = frame.f_back
    return flavor, autolog


class JobArtifactRepository(ArtifactRepository):
    """MLflow artifact repository of the ``gwenlake-job-artifacts:`` scheme: files staged in the job's state
    folder, uploaded to the run by the delivery process (:meth:`Tracker.log_artifact`)."""

    def __init__(self, artifact_uri: str, tracking_uri: str | None = None, registry_uri: str | None = None) -> None:
        super().__init__(artifact_uri, tracking_uri, registry_uri)
        self.sink = sink(_state_dir_of(artifact_uri, ARTIFACT_SCHEME))

    def log_artifact(self, local_file: str, artifact_path: str | None = None) -> None:
        """Stage ``local_file`` for upload into ``artifact_path``."""
        self.sink.log_artifact(local_file, artifact_path)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Stage every file under ``local_dir``, keeping its folders under ``artifact_path``."""
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.parent.relative_to(root).as_posix()
            parts = [x for x in (artifact_path, "" if rel == "." else rel) if x]
            self.sink.log_artifact(str(path), "/".join(parts) or None)

    def list_artifacts(self, path: str | None = None) -> list[Any]:
        """Nothing: staged files are not listed (read the run's artifacts from the server)."""
        return []

    def _download_file(self, remote_file_path: str, local_path: str) -> None:
        raise _refuse("downloading an artifact")
