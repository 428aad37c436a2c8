"""Versions as a user handles them by hand: listed with their metrics and aliases, committed from a folder."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ...base.errors import ConfigError
from ...base.names import check_name
from ..versioning import commit_model, default_model_repo, list_versions, model_repo, open_model_repo, read_file
from .aliases import current_aliases

__all__ = ["list_models", "save_model"]


def list_models(model_name: str, repo: Any = None) -> list[dict]:
    """Versions of ``model_name`` newest first, each ``{"version", "date", "message", "metrics", "run_id",
    "datasets" ({binding: "name@revision"}), "aliases" (list)}``; read from git only (one read per file)."""
    g_repo = model_repo(repo)
    aliases: dict[str, list[str]] = {}
    for alias, sha in current_aliases(model_name, g_repo).items():
        aliases.setdefault(sha, []).append(alias)
    out = []
    for v in list_versions(g_repo, model_name):
        def _json(rel: str) -> dict:
            try:
                return json.loads(read_file(g_repo, model_name, v["version"], rel))
            except (ConfigError, ValueError):
                return {}
        lineage = _json("lineage.json")
        out.append({**v, "metrics": _json("metrics.json"),
                    "run_id": (lineage.get("tracking") or {}).get("run_id"),
                    "datasets": {n: f"{d.get('name')}@{str(d.get('revision'))[:12]}"
                                 for n, d in (lineage.get("datasets") or {}).items()},
                    "aliases": sorted(aliases.get(v["version"], []))})
    return out


def save_model(directory: str | os.PathLike[str], name: str, *, message: str | None = None,
               metrics: Mapping[str, float] | None = None, repo: Any = None) -> str:
    """Commit the files of ``directory`` as a new version of model ``name`` (work done by hand, or the
    ``run_dir=`` of a local run); returns the version (commit SHA). Same as ``models commit DIR NAME``.

    Args:
        directory: the model's files (every regular file under it, recursively).
        name: ``group.name``.
        message: the commit message (default: "committed by hand from DIR").
        metrics: numbers stored as the version's ``metrics.json`` (the release gate compares them).
        repo: the model repository (default: the git repository around the working directory, else
            ``./models``, created).

    No alias moves: promote it with ``models promote`` (through the release gate).

    Raises:
        ConfigError: a bad name, a directory that is missing or empty, a non-finite metric.
    """
    check_name(name, "model")
    src = Path(directory)
    if not src.is_dir() or not any(p.is_file() for p in src.rglob("*")):
        raise ConfigError(f"save_model: {src} is not a folder holding the model's files")
    extra = {}
    if metrics:
        values = {str(k): float(v) for k, v in metrics.items()}
        bad = sorted(k for k, v in values.items() if not math.isfinite(v))
        if bad:
            raise ConfigError(f"save_model: metrics {', '.join(bad)} are not finite numbers")
        extra["metrics.json"] = (json.dumps(values, indent=2, sort_keys=True) + "\n").encode()
    g_repo = repo if repo is not None and not isinstance(repo, (str, os.PathLike)) else \
        open_model_repo(Path(repo) if repo is not None else default_model_repo(Path.cwd()), create=True)
    return commit_model(g_repo, name, src, message=message or f"{name}: committed by hand from {src}",
                        extra_files=extra or None)
