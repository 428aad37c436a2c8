"""Building the tree of a version: the model files collected, hashed through the repository's
``.gitattributes`` (git-lfs, eol) in one process, and laid over a base tree in a private index."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ...base.errors import ConfigError, GwenlakeError
from ...base.names import split_model_name
from .gitcmd import PathLike, base_env, cquote, git, git_dir, read_blobs, run_git
from .lfs import lfs_config_env
from .repo import check_relpath

log = logging.getLogger("gwenlake_hpc.versioning")  # one logger for the package: users filter on it

__all__ = ["LARGE_FILE_WARNING_BYTES", "Entry", "collect_files", "TreeBuilder"]

#: Size from which a weight file committed without git-lfs gets a warning (bytes); the
#: environment variable GWENLAKE_LFS_WARN_MB overrides it, commit_model's argument wins over both.
LARGE_FILE_WARNING_BYTES = 50 * 1024 * 1024
_MODE_EXEC = "100755"
_MODE_FILE = "100644"


@dataclass(frozen=True)
class Entry:
    """One file of a version: from src_dir (``source``) or given in memory (``data``)."""

    rel: str  # path relative to the model directory
    mode: str  # git file mode
    source: Path | None  # file of src_dir, or None for in-memory data
    data: bytes | None


def collect_files(src_dir: PathLike, extra_files: Mapping[str, bytes] | None) -> list[Entry]:
    """Files to commit: regular files of src_dir (recursively) overridden by extra_files."""
    src = Path(src_dir).expanduser()
    if not src.exists():
        raise ConfigError(f"model directory {src} does not exist")
    if not src.is_dir():
        raise ConfigError(f"model directory {src} is not a directory")
    entries: dict[str, Entry] = {}

    def fail(err: OSError) -> None:
        raise ConfigError(f"cannot read model directory {src}: {err}")

    for dirpath, dirnames, filenames in os.walk(src, onerror=fail):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                raise ConfigError(f"{full} is a symbolic link; model directories must hold"
                                  " regular files only (copy the target instead)")
        for f in filenames:
            full = os.path.join(dirpath, f)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                raise ConfigError(f"{full} is a symbolic link; model directories must hold"
                                  " regular files only (copy the target instead)")
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{full} is not a regular file")
            rel = check_relpath(Path(os.path.relpath(full, src)).as_posix(), str(src))
            # git records only the owner's execute bit
            mode = _MODE_EXEC if st.st_mode & stat.S_IXUSR else _MODE_FILE
            entries[rel] = Entry(rel, mode, Path(full), None)
    for key, value in (extra_files or {}).items():
        rel = check_relpath(os.fspath(key) if isinstance(key, os.PathLike) else key,
                             "extra_files")
        if isinstance(value, str):
            value = value.encode("utf-8")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"extra_files[{rel!r}] must be bytes, got {type(value).__name__}")
        entries[rel] = Entry(rel, _MODE_FILE, None, bytes(value))
    if not entries:
        raise ConfigError(f"model directory {src} holds no files and no extra_files were given;"
                          " nothing to commit")
    # A path cannot be both a file and a directory (e.g. extra 'a' and src 'a/b').
    dirs = {rel.rsplit("/", 1)[0] for rel in entries if "/" in rel}
    dirs |= {d.rsplit("/", i)[0] for d in list(dirs) for i in range(1, d.count("/") + 1)}
    clash = sorted(dirs & entries.keys())
    if clash:
        raise ConfigError(f"{clash[0]!r} is both a file and a directory in the model files")
    return sorted(entries.values(), key=lambda e: e.rel)


class TreeBuilder:
    """Builds the tree and commit of one commit_model call inside a private temp directory."""

    def __init__(self, repo: git.Repo, model_name: str, files: list[Entry], tmp: Path):
        self.group, self.name = split_model_name(model_name)
        self.prefix = f"{self.group}/{self.name}"
        self.files = files
        self.tmp = tmp
        self.git_dir = git_dir(repo)
        self.user_work_tree = repo.working_tree_dir
        self.empty = tmp / "empty"  # work tree of index commands: nothing in it, nothing read
        self.empty.mkdir()
        self.env = base_env(self.git_dir, self.empty, tmp / "index-unused")
        self._count = 0
        self._blobs: dict[tuple, dict[str, str]] = {}
        self._attrs: dict[str, tuple] = {}
        self._trees: dict[tuple, str] = {}
        self.warn_bytes: int | None = LARGE_FILE_WARNING_BYTES
        self.lfs_paths: list[str] = []

    def run(self, command: str, *args: str, stdin: bytes | None = None,
            ok: tuple[int, ...] = (0,), env: Mapping[str, str] | None = None,
            cwd: PathLike | None = None) -> tuple[int, bytes, str]:
        return run_git(cwd or self.empty, env or self.env, command, *args, stdin=stdin, ok=ok)

    def _new_path(self, stem: str) -> Path:
        self._count += 1
        return self.tmp / f"{stem}-{self._count}"

    def attributes(self, base: str | None) -> tuple[bytes | None, bytes | None]:
        """.gitattributes at the root and at ``<group>/`` that apply to the model files.

        Taken from the base commit's tree, or from the user's work tree where the base tree
        has none (a dedicated model repository whose first version has an empty base).
        """
        key = base or ""
        if key in self._attrs:
            return self._attrs[key]
        names = [".gitattributes", f"{self.group}/.gitattributes"]
        found = read_blobs(self.empty, self.env, [f"{base}:{n}" for n in names]) if base \
            else [None, None]
        for i, name in enumerate(names):
            if found[i] is None and self.user_work_tree:
                candidate = os.path.join(self.user_work_tree, name)
                if os.path.isfile(candidate) and not os.path.islink(candidate):
                    found[i] = Path(candidate).read_bytes()
        self._attrs[key] = (found[0], found[1])
        return self._attrs[key]

    def blobs(self, attrs: tuple[bytes | None, bytes | None]) -> dict[str, str]:
        """Hash and write every file in ONE ``hash-object -w --stdin-paths`` process.

        hash-object applies the attributes (filters such as git-lfs, eol conversion) of the
        path it is given, relative to the work tree. So we lay out a staging work tree where
        ``<group>/<name>/<rel>`` is a symlink to the source file (hash-object opens it through
        the link) and the .gitattributes files are real copies (git ignores symlinked ones);
        no per-file ``--path`` process is needed. Cached per attributes, so CAS retries do
        not rehash large models.
        """
        if attrs in self._blobs:
            return self._blobs[attrs]
        stage = self._new_path("stage")
        for rel_attr, content in zip((".gitattributes", f"{self.group}/.gitattributes"), attrs):
            if content is not None:
                (stage / rel_attr).parent.mkdir(parents=True, exist_ok=True)
                (stage / rel_attr).write_bytes(content)
        paths = []
        for entry in self.files:
            target = stage / self.prefix / entry.rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if entry.data is not None:
                target.write_bytes(entry.data)
            elif entry.rel.rsplit("/", 1)[-1] == ".gitattributes":
                shutil.copyfile(entry.source, target)
            else:
                os.symlink(os.path.abspath(entry.source), target)
            paths.append(f"{self.prefix}/{entry.rel}")
        env = dict(self.env, GIT_WORK_TREE=str(stage))
        env.update(self._lfs_check(stage, env, paths))
        # cwd must be the work tree top: paths and .gitattributes are looked up from there.
        _, out, _ = self.run("hash_object", "-w", "--stdin-paths", cwd=stage, env=env,
                          stdin=b"".join(cquote(p) + b"\n" for p in paths))
        shas = out.decode().split()
        if len(shas) != len(paths):
            raise GwenlakeError(f"git hash-object returned {len(shas)} ids for {len(paths)} files")
        shutil.rmtree(stage, ignore_errors=True)
        self._blobs[attrs] = dict(zip(paths, shas))
        return self._blobs[attrs]

    def _lfs_check(self, stage: Path, env: Mapping[str, str], paths: list[str]) -> dict[str, str]:
        """Which files the attributes send through git-lfs; extra env for hash-object.

        One ``git check-attr`` process. Files marked ``filter=lfs`` need git-lfs on PATH
        (GwenlakeError otherwise, before any blob is written: a 5 GB blob in history cannot
        be taken back); when git has no ``filter.lfs.*`` configured (no ``git lfs install``),
        the filter is named through GIT_CONFIG_* for our processes only. Other files of
        ``warn_bytes`` or more get a warning suggesting ``git lfs track``.
        """
        _, out, _ = self.run("check_attr", "-z", "--stdin", "filter", cwd=stage, env=env,
                             stdin=b"".join(os.fsencode(p) + b"\0" for p in paths))
        fields = out.split(b"\0")
        filters = {os.fsdecode(fields[i]): fields[i + 2].decode()
                   for i in range(0, len(fields) - 2, 3)}
        lfs = [p for p in paths if filters.get(p) == "lfs"]
        self.lfs_paths = lfs
        limit = self.warn_bytes
        for entry in self.files:
            path = f"{self.prefix}/{entry.rel}"
            if path in lfs:
                continue
            size = len(entry.data) if entry.data is not None else os.path.getsize(entry.source)
            if limit is not None and size >= limit:
                log.warning("%s is %.1f MB and the model repository does not store it with git-lfs: every"
                            " version adds it whole to the history. Track such files with `git lfs track"
                            " '*%s'` (a .gitattributes line `*%s filter=lfs diff=lfs merge=lfs -text`)",
                            path, size / 1e6, Path(entry.rel).suffix, Path(entry.rel).suffix)
        if not lfs:
            return {}
        if shutil.which("git-lfs") is None:
            raise GwenlakeError(
                f"the model repository's .gitattributes stores {lfs[0]} with git-lfs (filter=lfs), but"
                " git-lfs is not installed: install it (Debian: apt-get install git-lfs) and commit"
                " again; the model files were not changed")
        return lfs_config_env(self.empty, self.env)

    def tree(self, base: str | None) -> str:
        """Tree of ``base`` with ``<group>/<name>/`` replaced by the model files (temp index)."""
        attrs = self.attributes(base)
        key = (base, attrs)
        if key in self._trees:
            return self._trees[key]
        blobs = self.blobs(attrs)
        zero = "0" * len(next(iter(blobs.values())))
        env = dict(self.env, GIT_INDEX_FILE=str(self._new_path("index")))
        lines = []
        if base:
            self.run("read_tree", base, env=env)
            _, out, _ = self.run("ls_files", "-z", "--", self.prefix, env=env)
            # mode 0 removes the entry: the model directory is replaced, not merged
            lines += [b"0 " + zero.encode() + b"\t" + p + b"\0" for p in out.split(b"\0") if p]
        for entry in self.files:
            path = f"{self.prefix}/{entry.rel}"
            lines.append(f"{entry.mode} {blobs[path]}\t".encode() + os.fsencode(path) + b"\0")
        self.run("update_index", "-z", "--index-info", stdin=b"".join(lines), env=env)
        _, out, _ = self.run("write_tree", env=env)
        os.unlink(env["GIT_INDEX_FILE"])
        self._trees[key] = out.decode().strip()
        return self._trees[key]
