"""What makes a sealed checkpoint's manifest damaged, decided before any file it names is opened.

A checkpoint folder is only ever made by renaming a partial folder whose ``MANIFEST.json`` was written by an
atomic replace (:mod:`.partial`), so a reader never sees a manifest half written: one that is not valid JSON, not
a JSON object, or lacks its fields (``step``, ``files``, each file's ``size`` and digest) is damaged, at once,
whatever a node's cache of the shared filesystem shows. The store sets such a checkpoint aside
(``.damaged-step-<n>-<id>``) as it does one whose files do not match their digests.

A manifest's file names are untrusted too: each must be a plain relative name inside the checkpoint folder
(no ``..``, no absolute path, no empty part) whose every part is a real file or folder, not a symbolic link
(a seal refuses symlinks, so one in a checkpoint was planted). Otherwise a resume would open, hash and load a
file outside the run (:func:`name_problem`). Then, once the names passed, :func:`entry_problem` says what is
wrong with one file against its entry (missing, size, digest): the store's check of a whole checkpoint and the
Lightning integration's check of a strategy's checkpoint folder. Imports nothing of the store: the store imports
this.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from .digest import entry_digest, file_digest

MANIFEST = "MANIFEST.json"


def manifest_problem(manifest: Any, step: int) -> str | None:
    """What is wrong with the parsed ``MANIFEST.json`` of folder ``step-<step>``, or None when it has the shape a
    seal writes: a JSON object naming ``step``, with ``files`` mapping each name to ``{"size": int >= 0,
    "digest": str}`` (format 1: ``"sha256"``). The run key is not checked here (another run's manifest is not
    damaged: the caller tells them apart)."""
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a JSON object"
    found = manifest.get("step")
    if isinstance(found, bool) or found != step:
        return f"{MANIFEST} names step {found!r}, its folder step {step}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"{MANIFEST} has no list of files"
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"{MANIFEST} gives {rel!r} no size"
        if not isinstance(entry.get("digest", entry.get("sha256")), str):
            return f"{MANIFEST} gives {rel!r} no digest"
    return None


def read_problem(folder: Path, run_key: str) -> str | None:
    """What makes the ``MANIFEST.json`` of the checkpoint folder ``folder`` (``step-<n>``) damaged as it is read
    now, without waiting: not valid JSON, not of the shape a seal writes (:func:`manifest_problem`), or another
    run's. None when it is readable and this run's, or when it cannot be read at all (no such file or folder: a
    node's cached view may not show it yet; the caller decides how long to wait for that). A folder that is a
    symbolic link is damaged too (a seal renames a real folder into place)."""
    if folder.is_symlink():
        return f"folder is a symbolic link (to {os.readlink(folder)}), not a checkpoint folder"
    path = folder / MANIFEST
    if path.is_symlink() or (path.exists() and not path.is_file()):  # a seal writes a regular file there
        return f"{MANIFEST} is {'a symbolic link' if path.is_symlink() else 'not a regular file'}"
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        return f"{MANIFEST} is not valid JSON ({len(raw)} bytes: {str(exc).split(':')[0]})"
    problem = manifest_problem(manifest, int(folder.name.rsplit("-", 1)[-1]))
    if problem is None and manifest.get("run_key") != run_key:
        return f"{MANIFEST} is run {manifest.get('run_key')!r}'s, not this run's ({run_key!r})"
    return problem


def name_problem(folder: Path, rel: Any) -> str | None:
    """Why the manifest's file name ``rel`` is not a plain relative name of a regular file inside the checkpoint
    folder ``folder``, or None. Each part of the path is looked at with ``lstat`` (a symbolic link is never
    followed); a part that does not exist is not a problem here (the caller reports the missing file).

    Never opens the file: a name leading out of the folder is refused before anything reads it.
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        return f"{MANIFEST} names a file {rel!r}, not a relative path inside the checkpoint folder"
    parts = rel.split("/")
    if rel.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"{MANIFEST} names {rel!r}, not a plain relative name inside the checkpoint folder (an absolute " \
               "path or a '..' leads out of it)"
    here = folder
    for part in parts:
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            return f"{here.relative_to(folder)} is a symbolic link (to {os.readlink(here)}); a checkpoint holds " \
                   "only regular files and folders"
    return None


def names_problem(folder: Path, files: Mapping[str, Any]) -> str | None:
    """The first :func:`name_problem` of the manifest's ``files``, or None when every name stays inside ``folder``."""
    for rel in files:
        problem = name_problem(folder, rel)
        if problem is not None:
            return problem
    return None


def entry_problem(folder: Path, rel: str, info: Mapping[str, Any], default_alg: str, hash_on_load: bool) -> str | None:
    """What is wrong with the file ``rel`` of the checkpoint ``folder`` against its manifest entry ``info``, or
    None: missing, another size (bytes), or another digest. A file marked ``verify: on_load`` is hashed only with
    ``hash_on_load`` (otherwise its reader checks it as it reads). ``rel`` must have passed :func:`name_problem`."""
    p = folder / rel
    if not p.is_file():
        return f"{rel} is missing"
    if p.stat().st_size != info["size"]:
        return f"{rel} has {p.stat().st_size} bytes, manifest says {info['size']}"
    if info.get("verify") == "on_load" and not hash_on_load:
        return None
    alg, digest = entry_digest(info, default_alg)
    if file_digest(p, alg) != digest:
        return f"{rel} does not match its {alg} digest"
    return None

