"""Pushing versions: a model's branch and alias log to a shared repository, LFS objects first."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from ...base.errors import ConfigError
from .gitcmd import PathLike, base_env, git, git_dir, rev_any, run_git
from .lfs import lfs_config_env
from .repo import ALIAS_REF_PREFIX, as_repo, model_branch

__all__ = ["push_versions"]


def _remote_url(remote: str) -> str:
    """A remote name or URL as given; a local path becomes a ``file://`` URL (git-lfs needs one)."""
    if not isinstance(remote, str) or not remote.strip():
        raise ConfigError("remote must be a git remote name, a URL or the path of a bare repository")
    remote = remote.strip()
    if "://" in remote or re.match(r"^[\w.-]+@[\w.-]+:", remote):
        return remote
    path = Path(remote).expanduser()
    if path.is_absolute() or remote.startswith(".") or os.sep in remote:
        if not path.is_dir():
            raise ConfigError(f"remote {remote}: no such directory; create the shared repository with"
                              f" `git init --bare {remote}`")
        return path.resolve().as_uri()
    return remote  # a configured remote name such as 'origin'


def push_versions(repo: git.Repo | PathLike, model_name: str, remote: str) -> list[str]:
    """Push the versions of ``model_name`` (branch and alias log) to ``remote``, LFS objects first.

    ``remote`` is a remote name of the model repository, a URL, or the path of a bare repository
    (e.g. on the shared filesystem). ``git lfs push`` uploads the LFS objects every pushed
    commit refers to (skipped when git-lfs is not installed and no version uses it), then
    ``git push`` moves the remote refs without force: the branch only ever moves forward, so a
    refusal means the remote holds versions this repository lacks (fetch them first).
    Returns the refs pushed.

    Raises:
        ConfigError: bad model name, a remote path that does not exist, no versions to push.
        GwenlakeError: git or git-lfs failed (message includes their error).
    """
    branch = "refs/heads/" + model_branch(model_name)
    url = _remote_url(remote)
    repo = as_repo(repo)
    with tempfile.TemporaryDirectory(prefix="gwenlake-push-") as tmpdir:
        tmp = Path(tmpdir)
        env = base_env(git_dir(repo), tmp, tmp / "index")
        env["GIT_LFS_SKIP_PUSH"] = "0"
        refs = [r for r in (branch, ALIAS_REF_PREFIX + model_name) if rev_any(tmp, env, r)]
        if branch not in refs:
            raise ConfigError(f"model {model_name} has no versions to push (no branch {branch[11:]})")
        if shutil.which("git-lfs") is not None:
            env.update(lfs_config_env(tmp, env))
            run_git(tmp, env, "lfs", "push", url, *refs)
        run_git(tmp, env, "push", "--porcelain", url, *[f"{r}:{r}" for r in refs])
    return refs
