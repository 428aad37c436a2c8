"""The Output folder of a start: where it is, and the rule that a version holds only what the start that
finished wrote there.

A start that does not finish (evicted, killed, failed) may leave anything in ``<run_dir>/output``: a temporary
file of a write cut by a SIGKILL (``.model.safetensors.<random>.tmp``), half of a file the user wrote with a plain
``open()``, a file the finishing start would not write. The commit takes the folder whole. So each start notes,
under the run's lock and before the training function runs, every entry already there (:func:`entries`: its
inode, size and change time); before the commit, every entry still exactly as noted (nothing of this start
wrote it) is removed (:func:`drop_unfinished`). What is committed is what the start that finished wrote, whatever
its names; a start refused before its end (a bad setting) changes nothing in the folder.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("gwenlake_hpc.job")

#: An entry's identity: (inode, size in bytes, change time in ns). A write of this start changes it: a rename into
#: place gives another inode, a write in place another size or ctime.
Identity = tuple[int, int, int]


def output_dir(run_dir: Path, rank: int) -> Path:
    """The folder every ``Output`` binding of rank ``rank`` is bound to: ``<run_dir>/output`` on rank 0 (the one
    committed), ``<run_dir>/.ranks/rank-NNNNN/output`` on the others (identical models, a scratch folder)."""
    return run_dir / "output" if rank == 0 else run_dir / ".ranks" / f"rank-{rank:05d}" / "output"


def entries(out: Path) -> dict[str, Identity]:
    """Every file, link and folder under ``out`` now, by path relative to it, with its identity (links not
    followed); {} when the folder is absent."""
    found: dict[str, Identity] = {}
    if not out.is_dir() or out.is_symlink():
        return found
    for root, dirs, files in os.walk(out):
        for name in dirs + files:
            path = Path(root) / name
            st = path.lstat()
            found[str(path.relative_to(out))] = (st.st_ino, st.st_size, st.st_ctime_ns)
    return found


def drop_unfinished(out: Path, before: dict[str, Identity]) -> list[str]:
    """Remove from ``out`` every file or link that is still as :func:`entries` found it when this start began
    (an earlier start's, untouched since), then the folders left empty that were there then. Called before the
    commit, with the run's lock held.

    Returns:
        The relative paths removed, sorted (logged at INFO); [].

    Raises:
        OSError: an entry could not be removed (permissions): the start must not commit a mix.
    """
    now = entries(out)
    stale = sorted(rel for rel, ident in now.items()
                   if before.get(rel) == ident and ((out / rel).is_symlink() or not (out / rel).is_dir()))
    for rel in stale:
        (out / rel).unlink()
    for rel in sorted((r for r in before if r in now and (out / r).is_dir() and not (out / r).is_symlink()),
                      key=lambda r: -r.count(os.sep)):
        if not any((out / rel).iterdir()):
            shutil.rmtree(out / rel)
            stale.append(rel + "/")
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        log.info("removed what an unfinished start left in %s (%s): a version holds only the files of the start "
                 "that finishes", out, shown)
    return sorted(stale)
