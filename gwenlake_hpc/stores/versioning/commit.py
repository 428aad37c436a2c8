"""Committing a version: the tree of :mod:`.tree` in a commit with its trailers, the model's branch moved
by compare-and-swap (:func:`.gitcmd.compare_and_swap`), so many jobs can commit versions of one model at once."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Mapping

from ...base.errors import ConfigError
from ...base.names import is_hex_id, split_model_name
from .gitcmd import PathLike, compare_and_swap, git, identity_env, rev
from .repo import BRANCH_PREFIX, CODE_TRAILER, MODEL_TRAILER, RUN_TRAILER, as_repo
from .tree import TreeBuilder, collect_files

__all__ = ["commit_model"]


def commit_model(repo: git.Repo | PathLike, model_name: str, src_dir: PathLike, *, message: str,
                 code_commit: str | None = None, extra_files: Mapping[str, bytes] | None = None,
                 max_attempts: int = 50, large_file_warning_bytes: int | None = None,
                 run: str | None = None) -> str:
    """Commit the files of ``src_dir`` as a new version of ``model_name``; return its SHA.

    The version is a commit on branch ``models/<group>.<name>`` (see model_branch) built with
    plumbing only (temporary GIT_INDEX_FILE, read-tree, update-index, write-tree, commit-tree),
    so the user's work tree, index, HEAD and current branch are never touched. The branch is
    moved with ``git update-ref <ref> <new> <old>`` (compare-and-swap); when another job moved
    it first, the commit is rebuilt on the new tip and retried.

    Tree: the tree of ``code_commit`` when given and present in the repository, else the tree
    of the branch tip, else empty; in it ``<group>/<name>/`` is replaced by the regular files of
    ``src_dir`` (recursively, execute bit kept) plus ``extra_files`` (relative path -> bytes,
    str is encoded as UTF-8), which win over files of src_dir with the same path.
    Blobs are written by one ``git hash-object -w --stdin-paths`` process over a staging work
    tree, so the repository's .gitattributes filters (git-lfs, eol) apply; the .gitattributes
    come from the base tree, falling back to the user's work tree (see TreeBuilder.blobs). The
    number of git processes per call does not depend on the number of files.

    Parents: the branch tip (if any), then ``code_commit`` when present, different from the tip
    and not already an ancestor of it. Author/committer: git's configured identity, else
    FALLBACK_NAME/FALLBACK_EMAIL. The message gets trailers ``Gwenlake-Model: <model_name>``
    and, when code_commit is given, ``Gwenlake-Code-Commit: <sha>``.

    Args:
        repo: the model repository (git.Repo, or a path opened with open_model_repo(create=False)).
        model_name: ``group.name``.
        src_dir: directory holding the model files.
        message: commit message (non-empty).
        code_commit: hex SHA of the code that trained the model (CodeState.commit), or None.
        extra_files: files added to the model directory, e.g. ``{"metrics.json": b"..."}``.
        max_attempts: compare-and-swap attempts before giving up (>= 1).
        large_file_warning_bytes: a file of this size or more that the attributes do not send
            through git-lfs gets a warning; default $GWENLAKE_LFS_WARN_MB megabytes, else
            LARGE_FILE_WARNING_BYTES (50 MiB).
        run: what produced the version (``<run key>/<run uid>@<final step>``), recorded as the trailer
            ``Gwenlake-Run``, so that a job killed after its commit finds it again
            (:func:`find_run_version`) instead of committing a second version.

    git-lfs: files the attributes mark ``filter=lfs`` are committed as pointer blobs (< 1 KB)
    and their content goes to ``.git/lfs/objects`` (git-lfs's clean filter, run by
    hash-object); push it with push_versions.

    Raises:
        ConfigError: bad model name, message or code_commit; src_dir missing, not a directory,
            or with no files (and no extra_files); a symlink or special file in src_dir; an
            unsafe path (absolute, '..', '.git') or a file/directory clash.
        GwenlakeError: a git command failed, the branch kept moving for max_attempts tries,
            or a file needs git-lfs and git-lfs is not installed.
    """
    group, name = split_model_name(model_name)
    ref = f"refs/heads/{BRANCH_PREFIX}{group}.{name}"
    _check_arguments(message, code_commit, max_attempts)
    repo = as_repo(repo)
    files = collect_files(src_dir, extra_files)

    with tempfile.TemporaryDirectory(prefix="gwenlake-commit-") as tmpdir:
        b = TreeBuilder(repo, model_name, files, Path(tmpdir))
        warn_bytes = _large_file_warning_bytes(large_file_warning_bytes)
        if warn_bytes is not None:
            b.warn_bytes = warn_bytes
        env = dict(b.env, **identity_env(b.empty, b.env))
        code_sha = rev(b.empty, env, code_commit) if code_commit else None
        msg_file = Path(tmpdir) / "message"
        msg_file.write_bytes((message.rstrip() + "\n\n" + _trailers(model_name, code_commit, code_sha, run))
                             .encode("utf-8"))
        branch = ref[len("refs/heads/"):]
        # A failure while the branch did not move and was not locked is permanent (e.g. a branch
        # named 'models' blocking 'models/...').
        return compare_and_swap(b.run, ref, _version_maker(b, code_sha, msg_file, env),
                                reflog=f"gwenlake_hpc: version of {model_name}", env=env,
                                max_attempts=max_attempts, stuck=f"cannot move branch {branch}",
                                what=f"could not commit a version of {model_name}: branch {branch} kept"
                                     " moving or stayed locked")


def _check_arguments(message: str, code_commit: str | None, max_attempts: int) -> None:
    """Raises ConfigError: an empty message, a ``code_commit`` that is not a hex id, ``max_attempts`` < 1."""
    if not isinstance(message, str) or not message.strip():
        raise ConfigError("commit_model: message must be a non-empty string")
    if code_commit is not None and (not isinstance(code_commit, str)
                                    or not is_hex_id(code_commit)):
        raise ConfigError(f"code_commit must be a hexadecimal commit id, got {code_commit!r}")
    if max_attempts < 1:
        raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")


def _large_file_warning_bytes(given: int | None) -> int | None:
    """``given``, else ``$GWENLAKE_LFS_WARN_MB`` megabytes in bytes, else None (the builder's default).

    Raises:
        ConfigError: ``GWENLAKE_LFS_WARN_MB`` is not a number.
    """
    if given is None and os.environ.get("GWENLAKE_LFS_WARN_MB"):
        try:
            return int(float(os.environ["GWENLAKE_LFS_WARN_MB"]) * 1024 * 1024)
        except ValueError:
            raise ConfigError(f"GWENLAKE_LFS_WARN_MB={os.environ['GWENLAKE_LFS_WARN_MB']!r} must be a"
                              " number of megabytes") from None
    return given


def _trailers(model_name: str, code_commit: str | None, code_sha: str | None, run: str | None) -> str:
    """The version's trailer lines: ``Gwenlake-Model``, ``Gwenlake-Code-Commit``, ``Gwenlake-Run``.

    Raises:
        ConfigError: ``run`` holds a newline.
    """
    trailers = f"{MODEL_TRAILER}: {model_name}\n"
    if code_commit:
        trailers += f"{CODE_TRAILER}: {code_sha or code_commit.lower()}\n"
    if run:
        if "\n" in run:
            raise ConfigError(f"commit_model: run must be one line, got {run!r}")
        trailers += f"{RUN_TRAILER}: {run}\n"
    return trailers


def _version_maker(b: TreeBuilder, code_sha: str | None, msg_file: Path,
                   env: Mapping[str, str]) -> Callable[[str | None], tuple[str, str]]:
    """The compare-and-swap step: a new commit on the branch tip ``tip`` (None: no branch yet), returned twice
    (the value to set and the result)."""
    def make(tip: str | None) -> tuple[str, str]:
        tree = b.tree(code_sha or tip)
        parents = [tip] if tip else []
        if code_sha and code_sha != tip:
            # a code commit already in the branch history would only clutter the graph
            known = tip is not None and b.run("merge_base", "--is-ancestor", code_sha, tip,
                                              ok=(0, 1))[0] == 0
            if not known:
                parents.append(code_sha)
        args = [tree]
        for parent in parents:
            args += ["-p", parent]
        _, out, _ = b.run("commit_tree", *args, "-F", str(msg_file), env=env)
        new = out.decode().strip()
        return new, new

    return make
