"""Model versions as git commits.

The final model of each training is committed to git; the SHA of that commit is the model's
version. Each model ``group.name`` has its own branch ``models/group.name`` whose commits hold
the model files under ``group/name/``. When the model repository is also the code repository,
a version's tree is the tree of the code commit that trained it plus the model files, so
``git checkout <version>`` gives back both.

Commits are built with git plumbing against a temporary index, so the user's working tree,
index, HEAD and current branch are never touched, and the branch is moved with a
compare-and-swap, so many jobs can commit versions of the same model at once.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

from .errors import ConfigError, GwenlakeError
from .fsutil import mkdtemp
from .signals import shield_children

with shield_children():  # GitPython runs `git version` on import: SLURM's warning (SIGUSR2) must not kill it
    import git

log = logging.getLogger("gwenlake_hpc.versioning")

__all__ = [
    "CodeState",
    "code_state",
    "default_model_repo",
    "open_model_repo",
    "model_branch",
    "model_prefix",
    "commit_model",
    "list_versions",
    "read_file",
    "export_version",
    "push_versions",
    "is_lfs_pointer",
    "LARGE_FILE_WARNING_BYTES",
    "FALLBACK_NAME",
    "FALLBACK_EMAIL",
    "MODEL_TRAILER",
    "CODE_TRAILER",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Identity used for version commits when git has none configured (fresh CI or compute nodes).
FALLBACK_NAME = "gwenlake_hpc"
FALLBACK_EMAIL = "gwenlake_hpc@localhost"
#: Trailer that marks a commit as a version of a model; list_versions keeps only these commits,
#: so the walk does not list the code commits a first version descends from.
MODEL_TRAILER = "Gwenlake-Model"
RUN_TRAILER = "Gwenlake-Run"
#: Trailer that records the code commit a version was trained from, even when that commit is
#: not in the model repository (separate model repository).
CODE_TRAILER = "Gwenlake-Code-Commit"

#: Size from which a weight file committed without git-lfs gets a warning (bytes); the
#: environment variable GWENLAKE_LFS_WARN_MB overrides it, commit_model's argument wins over both.
LARGE_FILE_WARNING_BYTES = 50 * 1024 * 1024
_LFS_SPEC = b"version https://git-lfs.github.com/spec/v1\n"
_LFS_POINTER_MAX = 1024  # git-lfs pointers are ~130 bytes; the spec caps them at 1024

_BRANCH_PREFIX = "models/"
_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\Z")
_HEX = re.compile(r"[0-9a-fA-F]{4,64}\Z")
_MODE_EXEC = "100755"
_MODE_FILE = "100644"
# Settings that would make a temporary index behave differently from a plain one (sparse
# directory entries, shared index files written into .git, a file-system monitor daemon).
_SAFE_CONFIG = (
    ("core.sparseCheckout", "false"),
    ("index.sparse", "false"),
    ("core.splitIndex", "false"),
    ("core.fsmonitor", "false"),
)


# --------------------------------------------------------------------------------------------
# git plumbing helpers


def _git(cwd: PathLike, env: Mapping[str, str], command: str, *args: str,
         stdin: bytes | None = None, ok: tuple[int, ...] = (0,)) -> tuple[int, bytes, str]:
    """Run one ``git <command> <args>`` process through GitPython.

    Returns (exit status, stdout bytes, stderr text).

    ``env`` is added to os.environ. stdin, when given, is passed through a temporary file.
    Raises GwenlakeError with git's stderr when the exit status is not in ``ok``.
    """
    runner = git.Git(os.fspath(cwd))
    kwargs = dict(env=dict(env), with_extended_output=True, with_exceptions=False,
                  stdout_as_string=False, strip_newline_in_stdout=False)
    call = getattr(runner, command)
    with shield_children():  # in a job step, SLURM's stop signals reach every process: not git's to die of
        if stdin is None:
            status, out, err = call(*args, **kwargs)
        else:
            with tempfile.TemporaryFile() as fh:
                fh.write(stdin)
                fh.seek(0)
                status, out, err = call(*args, istream=fh, **kwargs)
    if status not in ok:
        shown = " ".join(args)
        if len(shown) > 300:
            shown = shown[:300] + "..."
        raise GwenlakeError(
            f"git {command.replace('_', '-')} {shown} failed (exit {status}): {err.strip()}")
    return status, out or b"", err or ""


def _base_env(git_dir: str, work_tree: PathLike, index_file: PathLike) -> dict[str, str]:
    """Environment naming the repository, work tree and index explicitly.

    Explicit values win over GIT_DIR/GIT_INDEX_FILE inherited from a caller (a git hook, say).
    """
    env = {
        "GIT_DIR": git_dir,
        "GIT_WORK_TREE": os.fspath(work_tree),
        "GIT_INDEX_FILE": os.fspath(index_file),
        "GIT_LITERAL_PATHSPECS": "1",  # paths are names, never globs
        "GIT_OPTIONAL_LOCKS": "0",  # reads must not take index.lock from the user
        "GIT_TERMINAL_PROMPT": "0",
    }
    # Append our settings after any GIT_CONFIG_COUNT entries the caller already set.
    base = int(os.environ.get("GIT_CONFIG_COUNT", "0") or 0)
    for i, (key, value) in enumerate(_SAFE_CONFIG):
        env[f"GIT_CONFIG_KEY_{base + i}"] = key
        env[f"GIT_CONFIG_VALUE_{base + i}"] = value
    env["GIT_CONFIG_COUNT"] = str(base + len(_SAFE_CONFIG))
    return env


def _git_dir(repo: git.Repo) -> str:
    return os.path.abspath(repo.git_dir)


def _as_repo(repo: git.Repo | PathLike) -> git.Repo:
    if isinstance(repo, git.Repo):
        return repo
    return open_model_repo(repo, create=False)


def _rev(cwd: PathLike, env: Mapping[str, str], rev: str) -> str | None:
    """Full SHA of ``rev`` (a commit), or None when it does not resolve."""
    status, out, _ = _git(cwd, env, "rev_parse", "--verify", "--quiet", f"{rev}^{{commit}}",
                          ok=(0, 1, 128))
    return (out.decode().strip() or None) if status == 0 else None


def _cquote(path: str) -> bytes:
    """Quote a path for ``--stdin-paths`` (C style) when it holds characters git would unquote."""
    raw = os.fsencode(path)
    if not any(b < 0x20 or b in (0x22, 0x5C, 0x7F) for b in raw):
        return raw
    out = bytearray(b'"')
    for b in raw:
        if b in (0x22, 0x5C):
            out += b"\\" + bytes([b])
        elif b < 0x20 or b == 0x7F:
            out += b"\\%03o" % b
        else:
            out.append(b)
    return bytes(out + b'"')


# --------------------------------------------------------------------------------------------
# code state and repositories


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
        git_dir = _git_dir(repo)
        root = repo.working_tree_dir
        if root is None:  # bare repository: no work tree, nothing can be dirty
            env = _base_env(git_dir, git_dir, os.path.join(git_dir, "index"))
            return CodeState(Path(git_dir), _rev(git_dir, env, "HEAD"), False)
        env = _base_env(git_dir, root, os.path.join(git_dir, "index"))
        commit = _rev(root, env, "HEAD")
        _, out, _ = _git(root, env, "status", "--porcelain", "-z", "--untracked-files=no")
        return CodeState(Path(root), commit, bool(out.strip(b"\0")))


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
            return Path(repo.working_tree_dir or _git_dir(repo))
    except git.InvalidGitRepositoryError:
        pass
    with open_model_repo(base / "models", create=True) as repo:
        return Path(repo.working_tree_dir or _git_dir(repo))


# --------------------------------------------------------------------------------------------
# names


def _split_model_name(model_name: str) -> tuple[str, str]:
    if not isinstance(model_name, str):
        raise ConfigError(f"model name must be a string 'group.name', got {model_name!r}")
    parts = model_name.split(".")
    if len(parts) != 2 or not all(_NAME_PART.match(part) for part in parts):
        raise ConfigError(
            f"model name {model_name!r} must be 'group.name' where each part starts with a letter"
            " or digit followed by letters, digits, '_' or '-' (e.g. 'crm.churn')")
    if parts[1].lower() == "lock":
        # git refuses ref names ending in '.lock' (models/<group>.lock)
        raise ConfigError(f"model name {model_name!r}: the name part cannot be 'lock'")
    return parts[0], parts[1]


def model_branch(model_name: str) -> str:
    """Branch holding the versions of ``model_name``: ``'crm.churn'`` -> ``'models/crm.churn'``.

    Raises ConfigError unless ``model_name`` is ``group.name`` with each part matching
    ``[A-Za-z0-9][A-Za-z0-9_-]*`` (and the name part is not ``lock``, refused by git).
    """
    group, name = _split_model_name(model_name)
    return f"{_BRANCH_PREFIX}{group}.{name}"


def model_prefix(model_name: str) -> str:
    """Directory of the model's files in a version's tree: ``'crm.churn'`` -> ``'crm/churn'``.

    Raises ConfigError on a bad model name (see model_branch).
    """
    group, name = _split_model_name(model_name)
    return f"{group}/{name}"


def _check_relpath(rel: str, what: str) -> str:
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


# --------------------------------------------------------------------------------------------
# commit_model


@dataclass(frozen=True)
class _Entry:
    rel: str  # path relative to the model directory
    mode: str  # git file mode
    source: Path | None  # file of src_dir, or None for in-memory data
    data: bytes | None


def _collect_files(src_dir: PathLike, extra_files: Mapping[str, bytes] | None) -> list[_Entry]:
    """Files to commit: regular files of src_dir (recursively) overridden by extra_files."""
    src = Path(src_dir).expanduser()
    if not src.exists():
        raise ConfigError(f"model directory {src} does not exist")
    if not src.is_dir():
        raise ConfigError(f"model directory {src} is not a directory")
    entries: dict[str, _Entry] = {}

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
            rel = _check_relpath(Path(os.path.relpath(full, src)).as_posix(), str(src))
            # git records only the owner's execute bit
            mode = _MODE_EXEC if st.st_mode & stat.S_IXUSR else _MODE_FILE
            entries[rel] = _Entry(rel, mode, Path(full), None)
    for key, value in (extra_files or {}).items():
        rel = _check_relpath(os.fspath(key) if isinstance(key, os.PathLike) else key,
                             "extra_files")
        if isinstance(value, str):
            value = value.encode("utf-8")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"extra_files[{rel!r}] must be bytes, got {type(value).__name__}")
        entries[rel] = _Entry(rel, _MODE_FILE, None, bytes(value))
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


def _identity_env(cwd: PathLike, env: Mapping[str, str]) -> dict[str, str]:
    """GIT_AUTHOR_*/GIT_COMMITTER_* fallbacks for each field git has no configured value for.

    Configured means the environment variable itself, ``user.*``/``author.*``/``committer.*``
    in any git config file, or EMAIL for emails. One git process.
    """
    _, out, _ = _git(cwd, env, "config", "-z", "--get-regexp",
                     r"^(user|author|committer)\.(name|email)$", ok=(0, 1))
    configured = set()
    for item in out.split(b"\0"):
        key, _, value = item.partition(b"\n")
        if key and value.strip():
            configured.add(key.decode().lower())
    result = {}
    for role in ("author", "committer"):
        for field, fallback in (("name", FALLBACK_NAME), ("email", FALLBACK_EMAIL)):
            var = f"GIT_{role.upper()}_{field.upper()}"
            if os.environ.get(var) or {f"{role}.{field}", f"user.{field}"} & configured:
                continue
            if field == "email" and os.environ.get("EMAIL"):
                continue
            result[var] = fallback
    return result


def _read_blobs(cwd: PathLike, env: Mapping[str, str], specs: list[str]) -> list[bytes | None]:
    """Contents of ``<rev>:<path>`` specs in one ``cat-file --batch``; None when not a blob."""
    _, out, _ = _git(cwd, env, "cat_file", "--batch",
                     stdin=b"".join(os.fsencode(s) + b"\n" for s in specs))
    result: list[bytes | None] = []
    pos = 0
    for _ in specs:
        end = out.index(b"\n", pos)
        header = out[pos:end].split(b" ")
        pos = end + 1
        if len(header) == 3 and header[1] != b"missing":
            size = int(header[2])
            data = out[pos:pos + size]
            pos += size + 1  # content is followed by a newline
            result.append(data if header[1] == b"blob" else None)
        else:
            result.append(None)
    return result


_LFS_FILTER = (
    ("filter.lfs.clean", "git-lfs clean -- %f"),
    ("filter.lfs.smudge", "git-lfs smudge -- %f"),
    ("filter.lfs.process", "git-lfs filter-process"),
    ("filter.lfs.required", "true"),
)


def lfs_config_env(cwd: PathLike, env: Mapping[str, str]) -> dict[str, str]:
    """GIT_CONFIG_* entries naming the git-lfs filter when git has none configured.

    ``git lfs install`` writes these settings into a git config file; a compute node or CI
    image may have git-lfs without them. Configured values (any level) are kept. One git
    process. Returns {} when all are configured.
    """
    _, out, _ = _git(cwd, env, "config", "-z", "--get-regexp", r"^filter\.lfs\.", ok=(0, 1))
    configured = {item.partition(b"\n")[0].decode().lower() for item in out.split(b"\0") if item}
    missing = [(k, v) for k, v in _LFS_FILTER if k not in configured]
    if not missing:
        return {}
    base = int(env.get("GIT_CONFIG_COUNT", os.environ.get("GIT_CONFIG_COUNT", "0")) or 0)
    extra = {}
    for i, (key, value) in enumerate(missing):
        extra[f"GIT_CONFIG_KEY_{base + i}"] = key
        extra[f"GIT_CONFIG_VALUE_{base + i}"] = value
    extra["GIT_CONFIG_COUNT"] = str(base + len(missing))
    return extra


def is_lfs_pointer(data: bytes) -> bool:
    """True when ``data`` is a git-lfs pointer (spec v1: under 1 KB, ``version``, ``oid sha256:``,
    ``size`` lines) rather than real content."""
    return (len(data) < _LFS_POINTER_MAX and data.startswith(_LFS_SPEC)
            and b"\noid sha256:" in data and b"\nsize " in data)


def _smudge_pointers(cwd: PathLike, env: Mapping[str, str], out_dir: Path) -> int:
    """Replace each git-lfs pointer file under ``out_dir`` by its content; return how many.

    A version's tree may lack the .gitattributes that sent a file through git-lfs (a model
    repository whose attributes are only in its work tree), and then checkout-index writes the
    pointer. ``git lfs smudge`` reads the object from ``.git/lfs/objects`` or downloads it from
    the repository's LFS remote; it streams to the file, never through memory. One process per
    pointer (weight files, a handful per version).

    Raises:
        GwenlakeError: a pointer but no git-lfs installed, or git-lfs could not get the object
            (it is neither local nor on the remote).
    """
    count = 0
    for dirpath, _, filenames in os.walk(out_dir):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or path.stat().st_size >= _LFS_POINTER_MAX:
                continue
            pointer = path.read_bytes()
            if not is_lfs_pointer(pointer):
                continue
            if shutil.which("git-lfs") is None:
                raise GwenlakeError(f"{path.name} is stored with git-lfs but git-lfs is not installed;"
                                    " install it (Debian: apt-get install git-lfs) to read this version")
            tmp = path.with_name(f".{name}.smudge")
            # GIT_LFS_SKIP_SMUDGE=1 (common in CI clones) would make smudge echo the pointer back.
            smudge_env = {k: v for k, v in {**os.environ, **env}.items() if k != "GIT_LFS_SKIP_SMUDGE"}
            with open(tmp, "wb") as fh, shield_children():
                proc = subprocess.run(["git", "lfs", "smudge", "--", name], input=pointer, stdout=fh,
                                      stderr=subprocess.PIPE, cwd=cwd, env=smudge_env, timeout=3600)
            if proc.returncode != 0 or (tmp.stat().st_size < _LFS_POINTER_MAX and is_lfs_pointer(tmp.read_bytes())):
                tmp.unlink(missing_ok=True)
                raise GwenlakeError(f"git lfs smudge of {path.name} failed (exit {proc.returncode}):"
                                    f" {proc.stderr.decode(errors='replace').strip()[-500:] or 'it gave the pointer back'}")
            os.replace(tmp, path)
            count += 1
    return count


class _Builder:
    """Builds the tree and commit of one commit_model call inside a private temp directory."""

    def __init__(self, repo: git.Repo, model_name: str, files: list[_Entry], tmp: Path):
        self.group, self.name = _split_model_name(model_name)
        self.prefix = f"{self.group}/{self.name}"
        self.files = files
        self.tmp = tmp
        self.git_dir = _git_dir(repo)
        self.user_work_tree = repo.working_tree_dir
        self.empty = tmp / "empty"  # work tree of index commands: nothing in it, nothing read
        self.empty.mkdir()
        self.env = _base_env(self.git_dir, self.empty, tmp / "index-unused")
        self._count = 0
        self._blobs: dict[tuple, dict[str, str]] = {}
        self._attrs: dict[str, tuple] = {}
        self._trees: dict[tuple, str] = {}
        self.warn_bytes: int | None = LARGE_FILE_WARNING_BYTES
        self.lfs_paths: list[str] = []

    def run(self, command: str, *args: str, stdin: bytes | None = None,
            ok: tuple[int, ...] = (0,), env: Mapping[str, str] | None = None,
            cwd: PathLike | None = None) -> tuple[int, bytes, str]:
        return _git(cwd or self.empty, env or self.env, command, *args, stdin=stdin, ok=ok)

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
        found = _read_blobs(self.empty, self.env, [f"{base}:{n}" for n in names]) if base \
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
                          stdin=b"".join(_cquote(p) + b"\n" for p in paths))
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
    come from the base tree, falling back to the user's work tree (see _Builder.blobs). The
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
    group, name = _split_model_name(model_name)
    ref = f"refs/heads/{_BRANCH_PREFIX}{group}.{name}"
    if not isinstance(message, str) or not message.strip():
        raise ConfigError("commit_model: message must be a non-empty string")
    if code_commit is not None and (not isinstance(code_commit, str)
                                    or not _HEX.match(code_commit)):
        raise ConfigError(f"code_commit must be a hexadecimal commit id, got {code_commit!r}")
    if max_attempts < 1:
        raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
    repo = _as_repo(repo)
    files = _collect_files(src_dir, extra_files)

    with tempfile.TemporaryDirectory(prefix="gwenlake-commit-") as tmpdir:
        b = _Builder(repo, model_name, files, Path(tmpdir))
        if large_file_warning_bytes is None and os.environ.get("GWENLAKE_LFS_WARN_MB"):
            try:
                large_file_warning_bytes = int(float(os.environ["GWENLAKE_LFS_WARN_MB"]) * 1024 * 1024)
            except ValueError:
                raise ConfigError(f"GWENLAKE_LFS_WARN_MB={os.environ['GWENLAKE_LFS_WARN_MB']!r} must be a"
                                  " number of megabytes") from None
        if large_file_warning_bytes is not None:
            b.warn_bytes = large_file_warning_bytes
        env = dict(b.env, **_identity_env(b.empty, b.env))
        code_sha = _rev(b.empty, env, code_commit) if code_commit else None
        trailers = f"{MODEL_TRAILER}: {model_name}\n"
        if code_commit:
            trailers += f"{CODE_TRAILER}: {code_sha or code_commit.lower()}\n"
        if run:
            if "\n" in run:
                raise ConfigError(f"commit_model: run must be one line, got {run!r}")
            trailers += f"{RUN_TRAILER}: {run}\n"
        msg_file = Path(tmpdir) / "message"
        msg_file.write_bytes((message.rstrip() + "\n\n" + trailers).encode("utf-8"))

        last_error = ""
        for attempt in range(1, max_attempts + 1):
            tip = _rev(b.empty, env, ref)
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
            old = tip or "0" * len(new)  # all zeros: the branch must not exist yet
            status, _, err = b.run("update_ref", "-m", f"gwenlake_hpc: version of {model_name}",
                                   ref, new, old, ok=(0, 1, 128), env=env)
            if status == 0:
                return new
            last_error = err.strip()
            # Retry only when the ref moved or another job held its lock; anything else
            # (e.g. a branch named 'models' blocking 'models/...') is permanent.
            locked = ".lock': File exists" in last_error
            if _rev(b.empty, env, ref) == tip and not locked:
                raise GwenlakeError(f"cannot move branch {ref[len('refs/heads/'):]}: {last_error}")
            time.sleep(random.uniform(0.005, 0.03) * min(attempt, 10))
        raise GwenlakeError(
            f"could not commit a version of {model_name}: branch {ref[len('refs/heads/'):]} kept"
            f" moving or stayed locked for {max_attempts} attempts; last error: {last_error}")


# --------------------------------------------------------------------------------------------
# reading versions


def _strip_trailers(message: str) -> tuple[str, dict[str, str]]:
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

    ``run(command, *args)`` returns ``(status, stdout bytes, stderr text)``; see :func:`_git` for the options.
    """

    def __init__(self, repo: git.Repo | PathLike, tmp: Path):
        self.repo = _as_repo(repo)
        self.tmp = tmp
        self.env = _base_env(_git_dir(self.repo), tmp, tmp / "index")

    def run(self, command: str, *args: str, env: Mapping[str, str] | None = None,
            **kwargs: Any) -> tuple[int, bytes, str]:
        return _git(self.tmp, env or self.env, command, *args, **kwargs)


class _Reader(Plumbing):
    """Read-only access to one model's versions through a private temp index."""

    def __init__(self, repo: git.Repo | PathLike, model_name: str, tmp: Path):
        super().__init__(repo, tmp)
        self.model_name = model_name
        self.prefix = model_prefix(model_name)
        self.ref = "refs/heads/" + model_branch(model_name)

    def resolve(self, version: str) -> str:
        if version == "latest":
            sha = _rev(self.tmp, self.env, self.ref)
            if sha is None:
                raise ConfigError(f"model {self.model_name} has no versions yet (no branch"
                                  f" {self.ref[len('refs/heads/'):]})")
            return sha
        # Only hex ids: a version string must never be taken as an option or a revision range.
        if not isinstance(version, str) or not _HEX.match(version):
            raise ConfigError(f"version {version!r} of model {self.model_name} must be a commit"
                              " SHA (hexadecimal) or 'latest'")
        sha = _rev(self.tmp, self.env, version)
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
        _smudge_pointers(self.tmp, self.env, out_dir)


def list_versions(repo: git.Repo | PathLike, model_name: str) -> list[dict]:
    """Versions of ``model_name``, newest first: ``{"version", "date", "message", "run"}`` dicts.

    Walks the first parents of branch ``models/<group>.<name>`` and keeps the commits made by
    commit_model (those with a ``Gwenlake-Model: <model_name>`` trailer), so the code commits a
    first version descends from are not listed. ``version`` is the 40-hex SHA, ``date`` the
    committer date in strict ISO 8601, ``message`` the message given to commit_model (without
    the trailers), ``run`` the ``Gwenlake-Run`` trailer or None. Returns [] when the branch does not exist. Raises ConfigError on a bad
    model name.
    """
    _split_model_name(model_name)
    with tempfile.TemporaryDirectory(prefix="gwenlake-read-") as tmpdir:
        reader = _Reader(repo, model_name, Path(tmpdir))
        if _rev(reader.tmp, reader.env, reader.ref) is None:
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
        message, trailers = _strip_trailers(body)
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
    rel = _check_relpath(relpath, "read_file")
    with tempfile.TemporaryDirectory(prefix="gwenlake-read-") as tmpdir:
        reader = _Reader(repo, model_name, Path(tmpdir))
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
        reader = _Reader(repo, model_name, Path(tmpdir))
        sha = reader.resolve(version)
        if reader.entry_type(sha, reader.prefix) != "tree":
            raise ConfigError(f"model {model_name} version {sha[:12]} has no files under"
                              f" {reader.prefix}/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Same file system as dest, so the final rename is atomic.
        staging = Path(mkdtemp(dest.parent, prefix=f".{dest.name}.export-"))
        try:
            reader.checkout(sha, None, staging)
            os.rename(staging / reader.prefix, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------------------------
# pushing versions


#: Ref holding the alias log of a model (see gwenlake_hpc.registry); pushed with its branch.
ALIAS_REF_PREFIX = "refs/gwenlake/aliases/"


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
    repo = _as_repo(repo)
    with tempfile.TemporaryDirectory(prefix="gwenlake-push-") as tmpdir:
        tmp = Path(tmpdir)
        env = _base_env(_git_dir(repo), tmp, tmp / "index")
        env["GIT_LFS_SKIP_PUSH"] = "0"
        refs = [r for r in (branch, ALIAS_REF_PREFIX + model_name) if _rev_any(tmp, env, r)]
        if branch not in refs:
            raise ConfigError(f"model {model_name} has no versions to push (no branch {branch[11:]})")
        if shutil.which("git-lfs") is not None:
            env.update(lfs_config_env(tmp, env))
            _git(tmp, env, "lfs", "push", url, *refs)
        _git(tmp, env, "push", "--porcelain", url, *[f"{r}:{r}" for r in refs])
    return refs


def _rev_any(cwd: PathLike, env: Mapping[str, str], ref: str) -> str | None:
    status, out, _ = _git(cwd, env, "rev_parse", "--verify", "--quiet", ref, ok=(0, 1, 128))
    return (out.decode().strip() or None) if status == 0 else None
