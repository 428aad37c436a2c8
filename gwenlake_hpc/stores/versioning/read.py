"""Reading versions: listing a model's versions, one file of a version, a whole version exported to disk.

Every read goes through a private temp index and ``checkout-index``, so smudge filters (git-lfs) apply with
the version's own ``.gitattributes`` and the user's work tree, index and HEAD are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ...base.errors import ConfigError
from ...base.fsutil import fsync_dir, mkdtemp
from ...base.names import is_hex_id, split_model_name
from .gitcmd import PathLike, git, rev
from .lfs import smudge_pointers
from .repo import MODEL_TRAILER, RUN_TRAILER, Plumbing, check_relpath, model_branch, model_prefix, strip_trailers

__all__ = ["list_versions", "find_run_version", "read_file", "export_version"]


class Reader(Plumbing):
    """Read-only access to one model's versions through a private temp index."""

    def __init__(self, repo: git.Repo | PathLike, model_name: str, tmp: Path):
        super().__init__(repo, tmp)
        self.model_name = model_name
        self.prefix = model_prefix(model_name)
        self.ref = "refs/heads/" + model_branch(model_name)

    def resolve(self, version: str) -> str:
        if version == "latest":
            sha = rev(self.tmp, self.env, self.ref)
            if sha is None:
                raise ConfigError(f"model {self.model_name} has no versions yet (no branch"
                                  f" {self.ref[len('refs/heads/'):]})")
            return sha
        # Only hex ids: a version string must never be taken as an option or a revision range.
        if not isinstance(version, str) or not is_hex_id(version):
            raise ConfigError(f"version {version!r} of model {self.model_name} must be a commit"
                              " SHA (hexadecimal) or 'latest'")
        sha = rev(self.tmp, self.env, version)
        if sha is None:
            raise ConfigError(f"version {version} of model {self.model_name} is not a commit of"
                              " the model repository")
        return sha

    def entry_type(self, sha: str, path: str) -> str | None:
        """git object type ('blob', 'tree', 'commit') of ``path`` in ``sha``, None if absent."""
        _, out, _ = self.run("ls_tree", "-z", sha, "--", path)
        for item in out.split(b"\0"):
            meta, _, name = item.partition(b"\t")
            if name == os.fsencode(path):
                return meta.split(b" ")[1].decode()
        return None

    def checkout(self, sha: str, paths: list[bytes] | None, out_dir: Path) -> None:
        """Write ``paths`` of ``sha`` (all under the model prefix when None) below out_dir.

        read-tree into the temp index then checkout-index --prefix: smudge filters (git-lfs)
        apply with the version's own .gitattributes, and the user's files are not involved.
        """
        self.run("read_tree", sha)
        if paths is None:
            _, listed, _ = self.run("ls_files", "-z", "--", self.prefix)
            paths = [p for p in listed.split(b"\0") if p]
        self.run("checkout_index", "-z", "--stdin", "-f", f"--prefix={out_dir}/",
                 stdin=b"".join(p + b"\0" for p in paths))
        smudge_pointers(self.tmp, self.env, out_dir)


def list_versions(repo: git.Repo | PathLike, model_name: str) -> list[dict]:
    """Versions of ``model_name``, newest first: ``{"version", "date", "message", "run"}`` dicts.

    Walks the first parents of branch ``models/<group>.<name>`` and keeps the commits made by
    commit_model (those with a ``Gwenlake-Model: <model_name>`` trailer), so the code commits a
    first version descends from are not listed. ``version`` is the 40-hex SHA, ``date`` the
    committer date in strict ISO 8601, ``message`` the message given to commit_model (without
    the trailers), ``run`` the ``Gwenlake-Run`` trailer or None. Returns [] when the branch does not exist. Raises ConfigError on a bad
    model name.
    """
    split_model_name(model_name)
    with tempfile.TemporaryDirectory(prefix="gwenlake-read-") as tmpdir:
        reader = Reader(repo, model_name, Path(tmpdir))
        if rev(reader.tmp, reader.env, reader.ref) is None:
            return []
        # basic regexp; names hold only [A-Za-z0-9_-] and one '.', which must be escaped
        pattern = f"^{MODEL_TRAILER}: {model_name.replace('.', '[.]')}$"
        _, out, _ = reader.run("log", "--first-parent", "--no-show-signature", "--no-color",
                               "--encoding=UTF-8", "-z", "--format=%H%x1f%cI%x1f%B",
                               "--basic-regexp", f"--grep={pattern}", reader.ref, "--")
    versions = []
    for record in out.split(b"\0"):
        if not record.strip():
            continue
        sha, date, body = record.decode("utf-8", "replace").split("\x1f", 2)
        message, trailers = strip_trailers(body)
        if trailers.get(MODEL_TRAILER) != model_name:
            continue
        versions.append({"version": sha.strip(), "date": date, "message": message, "run": trailers.get(RUN_TRAILER)})
    return versions


def find_run_version(repo: git.Repo | PathLike, model_name: str, run: str) -> str | None:
    """The newest version of ``model_name`` committed with ``run=run`` (see :func:`commit_model`), or None."""
    for v in list_versions(repo, model_name):
        if v.get("run") == run:
            return str(v["version"])
    return None


def read_file(repo: git.Repo | PathLike, model_name: str, version: str, relpath: str) -> bytes:
    """Content of ``<group>/<name>/<relpath>`` at ``version`` (a commit SHA or ``'latest'``).

    Smudge filters of the version's .gitattributes apply (git-lfs gives the real content when
    git-lfs is installed). The user's work tree and index are not touched.
    Raises ConfigError on a bad model name, version or relpath, or when the file is missing.
    """
    rel = check_relpath(relpath, "read_file")
    with tempfile.TemporaryDirectory(prefix="gwenlake-read-") as tmpdir:
        reader = Reader(repo, model_name, Path(tmpdir))
        sha = reader.resolve(version)
        path = f"{reader.prefix}/{rel}"
        if reader.entry_type(sha, path) != "blob":
            raise ConfigError(f"model {model_name} version {sha[:12]} has no file {rel!r}")
        out_dir = Path(tmpdir) / "out"
        reader.checkout(sha, [os.fsencode(path)], out_dir)
        return (out_dir / path).read_bytes()


def export_version(repo: git.Repo | PathLike, model_name: str, version: str,
                   dest: PathLike) -> Path:
    """Write the files of ``<group>/<name>/`` at ``version`` into the new directory ``dest``.

    ``version`` is a commit SHA or ``'latest'``. ``dest`` must not exist or be an empty
    directory; its parents are created. Files are checked out into a staging directory next
    to ``dest`` and renamed into place, so ``dest`` appears complete or not at all. Smudge
    filters apply; the user's work tree and index are not touched. Returns ``dest``.
    Raises ConfigError on a bad model name or version, when the version has no files for the
    model, or when ``dest`` exists and is not an empty directory.
    """
    dest = Path(dest).expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"export destination {dest} already exists and is not an empty"
                          " directory")
    with tempfile.TemporaryDirectory(prefix="gwenlake-read-") as tmpdir:
        reader = Reader(repo, model_name, Path(tmpdir))
        sha = reader.resolve(version)
        if reader.entry_type(sha, reader.prefix) != "tree":
            raise ConfigError(f"model {model_name} version {sha[:12]} has no files under"
                              f" {reader.prefix}/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Same file system as dest, so the final rename is atomic.
        staging = Path(mkdtemp(dest.parent, prefix=f".{dest.name}.export-"))
        try:
            reader.checkout(sha, None, staging)
            # Callers treat an existing dest as a finished export and never export again (a job restarted
            # after a node failure reuses it), so the files must be on disk before the name appears: fsync
            # the tree, rename the folder (fsutil's routines replace files, not folders), fsync the parent.
            _fsync_tree(staging / reader.prefix)
            os.rename(staging / reader.prefix, dest)
            fsync_dir(dest.parent, best_effort=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _fsync_tree(root: Path) -> None:
    """fsync every regular file under ``root`` and every folder, ``root`` included (symlinks are not followed).

    Raises:
        OSError: a file cannot be opened or synced.
    """
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath, best_effort=True)  # as the export did without it, where a folder cannot be opened
