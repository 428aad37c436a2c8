"""Model versions as git commits.

The final model of each training is committed to git; the SHA of that commit is the model's
version. Each model ``group.name`` has its own branch ``models/group.name`` whose commits hold
the model files under ``group/name/``. When the model repository is also the code repository,
a version's tree is the tree of the code commit that trained it plus the model files, so
``git checkout <version>`` gives back both.

Commits are built with git plumbing against a temporary index, so the user's working tree,
index, HEAD and current branch are never touched, and the branch is moved with a
compare-and-swap, so many jobs can commit versions of the same model at once.

Modules, one concern each (each imports only those above it):

* :mod:`.gitcmd`: the git runner (git command line; why not GitPython's object database is said there), the
  repository/index environment, the compare-and-swap of a ref (versions and alias logs);
* :mod:`.code`: the state of the code a training runs from;
* :mod:`.repo`: opening the model repository, where versions live (branch, prefix, trailers), :class:`Plumbing`;
* :mod:`.lfs`: git-lfs filter settings, pointers, smudging;
* :mod:`.tree`: collecting the model files and building a version's tree;
* :mod:`.commit`: :func:`commit_model`;
* :mod:`.read`: :func:`list_versions`, :func:`read_file`, :func:`export_version`;
* :mod:`.push`: :func:`push_versions`.
"""

from __future__ import annotations

from .code import CodeState, code_state
from .commit import commit_model
from .gitcmd import (FALLBACK_EMAIL, FALLBACK_NAME, PathLike, base_env, compare_and_swap, git_dir, identity_env,
                     read_blobs, rev, rev_any, run_git)
from .lfs import is_lfs_pointer, lfs_config_env
from .push import push_versions
from .read import export_version, find_run_version, list_versions, read_file
from .repo import (ALIAS_REF_PREFIX, CODE_TRAILER, MODEL_TRAILER, RUN_TRAILER, Plumbing, as_repo,
                   default_model_repo, model_branch, model_prefix, model_repo, open_model_repo, strip_trailers)
from .tree import LARGE_FILE_WARNING_BYTES

__all__ = [
    "CodeState",
    "code_state",
    "default_model_repo",
    "open_model_repo",
    "model_branch",
    "model_prefix",
    "commit_model",
    "list_versions",
    "find_run_version",
    "read_file",
    "export_version",
    "push_versions",
    "is_lfs_pointer",
    "lfs_config_env",
    "LARGE_FILE_WARNING_BYTES",
    "FALLBACK_NAME",
    "FALLBACK_EMAIL",
    "MODEL_TRAILER",
    "RUN_TRAILER",
    "CODE_TRAILER",
    "ALIAS_REF_PREFIX",
    # for the registry's alias log (git plumbing on the model repository)
    "PathLike",
    "Plumbing",
    "as_repo",
    "model_repo",
    "git_dir",
    "base_env",
    "run_git",
    "rev",
    "rev_any",
    "read_blobs",
    "identity_env",
    "strip_trailers",
    "compare_and_swap",
]
