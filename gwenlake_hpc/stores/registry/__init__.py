"""Aliases, loading versions, and the MLflow Model Registry.

A model's version is a git commit (:mod:`gwenlake_hpc.stores.versioning`). This package adds:

* **Aliases** (``champion``, ``candidate``...) that name one version of a model (:mod:`.aliases`). Their truth is
  an append-only log in the model repository, on the ref ``refs/gwenlake/aliases/<group>.<name>``: each move of
  an alias is one commit whose tree holds ``history.jsonl`` (every move so far: alias, version, previous
  version, who, when, action, reason) and ``aliases.json`` (where each alias points now). The ref moves by
  compare-and-swap (``git update-ref <ref> <new> <old>``), as model branches do, so concurrent moves never
  lose one. Why git rather than MLflow registered-model tags: MLflow keeps no alias history, tags are
  last-writer-wins without compare-and-swap, and a training without a tracking server (``tracking=False``,
  or a server outage) must still be able to name and roll back versions; the log also travels with the
  versions when they are pushed (:func:`gwenlake_hpc.stores.versioning.push_versions`). When a tracking URI is
  known, every move is mirrored onto the registered model's MLflow alias, so MLflow users see the same
  thing; git stays the reference (a difference is logged as a warning when resolving).
* :func:`load_model` (:mod:`.load`): any version (SHA, alias or latest) as files on disk plus its metrics,
  lineage and ``predict``.
* :func:`register_version` (:mod:`.mlflow_registry`): a version as an MLflow *model version* of the *registered
  model* of the same name, whose source is the version's folder of the tracking run's artifacts
  (``runs:/<run_id>/model/<version>``), tagged
  with the git commit and dataset revisions; registrations MLflow could not take yet wait in
  :mod:`.pending`.
* :func:`after_commit` (:mod:`.training`): what a finished training does with its version.
* :func:`list_models`, :func:`save_model` (:mod:`.models`): versions handled by hand.

Modules import versioning and each other in the order aliases <- mlflow_registry, load <- aliases,
pending <- load, training <- pending; none imports the release gate (:mod:`gwenlake_hpc.release.gate` imports this
package) or the command line (the ``models`` sub-commands are :mod:`gwenlake_hpc.cli.models`).
"""

from __future__ import annotations

from ...base.names import check_alias
from .aliases import (CANDIDATE, CHAMPION, alias_history, current_aliases, move_alias, resolve_alias,
                      resolve_version, rollback_target)
from .load import LoadedModel, check_batch, load_model, serving_info
from .mlflow_registry import mlflow_set_alias, register_version, version_tags
from .models import list_models, save_model
from .pending import PENDING_REGISTRATIONS, complete_pending_registrations, warn_if_pending
from .training import after_commit

__all__ = ["LoadedModel", "load_model", "resolve_version", "resolve_alias", "move_alias", "alias_history",
           "current_aliases", "rollback_target", "serving_info", "check_batch", "register_version", "mlflow_set_alias",
           "after_commit", "check_alias", "version_tags", "list_models", "save_model", "PENDING_REGISTRATIONS",
           "complete_pending_registrations", "warn_if_pending", "CANDIDATE", "CHAMPION"]
