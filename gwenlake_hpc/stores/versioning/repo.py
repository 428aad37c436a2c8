"""The model repository: opening it, where versions live in it, and plumbing on it.

Layout: each model ``group.name`` has its branch ``models/group.name`` whose commits hold the model files
under ``group/name/``; a commit is a version when its message ends with the trailer ``Gwenlake-Model:
group.name``; the model's alias log is the ref ``refs/gwenlake/aliases/group.name`` (see
:mod:`gwenlake_hpc.stores.registry`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ...base.errors import ConfigError
from ...base.names import split_model_name
from .gitcmd import PathLike, base_env, git, git_dir, run_git

__all__ = ["MODEL_TRAILER", "RUN_TRAILER", "CODE_TRAILER", "BRANCH_PREFIX", "ALIAS_REF_PREFIX", "open_model_repo",
           "default_model_repo", "as_repo", "model_repo", "model_branch", "model_prefix", "check_relpath",
           "strip_trailers", "Plumbing"]

#: Trailer that marks a commit as a version of a model; list_versions keeps only these commits,
#: so the walk does not list the code commits a first version descends from.
MODEL_TRAILER = "Gwenlake-Model"
RUN_TRAILER = "Gwenlake-Run"
#: Trailer that records the code commit a version was trained from, even when that commit is
#: not in the model repository (separate model repository).
CODE_TRAILER = "Gwenlake-Code-Commit"
#: Prefix of the branch of each model (``models/<group>.<name>``).
BRANCH_PREFIX = "models/"
#: Ref holding the alias log of a model (see gwenlake_hpc.stores.registry); pushed with its branch.
ALIAS_REF_PREFIX = "refs/gwenlake/aliases/"


def open_model_repo(path: PathLike, create: bool = True) -> git.Repo:
    """Open the model repository at ``path`` (the value of config key ``paths.model_repo``).

    ``path`` must be the repository itself (its top level, or a bare repository); parents are
    not searched. When it is missing, or an empty directory, it is created with ``git init``
    if ``create`` is true. Raises ConfigError naming ``paths.model_repo`` when it is missing
    and ``create`` is false, or when it exists but is not a git repository.
    """
    p = Path(path).expanduser()
    if not p.exists():
        if not create:
            raise ConfigError(f"paths.model_repo={p} does not exist; create it with `git init {p}`"
                              " or point paths.model_repo to an existing git repository")
        p.mkdir(parents=True, exist_ok=True)
        return git.Repo.init(p)
    if not p.is_dir():
        raise ConfigError(f"paths.model_repo={p} is not a directory; point it to a git repository")
    try:
        return git.Repo(p)
    except git.InvalidGitRepositoryError:
        pass
    # An empty directory, or one where a concurrent job has just started `git init`.
    if create and all(child.name == ".git" for child in p.iterdir()):
        return git.Repo.init(p)
    raise ConfigError(f"paths.model_repo={p} exists but is not a git repository (or not its top"
                      " level); point paths.model_repo to a git repository or a new directory")


def default_model_repo(cwd: PathLike) -> Path:
    """Default model repository for a job started in ``cwd``: the value of ``paths.model_repo``.

    It is the top level of the git repository around ``cwd`` (parent directories searched), so
    versions share history with the code; otherwise ``<cwd>/models``, created with ``git init``
    when absent or empty. Raises ConfigError when ``cwd`` does not exist or ``<cwd>/models``
    exists and is not a git repository.
    """
    base = Path(cwd).expanduser()
    if not base.is_dir():
        raise ConfigError(f"working directory {base} does not exist")
    try:
        with git.Repo(base, search_parent_directories=True) as repo:
            return Path(repo.working_tree_dir or git_dir(repo))
    except git.InvalidGitRepositoryError:
        pass
    with open_model_repo(base / "models", create=True) as repo:
        return Path(repo.working_tree_dir or git_dir(repo))


def as_repo(repo: git.Repo | PathLike) -> git.Repo:
    """``repo`` itself when it is a git.Repo, else the repository at that path (open_model_repo(create=False))."""
    if isinstance(repo, git.Repo):
        return repo
    return open_model_repo(repo, create=False)


def model_repo(repo: git.Repo | PathLike | None) -> git.Repo:
    """A git.Repo from a Repo, a path, or None (the default model repository around the cwd, which must exist).

    Raises ConfigError as open_model_repo(create=False).
    """
    if repo is None:
        return open_model_repo(default_model_repo(Path.cwd()), create=False)
    return as_repo(repo)


def model_branch(model_name: str) -> str:
    """Branch holding the versions of ``model_name``: ``'crm.churn'`` -> ``'models/crm.churn'``.

    Raises ConfigError unless ``model_name`` is ``group.name`` with each part matching
    ``[A-Za-z0-9][A-Za-z0-9_-]*`` (and the name part is not ``lock``, refused by git).
    """
    group, name = split_model_name(model_name)
    return f"{BRANCH_PREFIX}{group}.{name}"


def model_prefix(model_name: str) -> str:
    """Directory of the model's files in a version's tree: ``'crm.churn'`` -> ``'crm/churn'``.

    Raises ConfigError on a bad model name (see model_branch).
    """
    group, name = split_model_name(model_name)
    return f"{group}/{name}"


def check_relpath(rel: str, what: str) -> str:
    """Validate a POSIX path relative to the model directory; raise ConfigError if unsafe."""
    if not isinstance(rel, str) or not rel:
        raise ConfigError(f"{what}: file path must be a non-empty string, got {rel!r}")
    parts = rel.split("/")
    if rel.startswith("/") or "\0" in rel or any(
            part in ("", ".", "..") for part in parts):
        raise ConfigError(f"{what}: file path {rel!r} must be relative, without '.', '..' or"
                          " empty components, so that it stays inside the model directory")
    if any(part.lower() == ".git" for part in parts):
        raise ConfigError(f"{what}: file path {rel!r} has a '.git' component, which git cannot"
                          " store")
    return rel


def strip_trailers(message: str) -> tuple[str, dict[str, str]]:
    """Split a version's message into the user's message and its Gwenlake-* trailers."""
    text = message.rstrip("\n")
    cut = text.rfind("\n\n")
    block = text[cut + 2:] if cut >= 0 else text
    lines = block.split("\n")
    if not all(line.startswith("Gwenlake-") and ": " in line for line in lines):
        return text, {}
    trailers = dict(line.split(": ", 1) for line in lines)
    return (text[:cut] if cut >= 0 else ""), trailers


class Plumbing:
    """git plumbing on a model repository through a private temp dir (never the user's work tree or index).

    ``run(command, *args)`` returns ``(status, stdout bytes, stderr text)``; see :func:`run_git` for the options.
    """

    def __init__(self, repo: git.Repo | PathLike, tmp: Path):
        self.repo = as_repo(repo)
        self.tmp = tmp
        self.env = base_env(git_dir(self.repo), tmp, tmp / "index")

    def run(self, command: str, *args: str, env: Mapping[str, str] | None = None,
            **kwargs: Any) -> tuple[int, bytes, str]:
        return run_git(self.tmp, env or self.env, command, *args, **kwargs)

    def config_get(self, key: str) -> str | None:
        """The value of git config ``key`` for this repository (any level), None when unset."""
        status, out, _ = self.run("config", "--get", key, ok=(0, 1))
        return (out.decode().strip() or None) if status == 0 else None
