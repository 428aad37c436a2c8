"""Aliases, loading versions, and the MLflow Model Registry.

A model's version is a git commit (:mod:`gwenlake_hpc.versioning`). This module adds:

* **Aliases** (``champion``, ``candidate``...) that name one version of a model. Their truth is an
  append-only log in the model repository, on the ref ``refs/gwenlake/aliases/<group>.<name>``: each move of
  an alias is one commit whose tree holds ``history.jsonl`` (every move so far: alias, version, previous
  version, who, when, action, reason) and ``aliases.json`` (where each alias points now). The ref moves by
  compare-and-swap (``git update-ref <ref> <new> <old>``), as model branches do, so concurrent moves never
  lose one. Why git rather than MLflow registered-model tags: MLflow keeps no alias history, tags are
  last-writer-wins without compare-and-swap, and a training without a tracking server (``tracking=False``,
  or a server outage) must still be able to name and roll back versions; the log also travels with the
  versions when they are pushed (:func:`gwenlake_hpc.versioning.push_versions`). When a tracking URI is
  known, every move is mirrored onto the registered model's MLflow alias, so MLflow users see the same
  thing; git stays the reference (a difference is logged as a warning when resolving).
* :func:`load_model`: any version (SHA, alias or latest) as files on disk plus its metrics, lineage and
  ``predict``.
* :func:`register_version`: a version as an MLflow *model version* of the *registered model* of the same
  name, whose source is the tracking run's artifacts (``runs:/<run_id>/model``), tagged with the git commit
  and dataset revisions.
* :func:`models_command`: the ``python -m gwenlake_hpc models ...`` sub-commands.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import importlib
import json
import logging
import math
import os
import random
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .errors import ConfigError, GwenlakeError
from .versioning import (ALIAS_REF_PREFIX, MODEL_TRAILER, Plumbing, default_model_repo, export_version,
                         list_versions, model_branch, open_model_repo, read_file)
from .versioning import as_repo as _as_repo
from .versioning import git_dir as _git_dir
from .versioning import identity_env as _identity_env
from .versioning import read_blobs as _read_blobs
from .versioning import rev as _rev
from .versioning import rev_any as _rev_any
from .versioning import strip_trailers as _strip_trailers

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["LoadedModel", "load_model", "resolve_version", "resolve_alias", "move_alias", "alias_history",
           "current_aliases", "rollback_target", "serving_info", "check_batch", "register_version", "mlflow_set_alias", "after_commit",
           "models_command", "CANDIDATE", "CHAMPION"]

#: Alias a finished training gives its version automatically.
CANDIDATE = "candidate"
#: Alias only ``models promote`` (through the release gate) sets.
CHAMPION = "champion"
_ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_HEX = re.compile(r"^[0-9a-fA-F]{4,64}$")
_ZERO = "0" * 40


def check_alias(alias: str) -> str:
    """``alias`` when it is a valid alias name; ConfigError naming the accepted form otherwise."""
    if not isinstance(alias, str) or not _ALIAS_RE.match(alias):
        raise ConfigError(f"alias {alias!r}: use a name such as 'champion' (letters, digits, '_' and '-', "
                          "starting with a letter)")
    return alias


def _repo(repo: Any) -> Any:
    """A git.Repo from a Repo, a path, or None (the default model repository around the cwd)."""
    if repo is None:
        return open_model_repo(default_model_repo(Path.cwd()), create=False)
    return _as_repo(repo)


def _plumbing(repo: Any, tmp: Path) -> Plumbing:
    """git plumbing on the model repository (None: the default one around the working directory)."""
    return Plumbing(_repo(repo), tmp)


# --- aliases (git) ---------------------------------------------------------------------------------------------

def _alias_ref(model_name: str) -> str:
    model_branch(model_name)  # validates the name
    return ALIAS_REF_PREFIX + model_name


def _read_log(g: Plumbing, model_name: str) -> tuple[str | None, list[dict]]:
    ref = _alias_ref(model_name)
    tip = _rev_any(g.tmp, g.env, ref)
    if tip is None:
        return None, []
    blob = _read_blobs(g.tmp, g.env, [f"{tip}:history.jsonl"])[0] or b""
    return tip, [json.loads(line) for line in blob.decode().splitlines() if line.strip()]


def alias_history(model_name: str, repo: Any = None) -> list[dict]:
    """Every alias move of ``model_name``, oldest first.

    Each move is ``{"alias", "version" (40-hex SHA), "previous" (SHA or None), "who" (user@host), "when"
    (UTC ISO 8601), "action" ("train", "promote", "rollback", "set"), "reason" (str)}``, read from the ref
    ``refs/gwenlake/aliases/<model>`` of the model repository. [] when no alias was ever set.
    """
    with tempfile.TemporaryDirectory(prefix="gwenlake-alias-") as tmp:
        return _read_log(_plumbing(repo, Path(tmp)), model_name)[1]


def current_aliases(model_name: str, repo: Any = None) -> dict[str, str]:
    """Where each alias of ``model_name`` points now: ``{alias: version SHA}`` (from the alias log)."""
    out: dict[str, str] = {}
    for move in alias_history(model_name, repo):
        out[move["alias"]] = move["version"]
    return out


def _version_sha(g: Plumbing, model_name: str, version: str) -> str:
    """Full SHA of ``version`` (hex, possibly short), checked to be a version of ``model_name``."""
    if not isinstance(version, str) or not _HEX.match(version):
        raise ConfigError(f"version {version!r} of {model_name}: give a commit SHA (hexadecimal), as "
                          f"`python -m gwenlake_hpc models list {model_name}` prints")
    sha = _rev(g.tmp, g.env, version)
    if sha is None:
        raise ConfigError(f"version {version} of {model_name} is not a commit of the model repository "
                          f"{g.repo.working_dir}; see `python -m gwenlake_hpc models list {model_name}`")
    _, out, _ = g.run("cat_file", "commit", sha)
    body = out.decode("utf-8", "replace").split("\n\n", 1)[-1]
    if _strip_trailers(body)[1].get(MODEL_TRAILER) != model_name:
        raise ConfigError(f"commit {sha[:12]} is not a version of {model_name} (no '{MODEL_TRAILER}: "
                          f"{model_name}' trailer); see `python -m gwenlake_hpc models list {model_name}`")
    return sha


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


_ANY = object()


def move_alias(model_name: str, alias: str, version: str, *, repo: Any = None, action: str = "set",
               reason: str = "", max_attempts: int = 50, expected: Any = _ANY) -> dict:
    """Point ``alias`` of ``model_name`` at ``version`` and append the move to the alias log.

    The log is a commit on ``refs/gwenlake/aliases/<model>`` (see the module docstring) moved by
    compare-and-swap; a lost race re-reads the new tip and retries. The MLflow alias is not touched here (see
    :func:`mlflow_set_alias`). Returns the move recorded (see :func:`alias_history`).

    ``expected`` (a version SHA, or None for "unset") makes the move conditional on the alias still pointing
    there when the log is swapped: a promote gated against one incumbent never lands on top of another.

    Raises:
        ConfigError: bad model name or alias, ``version`` not a version of the model.
        GwenlakeError: git failed, the ref kept moving for ``max_attempts`` tries, or the alias no longer
            points at ``expected`` (someone moved it meanwhile: run the command again).
    """
    check_alias(alias)
    with tempfile.TemporaryDirectory(prefix="gwenlake-alias-") as tmpdir:
        tmp = Path(tmpdir)
        g = _plumbing(repo, tmp)
        sha = _version_sha(g, model_name, version)
        env = dict(g.env, **_identity_env(tmp, g.env))
        ref = _alias_ref(model_name)
        for attempt in range(1, max_attempts + 1):
            tip, history = _read_log(g, model_name)
            now = {m["alias"]: m["version"] for m in history}
            if expected is not _ANY and now.get(alias) != expected:
                raise GwenlakeError(f"alias {alias} of {model_name} moved to {now.get(alias) or 'unset'} while this "
                                    f"command checked it against {expected or 'unset'}; nothing changed: run it again")
            move = {"alias": alias, "version": sha, "previous": now.get(alias), "who": _who(),
                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "action": action,
                    "reason": reason or ""}
            now[alias] = sha
            (tmp / "history.jsonl").write_bytes(b"".join(
                (json.dumps(m, sort_keys=True) + "\n").encode() for m in [*history, move]))
            (tmp / "aliases.json").write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
            _, out, _ = g.run("hash_object", "-w", "--no-filters", "--", str(tmp / "aliases.json"),
                              str(tmp / "history.jsonl"))
            a_sha, h_sha = out.decode().split()
            _, out, _ = g.run("mktree", stdin=f"100644 blob {a_sha}\taliases.json\n"
                                              f"100644 blob {h_sha}\thistory.jsonl\n".encode())
            tree = out.decode().strip()
            msg = f"{model_name}: {alias} -> {sha[:12]} ({action})\n\n{reason}\n" if reason else \
                f"{model_name}: {alias} -> {sha[:12]} ({action})\n"
            _, out, _ = g.run("commit_tree", tree, *(["-p", tip] if tip else []), "-m", msg, env=env)
            new = out.decode().strip()
            status, _, err = g.run("update_ref", "-m", f"gwenlake_hpc: alias {alias}", ref, new, tip or _ZERO,
                                   ok=(0, 1, 128), env=env)
            if status == 0:
                log.info("alias %s of %s -> %s (was %s; %s by %s)", alias, model_name, sha,
                         move["previous"] or "unset", action, move["who"])
                return move
            time.sleep(random.uniform(0.005, 0.03) * min(attempt, 10))
        raise GwenlakeError(f"could not move alias {alias} of {model_name}: {ref} kept moving for "
                            f"{max_attempts} attempts; last error: {err.strip()}")


def rollback_target(model_name: str, alias: str, repo: Any = None) -> tuple[str, str]:
    """``(current, previous)`` versions of ``alias`` for a rollback, from the alias log.

    The log is replayed as a stack: a promote/set/train move pushes its version, a rollback pops; so two
    rollbacks in a row go two versions back rather than flipping between two.

    Raises:
        ConfigError: the alias has no version before the current one.
    """
    stack: list[str] = []
    for move in alias_history(model_name, repo):
        if move["alias"] != alias:
            continue
        if move["action"] == "rollback":
            if stack:
                stack.pop()
        elif not stack or stack[-1] != move["version"]:
            stack.append(move["version"])
    if len(stack) < 2:
        raise ConfigError(f"alias {alias} of {model_name} has no previous version to roll back to "
                          f"({'unset' if not stack else 'only ' + stack[0][:12]}); see "
                          f"`python -m gwenlake_hpc models list {model_name}`")
    return stack[-1], stack[-2]


def resolve_alias(model_name: str, alias: str, repo: Any = None, tracking_uri: str | None = None) -> str:
    """The version SHA ``alias`` of ``model_name`` points to now; logs it.

    Raises:
        ConfigError: the alias is not set (the message lists the aliases that are).
    """
    check_alias(alias)
    aliases = current_aliases(model_name, repo)
    if alias not in aliases:
        raise ConfigError(f"model {model_name} has no alias {alias!r} (aliases: "
                          f"{', '.join(sorted(aliases)) or 'none'}); set it with `python -m gwenlake_hpc models "
                          f"promote {model_name} --version SHA --alias {alias}`")
    sha = aliases[alias]
    log.info("alias %s of %s resolved to version %s", alias, model_name, sha)
    if tracking_uri:
        with contextlib.suppress(Exception), _http_settings():
            mv = _client(tracking_uri).get_model_version_by_alias(model_name, alias)
            other = (mv.tags or {}).get("gwenlake.version")
            if other and other != sha:
                log.warning("the MLflow alias %s of %s points to %s (model version %s), git's alias log to %s; "
                            "the git log is used", alias, model_name, other, mv.version, sha)
    return sha


def resolve_version(model_name: str, version: str | None = None, alias: str | None = None,
                    repo: Any = None) -> str:
    """The full SHA of a version given as a SHA, an alias, or neither (the newest version); logged.

    Raises:
        ConfigError: both given, unknown version or alias, or no version yet.
    """
    if version is not None and alias is not None:
        raise ConfigError(f"{model_name}: give a version or an alias, not both")
    if alias is not None:
        return resolve_alias(model_name, alias, repo)
    with tempfile.TemporaryDirectory(prefix="gwenlake-alias-") as tmp:
        g = _plumbing(repo, Path(tmp))
        if version is None or version == "latest":
            versions = list_versions(g.repo, model_name)
            if not versions:
                raise ConfigError(f"model {model_name} has no version in {g.repo.working_dir} yet; train it first")
            log.info("newest version of %s: %s", model_name, versions[0]["version"])
            return versions[0]["version"]
        return _version_sha(g, model_name, version)


# --- loading --------------------------------------------------------------------------------------------------

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
    return Path(_git_dir(repo)) / "gwenlake" / "exports" / model_name / sha


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
    g_repo = _repo(repo)
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


# --- MLflow Model Registry ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _pending_lock(state_dir: Path) -> Any:
    # The list is read and rewritten by the end of a training and by the delivery process of the next start (or
    # tracking sync) at once: one at a time, or an entry added meanwhile would be lost.
    import fcntl

    with open(Path(state_dir) / (PENDING_REGISTRATIONS + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def _add_pending(state_dir: Path, entry: Mapping[str, str]) -> None:
    from .fsutil import read_json, write_json_atomic

    path = Path(state_dir) / PENDING_REGISTRATIONS
    with _pending_lock(state_dir):
        todo = [e for e in (read_json(path, default=None) or []) if e.get("version") != entry["version"]]
        write_json_atomic(path, todo + [dict(entry)])


def complete_pending_registrations(state_dir: str | os.PathLike[str], tracking_uri: str) -> list[str]:
    """Register the versions a training committed but could not register (``pending_registrations.json``).

    Called by ``tracking sync`` and, in the delivery process, by the next start of the training once its run is
    attached. Each is registered with the run id now in ``<state_dir>/run_id``, its git aliases mirrored to
    MLflow, and taken off the list. Returns the versions registered; those that fail stay listed (with a
    warning).
    """
    from .fsutil import read_json, write_json_atomic

    state_dir = Path(state_dir)
    path = state_dir / PENDING_REGISTRATIONS
    todo = read_json(path, default=None) or []
    run_file = state_dir / "run_id"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    done: list[str] = []
    for entry in todo:
        try:
            if not run_id:
                raise GwenlakeError("the training's MLflow run does not exist yet")
            m = load_model(entry["model"], entry["version"], repo=entry.get("repo"))
            extra = {rel: read_file(entry.get("repo"), entry["model"], entry["version"], rel)
                     for rel in ("metrics.json", "lineage.json")}
            register_version(tracking_uri, entry["model"], m.version, run_id, m.path, version_tags(m.lineage), extra)
            for alias, sha in current_aliases(entry["model"], entry.get("repo")).items():
                if sha == m.version:
                    mlflow_set_alias(tracking_uri, entry["model"], alias, sha)
            done.append(m.version)
        except Exception as exc:  # noqa: BLE001 - kept on the list, said why
            log.warning("could not register %s version %s yet: %s", entry.get("model"), entry.get("version"), exc)
    if done:
        with _pending_lock(state_dir):  # entries added meanwhile stay
            left = [e for e in (read_json(path, default=None) or []) if e.get("version") not in done]
            if left:
                write_json_atomic(path, left)
            else:
                path.unlink(missing_ok=True)
        log.info("registered the pending version(s) %s", ", ".join(v[:12] for v in done))
    return done


def _http_settings() -> Any:
    # No MLflow retry loop (minutes with backoff): a tracking outage must not hold a training or a promote. Set
    # for the calls below only: MLflow reads them from the environment at each request.
    from .tracking.session import http_settings

    return http_settings()


def _with_http_settings(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _http_settings():
            return fn(*args, **kwargs)

    return wrapper


def _client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    from .tracking import ensure_sqlite_store

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

    client = _client(tracking_uri)
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
    client = _client(tracking_uri)
    mv = _model_version_of(client, model_name, version)
    if mv is None:
        log.warning("%s version %s is not registered in MLflow (%s); the alias %s is set in git only",
                    model_name, version[:12], _redact(tracking_uri), alias)
        return None
    client.set_registered_model_alias(model_name, alias, mv.version)
    return str(mv.version)


def _redact(uri: str) -> str:
    from .tracking import _redact_uri

    return _redact_uri(uri)


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


#: In a run's tracking state folder: versions committed but not registered yet (a JSON list).
PENDING_REGISTRATIONS = "pending_registrations.json"


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
            _add_pending(state_dir, {"model": model_name, "version": version, "repo": str(_repo(repo).working_dir)})
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
                _add_pending(state_dir, {"model": model_name, "version": version,
                                         "repo": str(_repo(repo).working_dir)})
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
        remote = _repo(repo).git.config("--get", "gwenlake.remote")
    except Exception:  # not set
        remote = None
    if remote:
        try:
            from .versioning import push_versions

            push_versions(repo, model_name, remote)
            log.info("pushed %s versions to %s", model_name, _redact(remote))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not push %s to %s (%s); push later with `python -m gwenlake_hpc models push %s "
                        "%s`", model_name, _redact(remote), exc, model_name, _redact(remote))
    return defer


def warn_if_pending(state_dir: Path, model_name: str, version: str) -> bool:
    """After a deferred registration (:func:`after_commit` with ``defer``): warn, naming the command that
    completes it, when ``version`` is still on ``<state_dir>/pending_registrations.json`` (MLflow unreachable,
    no run attached, the delivery process out of time). Returns True when it is still pending."""
    from .fsutil import read_json

    try:
        todo = read_json(Path(state_dir) / PENDING_REGISTRATIONS, default=None) or []
    except (OSError, ValueError):
        todo = []
    if not any(e.get("version") == version for e in todo):
        return False
    run_dir = state_dir.parent if state_dir.name.startswith("tracking") else state_dir
    log.warning("%s version %s is committed but not registered in the MLflow Model Registry yet; "
                "`python -m gwenlake_hpc tracking sync %s` registers it once MLflow answers (the next start of "
                "this training does too)", model_name, version[:12], run_dir)
    return True


# --- command line ---------------------------------------------------------------------------------------------

def default_tracking_uri(explicit: str | None) -> str | None:
    """Tracking URI for the ``models`` commands: ``--tracking-uri``, else $MLFLOW_TRACKING_URI, else the
    jobs' default store ``./runs/mlflow.db`` when it exists, else None (aliases in git only)."""
    if explicit:
        from .tracking import validate_uri

        return validate_uri(explicit)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    db = Path.cwd() / "runs" / "mlflow.db"
    from .tracking import sqlite_uri

    return sqlite_uri(db) if db.is_file() else None


def _fmt_metrics(metrics: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in sorted(metrics.items()))


def list_models(model_name: str, repo: Any = None) -> list[dict]:
    """Versions of ``model_name`` newest first, each ``{"version", "date", "message", "metrics", "run_id",
    "datasets" ({binding: "name@revision"}), "aliases" (list)}``; read from git only (one read per file)."""
    g_repo = _repo(repo)
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
    from .api import check_name
    from .versioning import commit_model

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


def models_command(args: Any) -> int:
    """``python -m gwenlake_hpc models ACTION ...`` (list, show, commit, promote, rollback, push, history);
    returns the exit status. Raises GwenlakeError for the CLI to print."""
    from .versioning import push_versions

    repo_path = Path(args.repo) if getattr(args, "repo", None) else default_model_repo(Path.cwd())
    if args.action == "commit":
        sha = save_model(args.directory, args.name, message=args.message, repo=open_model_repo(repo_path, create=True))
        print(f"model {args.name} version {sha}")
        return 0
    repo = open_model_repo(repo_path, create=False)
    if args.action == "list":
        versions = list_models(args.name, repo)
        if not versions:
            print(f"no versions of {args.name} in {repo.working_dir}")
        for v in versions:  # one line per version
            tag = f"  [{', '.join(v['aliases'])}]" if v["aliases"] else ""
            print(f"{v['version']}  {v['date']}{tag}  {v['message'].splitlines()[0] if v['message'] else ''}"
                  f"  | metrics {_fmt_metrics(v['metrics']) or '-'} | run {v['run_id'] or '-'}"
                  f" | data {', '.join(f'{k}={d}' for k, d in sorted(v['datasets'].items())) or '-'}")
        moves = alias_history(args.name, repo) if args.history else []
        if moves:
            print("alias moves (oldest first):")
            for m in moves:
                print(f"  {m['when']}  {m['alias']}: {(m['previous'] or 'unset')[:12]} -> {m['version'][:12]}  "
                      f"{m['action']} by {m['who']}" + (f": {m['reason']}" if m["reason"] else ""))
        return 0
    if args.action == "show":
        m = load_model(args.name, args.version, alias=args.alias, repo=repo)
        print(f"model {m.name} version {m.version}\n  path: {m.path}\n  metrics: {_fmt_metrics(m.metrics)}")
        print(f"  files: {', '.join(sorted(str(p.relative_to(m.path)) for p in m.path.rglob('*') if p.is_file()))}")
        print(f"  lineage: {json.dumps(m.lineage, indent=2, sort_keys=True, default=str)}")
        return 0
    if args.action == "push":
        refs = push_versions(repo, args.name, args.remote)
        print(f"pushed {', '.join(refs)} to {_redact(args.remote)}")
        return 0
    uri = default_tracking_uri(getattr(args, "tracking_uri", None))
    if args.action == "register":
        m = load_model(args.name, args.version, repo=repo)
        tracking = m.lineage.get("tracking") or {}
        run_id = tracking.get("run_id")
        if not run_id and tracking.get("state_dir"):  # committed before its MLflow run was attached
            run_file = Path(tracking["state_dir"]) / "run_id"
            run_id = run_file.read_text().strip() if run_file.is_file() else None
        if not uri or not run_id:
            raise ConfigError(f"version {m.version[:12]} of {args.name} has no tracking run or no tracking URI is "
                              "known (--tracking-uri URI or MLFLOW_TRACKING_URI); registration needs both")
        number = register_version(uri, args.name, m.version, run_id, m.path,
                                  {"gwenlake.code_commit": str((m.lineage.get("code") or {}).get("commit"))})
        for alias, sha in current_aliases(args.name, repo).items():
            if sha == m.version:  # the git aliases of this version, now that MLflow knows it
                mlflow_set_alias(uri, args.name, alias, sha)
        print(f"registered {args.name} version {m.version} as MLflow model version {number}")
        return 0
    if args.action == "promote":
        from .release import find_run_dir, promote, version_from_run

        version = args.version
        check_alias(args.alias)  # before any gate or commit
        if args.criterion and not args.from_run:
            raise ConfigError("--criterion picks among a run's checkpoints: give --from-run RUN with it")
        if args.from_run:
            run_dir = find_run_dir(Path(args.runs_root), args.name, args.from_run)
            version = version_from_run(args.name, run_dir, args.criterion, repo=repo)
        return promote(args.name, version, args.alias, repo=repo, reason=args.reason or "",
                       config=args.config, data_root=Path(args.data_root), tracking_uri=uri, force=False)
    if args.action == "rollback":
        current, previous = rollback_target(args.name, args.alias, repo)
        move_alias(args.name, args.alias, previous, repo=repo, action="rollback", expected=current,
                   reason=args.reason or f"rollback from {current[:12]}")
        if uri:
            try:
                mlflow_set_alias(uri, args.name, args.alias, previous)
            except Exception as exc:  # noqa: BLE001 - git holds the truth; say MLflow lags
                log.warning("alias moved in git, but not in MLflow (%s): %s", _redact(uri), exc)
        print(f"alias {args.alias} of {args.name}: {current} -> {previous} (rolled back)")
        return 0
    raise ConfigError(f"unknown models action {args.action!r}")


def add_models_parser(sub: Any) -> None:
    """Add the ``models`` sub-command and its actions to an argparse sub-parsers object."""
    models = sub.add_parser("models", help="model versions, aliases and release").add_subparsers(
        dest="action", required=True)

    def common(p: Any) -> Any:
        p.add_argument("name", help="model name group.name")
        p.add_argument("--repo", help="model repository (paths.model_repo; default: the git repository here)")
        return p

    ls = common(models.add_parser("list", help="versions (commit, date, aliases, metrics, tracking run, datasets)"))
    ls.add_argument("--history", action="store_true", help="also every alias move (who, when, from, to, why)")
    sh = common(models.add_parser("show", help="one version: files, metrics, lineage"))
    sh.add_argument("version", nargs="?", help="commit SHA (default: the newest)")
    sh.add_argument("--alias", help="an alias instead of a SHA, e.g. champion")
    cm = models.add_parser("commit", help="commit a directory as a new version of a model (work done by hand)")
    cm.add_argument("directory")
    common(cm)
    cm.add_argument("-m", "--message", default=None)
    pr = common(models.add_parser("promote", help="run the release gate, then move an alias to a version"))
    which = pr.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="commit SHA of the version to promote")
    which.add_argument("--from-run", help="a run (run key or MLflow run id): its own version, or with --criterion "
                                          "the best of its checkpoints (committed as a version first)")
    pr.add_argument("--criterion", help="with --from-run: max:METRIC or min:METRIC over the checkpoints' metrics")
    pr.add_argument("--runs-root", default="runs", help="paths.runs_root holding the run (default ./runs)")
    pr.add_argument("--alias", default=CHAMPION, help="alias to move (default champion)")
    pr.add_argument("--reason", help="why (recorded in the alias log)")
    pr.add_argument("--config", help="release config: a YAML path or a name in conf/release/ (default: the one "
                                     "whose 'model' is NAME)")
    pr.add_argument("--data-root", default="data", help="catalog root (paths.data_root), default ./data")
    pr.add_argument("--tracking-uri", help="MLflow URI to mirror the alias (default: $MLFLOW_TRACKING_URI, "
                                           "else ./runs/mlflow.db when present)")
    rb = common(models.add_parser("rollback", help="move an alias back to its previous version"))
    rb.add_argument("--alias", default=CHAMPION)
    rb.add_argument("--reason")
    rb.add_argument("--tracking-uri")
    ps = common(models.add_parser("push", help="push a model's versions and aliases (LFS objects included)"))
    ps.add_argument("remote", help="remote name, URL, or path of a bare repository")
    rg = common(models.add_parser("register", help="register a version in the MLflow Model Registry"))
    rg.add_argument("version")
    rg.add_argument("--tracking-uri")
