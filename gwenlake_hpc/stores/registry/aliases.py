"""Aliases (``champion``, ``candidate``...): names of one version of a model, kept in an append-only log.

The log is the ref ``refs/gwenlake/aliases/<group>.<name>`` of the model repository: each move of an alias is
one commit whose tree holds ``history.jsonl`` (every move so far: alias, version, previous version, who, when,
action, reason) and ``aliases.json`` (where each alias points now). The ref moves by compare-and-swap
(:func:`gwenlake_hpc.stores.versioning.compare_and_swap`, as model branches do), so concurrent moves never lose one.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from ...base.errors import ConfigError, GwenlakeError
from ...base.names import check_alias, is_hex_id
from ..versioning import (ALIAS_REF_PREFIX, MODEL_TRAILER, Plumbing, compare_and_swap, identity_env, list_versions,
                          model_branch, model_repo, read_blobs, rev, rev_any, strip_trailers)
from .mlflow_registry import http_settings, mlflow_client

log = logging.getLogger("gwenlake_hpc.registry")  # one logger for the package

__all__ = ["CANDIDATE", "CHAMPION", "check_alias", "alias_history", "current_aliases", "move_alias",
           "rollback_target", "resolve_alias", "resolve_version"]


#: Alias a finished training gives its version automatically.
CANDIDATE = "candidate"


#: Alias only ``models promote`` (through the release gate) sets.
CHAMPION = "champion"


def _plumbing(repo: Any, tmp: Path) -> Plumbing:
    """git plumbing on the model repository (None: the default one around the working directory)."""
    return Plumbing(model_repo(repo), tmp)


def _alias_ref(model_name: str) -> str:
    model_branch(model_name)  # validates the name
    return ALIAS_REF_PREFIX + model_name


def _read_log(g: Plumbing, model_name: str) -> tuple[str | None, list[dict]]:
    ref = _alias_ref(model_name)
    tip = rev_any(g.tmp, g.env, ref)
    return tip, _history_at(g, tip)


def _history_at(g: Plumbing, tip: str | None) -> list[dict]:
    """The moves of the alias log at commit ``tip`` (None: no log yet, [])."""
    if tip is None:
        return []
    blob = read_blobs(g.tmp, g.env, [f"{tip}:history.jsonl"])[0] or b""
    return [json.loads(line) for line in blob.decode().splitlines() if line.strip()]


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
    if not isinstance(version, str) or not is_hex_id(version):
        raise ConfigError(f"version {version!r} of {model_name}: give a commit SHA (hexadecimal), as "
                          f"`python -m gwenlake_hpc models list {model_name}` prints")
    sha = rev(g.tmp, g.env, version)
    if sha is None:
        raise ConfigError(f"version {version} of {model_name} is not a commit of the model repository "
                          f"{g.repo.working_dir}; see `python -m gwenlake_hpc models list {model_name}`")
    _, out, _ = g.run("cat_file", "commit", sha)
    body = out.decode("utf-8", "replace").split("\n\n", 1)[-1]
    if strip_trailers(body)[1].get(MODEL_TRAILER) != model_name:
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
        env = dict(g.env, **identity_env(tmp, g.env))
        ref = _alias_ref(model_name)

        def make(tip: str | None) -> tuple[str, dict]:
            history = _history_at(g, tip)
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
            return out.decode().strip(), move

        move = compare_and_swap(g.run, ref, make, reflog=f"gwenlake_hpc: alias {alias}", env=env,
                                max_attempts=max_attempts,
                                what=f"could not move alias {alias} of {model_name}: {ref} kept moving")
        log.info("alias %s of %s -> %s (was %s; %s by %s)", alias, model_name, sha,
                 move["previous"] or "unset", action, move["who"])
        return move


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
        with contextlib.suppress(Exception), http_settings():
            mv = mlflow_client(tracking_uri).get_model_version_by_alias(model_name, alias)
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
