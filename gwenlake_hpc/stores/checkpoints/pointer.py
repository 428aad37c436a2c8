"""The run's pointer to its newest sealed checkpoint, ``checkpoints/LATEST.json``: read, moved, followed.

The pointer (``{"run_key", "step", "name", "manifest_digest"}``) is rewritten atomically after each seal. Read by
opening the file, it names a checkpoint that a node's cached directory listing may not show yet (NFS ``actimeo``,
FUSE ``cache_timeout``): :func:`follow` opens that checkpoint by its path, waiting up to
``checkpoint.visible_wait_s``. What it names may also be damaged, and is then set aside rather than waited for:

- a folder whose ``MANIFEST.json`` is not valid JSON, lacks its fields or is another run's: damaged at once (a
  manifest is written by an atomic replace before its folder is renamed into place, so no cache shows half of
  one); the folder is set aside (``.damaged-step-<n>-<id>``) and the pointer with it;
- a folder the server still does not have after the whole wait (by then the node's cached listing has expired),
  or one whose manifest is not the one the pointer recorded: the pointer itself is damaged and set aside
  (``.damaged-LATEST.json-<id>``, kept for inspection).

Either way the start resumes from the newest intact checkpoint of the listing, and the log says what was
damaged. A reader that must write nothing (a submission's check) only logs it. Imports nothing of the store: the
store passes itself (``store``: its ``root``, ``run_key``, ``open`` and ``set_aside_if_damaged``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ...base.fsutil import atomic_file, fsync_dir
from .damage import MANIFEST, read_problem
from .digest import file_digest

log = logging.getLogger("gwenlake_hpc.checkpoints")

#: The pointer's file name in the checkpoints folder.
POINTER = "LATEST.json"


def read(root: Path, run_key: str) -> dict[str, Any] | None:
    """The pointer in ``root``, read from the file's content, or None (no pointer, an unreadable one, or one
    another run key wrote)."""
    try:
        ptr = json.loads((root / POINTER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(ptr, dict) or ptr.get("run_key") != run_key or not isinstance(ptr.get("step"), int) or \
            ptr.get("name") != f"step-{ptr['step']:09d}" or not isinstance(ptr.get("manifest_digest"), str):
        return None
    return ptr


def write(root: Path, run_key: str, final: Path, step: int) -> None:
    """Make the pointer in ``root`` name the sealed checkpoint ``final`` of ``step`` (one atomic write)."""
    digest = file_digest(final / MANIFEST)
    with atomic_file(root / POINTER, "w") as fh:
        json.dump({"run_key": run_key, "step": step, "name": final.name, "manifest_digest": digest}, fh,
                  sort_keys=True)


def follow(store: Any, listed: list[Any], wait_s: float, repair: bool) -> Any:
    """The pointer's checkpoint when it is newer than everything ``listed`` and can be opened by its path (waiting
    up to ``wait_s`` for it to become visible), else None.

    A damaged target (see the module) is never waited for: it is logged and, with ``repair``, set aside (the
    folder when its manifest is damaged, else the pointer); the caller goes on with the listing.
    """
    ptr = read(store.root, store.run_key)
    if ptr is None or any(c.step >= ptr["step"] for c in listed):
        return None
    folder = store.root / ptr["name"]
    deadline = time.monotonic() + max(0.0, float(wait_s))
    while True:
        ck = store.open(ptr["name"])
        if ck is not None and file_digest(ck.path / MANIFEST) == ptr["manifest_digest"]:
            log.info("checkpoint %s is not in this node's listing of %s yet; found by the run's pointer",
                     ptr["name"], store.root)
            return ck
        problem = read_problem(folder, store.run_key)
        if problem is not None:  # damaged at once: no cache shows half a manifest
            _damaged(store, ptr, f"its {problem}", folder, repair)
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
    if wait_s > 0:  # the whole wait: this node's cached listing has expired, the server's answer stands
        waited = f"after {wait_s:g} s (checkpoint.visible_wait_s)"
        if ck is not None:  # a checkpoint of this run, but not the one sealed last: the pointer is wrong
            _damaged(store, ptr, "has another manifest than the one the pointer recorded", None, repair)
        elif folder.is_dir():  # a folder made by hand, or one whose manifest is gone
            _damaged(store, ptr, f"it has no {MANIFEST} {waited}", folder, repair)
        else:
            _damaged(store, ptr, f"is not on the shared filesystem {waited}", None, repair)
    return None


def _damaged(store: Any, ptr: dict[str, Any], why: str, folder: Path | None, repair: bool) -> None:
    """Log that the pointer's checkpoint is damaged and, with ``repair``, set aside ``folder`` (a damaged
    checkpoint folder; the store removes the pointer that names it) or, when None, the pointer itself."""
    pointer = store.root / POINTER
    what = f"{pointer} names checkpoint {ptr['name']} (step {ptr['step']}), which {why}" if folder is None else \
        f"checkpoint {folder} (named by {pointer}) is damaged: {why}"
    if not repair:
        log.warning("%s; the start sets it aside and resumes from the newest intact checkpoint", what)
        return
    if folder is not None:
        aside = store.set_aside_if_damaged(folder, why)
    else:
        aside = pointer.with_name(f".damaged-{POINTER}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(pointer, aside)
            fsync_dir(store.root, best_effort=True)
        except FileNotFoundError:  # another rank or start set it aside first
            aside = None
    log.warning("%s; set aside as %s, resuming from the newest intact checkpoint", what,
                aside.name if aside else "?")
