"""Loading a version: its files exported once to disk, its metrics and lineage, its ``predict`` and input schema."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ...base.errors import ConfigError, GwenlakeError
from ..versioning import export_version, git_dir, model_repo
from .aliases import resolve_version

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["LoadedModel", "load_model", "check_batch", "serving_info"]


@dataclass
class LoadedModel:
    """One version of a model, exported to disk.

    Attributes:
        name: ``group.name``.
        version: the commit SHA (40 hex).
        path: directory with the version's files (LFS content resolved); not in any work tree.
        metrics: ``metrics.json`` of the version (``{name: float}``; {} if absent).
        lineage: ``lineage.json`` of the version ({} if absent): datasets and revisions, code commit,
            config, tracking run, starts, packages, and ``serving`` (predict entry point, input schema).
    """

    name: str
    version: str
    path: Path
    metrics: dict[str, float] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    code_root: str | None = None  # the model repository's work tree, a fallback place to import predict from

    @property
    def serving(self) -> dict[str, Any]:
        """``{"predict": "module:function", "input_schema": {column: {"dtype", "shape"}}, "dataset"}``."""
        return self.lineage.get("serving") or {}

    @property
    def input_schema(self) -> dict[str, dict[str, Any]]:
        """Input columns the version's predict takes: ``{column: {"dtype": "<f4", "shape": [40]}}``
        (shape after the batch dimension; dtype as numpy's ``dtype.str``, or ``"str"``)."""
        return self.serving.get("input_schema") or {}

    def predict_fn(self) -> Callable[..., Any]:
        """The version's predict function, imported from the current Python path, else from the code
        repository recorded in the lineage or the model repository's work tree (appended to ``sys.path``).
        The code imported is today's, not necessarily the version's (check ``lineage["code"]["commit"]``).

        Raises:
            ConfigError: the version declares no predict entry point, or it cannot be imported.
        """
        target = self.serving.get("predict")
        if not target:
            raise ConfigError(f"version {self.version[:12]} of {self.name} declares no predict entry point; "
                              "declare one on the training's Output: Output(name, predict='module:function')")
        mod_name, _, qual = target.partition(":")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            try:
                obj: Any = importlib.import_module(mod_name)
            except ModuleNotFoundError as exc:
                # Not importable from here: try the code repository that trained the version, then the model
                # repository's work tree (a project whose code and models share one repository).
                roots = [(self.lineage.get("code") or {}).get("repo"), self.code_root]
                roots = [str(r) for r in roots if r and Path(r).is_dir() and str(r) not in sys.path]
                if not roots or not (exc.name and mod_name.startswith(exc.name)):
                    raise
                sys.path[len(sys.path):] = roots
                obj = importlib.import_module(mod_name)
            for part in qual.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"predict entry point {target} of {self.name} version {self.version[:12]} cannot "
                              f"be imported ({exc}); run from the project directory") from exc
        return obj

    def predict(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """Scores for a batch: ``batch`` maps each input column to an array ``[n, *shape]``; returns ``[n]``
        (float64).

        Raises:
            ConfigError: a column of the input schema is missing, or has another dtype or shape.
        """
        check_batch(self.input_schema, batch, f"{self.name} version {self.version[:12]}")
        cols = {c: batch[c] for c in self.input_schema} if self.input_schema else dict(batch)
        scores = np.asarray(self.predict_fn()(self.path, cols), dtype=np.float64)
        n = len(next(iter(cols.values()))) if cols else 0
        if scores.shape != (n,):
            raise GwenlakeError(f"predict of {self.name} version {self.version[:12]} returned shape "
                                f"{scores.shape} for {n} rows; it must return one score per row, shape [{n}]")
        return scores


def check_batch(schema: Mapping[str, Mapping[str, Any]], batch: Mapping[str, np.ndarray], what: str) -> None:
    """Check that ``batch`` has every column of ``schema`` with its dtype and per-row shape.

    Raises:
        ConfigError: naming the column and what was expected.
    """
    for col, spec in schema.items():
        if col not in batch:
            raise ConfigError(f"{what} needs input column {col!r} ({spec['dtype']} {spec['shape']}); the batch "
                              f"has {sorted(batch)}")
        arr = np.asarray(batch[col])
        dtype = "str" if arr.dtype.kind in "OUS" else arr.dtype.str
        if dtype != spec["dtype"] or list(arr.shape[1:]) != list(spec["shape"]):
            raise ConfigError(f"{what}: input column {col!r} is {dtype} {list(arr.shape[1:])}, expected "
                              f"{spec['dtype']} {spec['shape']}")


def serving_info(tf: Any, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a version records about how to use it (``lineage.json`` key ``serving``).

    ``{"predict": "module:function" or None, "dataset": "name@revision", "input_schema": {column: {"dtype",
    "shape"}}}``: the input columns are the Output's ``inputs`` (default every column) of the first Input
    binding holding them all (the training set, in declaration order); dtype is numpy's ``dtype.str`` (e.g.
    ``"<f4"``) or ``"str"``, shape the per-row shape. None when the training has no Input.

    Never raises (it runs after the training): columns no Input has give a warning and None.
    """
    out = tf.output
    wanted = getattr(out, "inputs", None)
    for name, b in tf.bindings.items():
        ds = inputs.get(name)
        if ds is None or not hasattr(ds, "schema"):
            continue
        cols = list(wanted) if wanted is not None else list(ds.columns)
        if all(c in ds.schema for c in cols):
            return {"predict": getattr(out, "predict", None), "dataset": f"{ds.name}@{ds.revision}",
                    "input_schema": {c: {"dtype": ds.schema[c][0], "shape": list(ds.schema[c][1])} for c in cols}}
    if wanted is not None:  # after the training: warn rather than lose the model over a declaration
        log.warning("Output(%r, inputs=%s): no Input dataset has all these columns; the version records no input "
                    "schema, and the release gate will refuse it", out.name, wanted)
    return None


def _export_dir(repo: Any, model_name: str, sha: str) -> Path:
    """Cache of exported versions inside the git dir (versions never change, so the SHA is the key)."""
    return Path(git_dir(repo)) / "gwenlake" / "exports" / model_name / sha


def load_model(name: str, version: str | None = None, *, alias: str | None = None, repo: Any = None) -> LoadedModel:
    """Load a version of model ``name``: by commit SHA, by ``alias``, or (neither) the newest.

    The files are exported once per version into ``<git dir>/gwenlake/exports/<name>/<sha>/`` (LFS content
    resolved; the work tree, index and HEAD are never touched) and reused afterwards. The version resolved is
    logged.

    Args:
        name: ``group.name``.
        version: commit SHA (full or abbreviated) or ``"latest"``.
        alias: e.g. ``"champion"``; from the alias log of the model repository.
        repo: the model repository (path or git.Repo); default: as ``paths.model_repo`` defaults.

    Raises:
        ConfigError: unknown model, version or alias.
    """
    g_repo = model_repo(repo)
    sha = resolve_version(name, version, alias, g_repo)
    dest = _export_dir(g_repo, name, sha)
    if not dest.is_dir():
        try:
            export_version(g_repo, name, sha, dest)
        except (ConfigError, OSError):
            if not dest.is_dir():  # another process exported it in between: use theirs
                raise
    def _json(rel: str) -> dict:
        f = dest / rel
        return json.loads(f.read_text()) if f.is_file() else {}

    return LoadedModel(name, sha, dest, _json("metrics.json"), _json("lineage.json"), g_repo.working_tree_dir)
