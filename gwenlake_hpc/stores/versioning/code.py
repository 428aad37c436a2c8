"""The state of the code a training runs from: repository, HEAD commit, dirty or not (read only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...base.errors import ConfigError
from .gitcmd import PathLike, base_env, git, git_dir, rev, run_git

__all__ = ["CodeState", "code_state"]


@dataclass(frozen=True)
class CodeState:
    """State of the code a training runs from.

    Attributes:
        repo_root: top level of the git repository around the path (its git dir for a bare
            repository), None when the path is in no repository.
        commit: 40-hex SHA of HEAD, None when there is no repository or HEAD is unborn.
        dirty: True when tracked files differ from HEAD (staged or not); untracked files are
            ignored.
    """

    repo_root: Path | None
    commit: str | None
    dirty: bool


def code_state(path: PathLike) -> CodeState:
    """Return the CodeState of the git repository around ``path`` (parents are searched).

    ``path`` may be a file or a directory. Only reads: git runs without optional locks, so the
    user's index is not rewritten. Raises ConfigError when ``path`` does not exist.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"code path {p} does not exist")
    start = p if p.is_dir() else p.parent
    try:
        repo = git.Repo(start, search_parent_directories=True)
    except git.InvalidGitRepositoryError:
        return CodeState(None, None, False)
    with repo:
        gdir = git_dir(repo)
        root = repo.working_tree_dir
        if root is None:  # bare repository: no work tree, nothing can be dirty
            env = base_env(gdir, gdir, os.path.join(gdir, "index"))
            return CodeState(Path(gdir), rev(gdir, env, "HEAD"), False)
        env = base_env(gdir, root, os.path.join(gdir, "index"))
        commit = rev(root, env, "HEAD")
        _, out, _ = run_git(root, env, "status", "--porcelain", "-z", "--untracked-files=no")
        return CodeState(Path(root), commit, bool(out.strip(b"\0")))
