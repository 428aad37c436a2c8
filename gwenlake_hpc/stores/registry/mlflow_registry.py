"""The MLflow Model Registry: a version as a *model version* of the *registered model* of the same name, aliases
mirrored onto it. git stays the reference (see :mod:`.aliases`); every call here may fail with a tracking
outage, and callers in a training only warn.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from ..versioning import model_branch

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["http_settings", "mlflow_client", "register_version", "mlflow_set_alias", "version_tags"]


def http_settings() -> Any:
    """A context in which MLflow's HTTP calls fail fast (see
    :func:`gwenlake_hpc.stores.tracking.delivery.session.http_settings`)."""
    # No MLflow retry loop (minutes with backoff): a tracking outage must not hold a training or a promote. Set
    # for the calls below only: MLflow reads them from the environment at each request.
    from ..tracking.delivery.session import http_settings as session_http_settings

    return session_http_settings()


def _with_http_settings(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with http_settings():
            return fn(*args, **kwargs)

    return wrapper


def mlflow_client(tracking_uri: str) -> Any:
    """An MlflowClient whose tracking and registry URI are ``tracking_uri`` (a new SQLite store made whole first)."""
    from mlflow import MlflowClient

    from ..tracking import ensure_sqlite_store

    ensure_sqlite_store(tracking_uri)  # a new SQLite store is made whole before MLflow opens it
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _model_version_of(client: Any, model_name: str, sha: str) -> Any | None:
    for mv in client.search_model_versions(f"name='{model_name}'"):
        if (mv.tags or {}).get("gwenlake.version") == sha:
            return mv
    return None


@_with_http_settings
def register_version(tracking_uri: str, model_name: str, version: str, run_id: str, model_dir: str | Path,
                     tags: Mapping[str, str] | None = None, extra_files: Mapping[str, bytes] | None = None) -> str:
    """Register ``version`` as a model version of the MLflow registered model ``model_name``.

    The files of ``model_dir`` are logged as artifacts of the tracking run ``run_id`` under
    ``model/<version>/`` (one folder a version: a run extended later registers another version without
    touching this one's files), and the model version's source is ``runs:/<run_id>/model/<version>`` (a
    tracking server refuses local paths as
    sources); ``extra_files`` (name -> bytes, e.g. metrics.json and lineage.json) join them there. Tags: ``gwenlake.version`` (the commit SHA) plus ``tags`` (code commit, dataset revisions).
    Idempotent: a version already registered is returned as is. Returns the model version number (str).

    Raises:
        mlflow.exceptions.MlflowException and OSError from the client (callers in a training only warn).
    """
    from mlflow.exceptions import MlflowException

    client = mlflow_client(tracking_uri)
    existing = None
    try:
        client.get_registered_model(model_name)
        existing = _model_version_of(client, model_name, version)
    except MlflowException:
        with contextlib.suppress(MlflowException):  # a concurrent job may create it first
            client.create_registered_model(model_name, description=f"gwenlake_hpc model {model_name}: "
                                           f"versions are commits of branch {model_branch(model_name)}")
    if existing is not None:
        return str(existing.version)
    artifact_path = f"model/{version}"
    client.log_artifacts(run_id, str(model_dir), artifact_path)
    if extra_files:
        with tempfile.TemporaryDirectory(prefix="gwenlake-register-") as tmp:
            for rel, data in extra_files.items():
                (Path(tmp) / rel).write_bytes(data)
            client.log_artifacts(run_id, tmp, artifact_path)
    mv = client.create_model_version(model_name, f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                     tags={"gwenlake.version": version, **dict(tags or {})},
                                     description=f"git commit {version}")
    log.info("registered %s version %s as MLflow model version %s", model_name, version[:12], mv.version)
    return str(mv.version)


@_with_http_settings
def mlflow_set_alias(tracking_uri: str, model_name: str, alias: str, version: str) -> str | None:
    """Mirror an alias move onto the MLflow registered model; returns the model version number, or None (with a
    warning) when ``version`` was never registered (e.g. trained without tracking)."""
    from ..tracking.uri import redact_uri

    client = mlflow_client(tracking_uri)
    mv = _model_version_of(client, model_name, version)
    if mv is None:
        log.warning("%s version %s is not registered in MLflow (%s); the alias %s is set in git only",
                    model_name, version[:12], redact_uri(tracking_uri), alias)
        return None
    client.set_registered_model_alias(model_name, alias, mv.version)
    return str(mv.version)


def version_tags(lineage: Mapping[str, Any]) -> dict[str, str]:
    """The MLflow model version's tags from a version's lineage.json: ``gwenlake.code_commit`` (when the code
    was committed) and ``gwenlake.dataset.<binding>`` = ``name@revision`` for each input dataset."""
    tags = {}
    code = (lineage.get("code") or {}).get("commit")
    if code:
        tags["gwenlake.code_commit"] = str(code)
    for n, d in (lineage.get("datasets") or {}).items():
        tags[f"gwenlake.dataset.{n}"] = f"{d.get('name')}@{d.get('revision')}"
    return tags
