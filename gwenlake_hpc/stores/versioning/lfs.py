"""git-lfs in model repositories: naming the filter when git has none configured, pointers, smudging them.

Weight files the repository's ``.gitattributes`` mark ``filter=lfs`` are committed as pointer blobs (< 1 KB)
by git's own ``hash-object`` (see :mod:`.tree`); readers turn pointers back into content here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping

from ...base.errors import GwenlakeError
from ...base.fsutil import mkstemp, publish
from .gitcmd import PathLike, run_git, stream_git

__all__ = ["LFS_POINTER_MAX", "lfs_config_env", "is_lfs_pointer", "smudge_pointers"]

_LFS_SPEC = b"version https://git-lfs.github.com/spec/v1\n"
#: git-lfs pointers are ~130 bytes; the spec caps them at 1024.
LFS_POINTER_MAX = 1024

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
    _, out, _ = run_git(cwd, env, "config", "-z", "--get-regexp", r"^filter\.lfs\.", ok=(0, 1))
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
    return (len(data) < LFS_POINTER_MAX and data.startswith(_LFS_SPEC)
            and b"\noid sha256:" in data and b"\nsize " in data)


def smudge_pointers(cwd: PathLike, env: Mapping[str, str], out_dir: Path) -> int:
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
            if path.is_symlink() or path.stat().st_size >= LFS_POINTER_MAX:
                continue
            pointer = path.read_bytes()
            if not is_lfs_pointer(pointer):
                continue
            if shutil.which("git-lfs") is None:
                raise GwenlakeError(f"{path.name} is stored with git-lfs but git-lfs is not installed;"
                                    " install it (Debian: apt-get install git-lfs) to read this version")
            # GIT_LFS_SKIP_SMUDGE=1 (common in CI clones) would make smudge echo the pointer back.
            smudge_env = {k: v for k, v in {**os.environ, **env}.items() if k != "GIT_LFS_SKIP_SMUDGE"}
            fd, tmp = mkstemp(path.parent, prefix=f".{name}.", suffix=".smudge")
            try:
                with os.fdopen(fd, "wb") as fh:
                    proc = stream_git(cwd, smudge_env, ["lfs", "smudge", "--", name], pointer, fh, timeout_s=3600)
                size = os.stat(tmp).st_size
                if proc.returncode != 0 or (size < LFS_POINTER_MAX and is_lfs_pointer(Path(tmp).read_bytes())):
                    why = proc.stderr.decode(errors="replace").strip()[-500:] or "it gave the pointer back"
                    raise GwenlakeError(f"git lfs smudge of {path.name} failed (exit {proc.returncode}): {why}")
                publish(tmp, path)  # git-lfs wrote the file: fsync, rename over the pointer, fsync the folder
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            count += 1
    return count
