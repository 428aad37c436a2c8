"""What a finished training does with its new version: push, register, point ``candidate`` at it."""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ..versioning import Plumbing, model_repo, push_versions, read_file
from .aliases import CANDIDATE, move_alias
from .mlflow_registry import mlflow_set_alias, register_version, version_tags
from .pending import add_pending

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["after_commit"]


def after_commit(*, repo: Any, model_name: str, version: str, out_dir: Path, lineage: Mapping[str, Any],
                 tracking_uri: str | None, run_id: str | None, metrics: Mapping[str, float] | None = None,
                 state_dir: Path | None = None, defer: bool = False) -> bool:
    """What a finished training does after its commit; each step only warns when it fails.

    1. Push the model's versions to ``git config gwenlake.remote`` of the model repository, when set.
    2. Register the version in the MLflow Model Registry (when tracking is on and the run exists). When it
       cannot be (no MLflow run attached yet, MLflow unreachable), the version goes on the to-do list
       ``<state_dir>/pending_registrations.json`` with a warning naming the command that completes it
       (``tracking sync RUN_DIR``, which :func:`complete_pending_registrations`). With ``defer`` (and a
       ``state_dir``), it goes on that list without a try here: the training's delivery process, which has
       MLflow loaded already, completes it as the run finishes (:func:`warn_if_pending` says if it did not).
    3. Point the alias ``candidate`` at it (git alias log, mirrored in MLflow), unless one of its ``metrics``
       is NaN or infinite. Only ``models promote`` sets ``champion``.
    Never raises: the commit is what matters, and the files stay in ``out_dir`` whatever happens here.
    Returns True when the registration was deferred (listed for the delivery process).
    """
    if defer and tracking_uri and state_dir is not None:
        try:
            add_pending(state_dir, {"model": model_name, "version": version, "repo": str(model_repo(repo).working_dir)})
        except OSError as exc:
            log.warning("could not record the pending registration in %s: %s", state_dir, exc)
            defer = False
    else:
        defer = False
    tags = version_tags(lineage)
    registered = False
    why = "no MLflow run is attached to the training yet"
    if tracking_uri and run_id and not defer:
        try:
            extra = {rel: read_file(repo, model_name, version, rel) for rel in ("metrics.json", "lineage.json")}
            register_version(tracking_uri, model_name, version, run_id, out_dir, tags, extra)
            registered = True
        except Exception as exc:  # noqa: BLE001 - a tracking outage never fails a training
            why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if tracking_uri and not registered and not defer:
        todo = f"`python -m gwenlake_hpc models register {model_name} {version}`"
        if state_dir is not None:
            try:
                add_pending(state_dir, {"model": model_name, "version": version,
                                         "repo": str(model_repo(repo).working_dir)})
                run_dir = state_dir.parent if state_dir.name.startswith("tracking") else state_dir
                todo = f"`python -m gwenlake_hpc tracking sync {run_dir}`"
            except OSError as exc:
                log.warning("could not record the pending registration in %s: %s", state_dir, exc)
        log.warning("%s version %s is committed but not registered in the MLflow Model Registry (%s); %s "
                    "registers it once MLflow answers", model_name, version[:12], why, todo)
    bad = {k: v for k, v in (metrics or {}).items() if not math.isfinite(float(v))}
    if bad:
        log.warning("%s version %s has non-finite metrics (%s): the alias %s is not moved to it", model_name,
                    version[:12], ", ".join(f"{k}={v}" for k, v in sorted(bad.items())), CANDIDATE)
    else:
        try:
            move_alias(model_name, CANDIDATE, version, repo=repo, action="train",
                       reason=f"trained by run {lineage.get('run_key')}")
            if registered:
                mlflow_set_alias(tracking_uri, model_name, CANDIDATE, version)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            log.warning("could not set alias %s of %s to %s: %s", CANDIDATE, model_name, version[:12], exc)
    try:
        with tempfile.TemporaryDirectory(prefix="gwenlake-alias-") as tmp:
            remote = Plumbing(model_repo(repo), Path(tmp)).config_get("gwenlake.remote")
    except Exception:  # no repository: nothing to push
        remote = None
    if remote:
        from ..tracking.uri import redact_uri

        try:
            push_versions(repo, model_name, remote)
            log.info("pushed %s versions to %s", model_name, redact_uri(remote))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not push %s to %s (%s); push later with `python -m gwenlake_hpc models push %s "
                        "%s`", model_name, redact_uri(remote), exc, model_name, redact_uri(remote))
    return defer
