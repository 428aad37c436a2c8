"""The Output folder of a start: where it is, and the rule that a version holds only what the start that
finished wrote there.

A start that does not finish (evicted, killed, failed) may leave anything in ``<run_dir>/output``: a temporary
file of a write cut by a SIGKILL (``.model.safetensors.<random>.tmp``), half of a file the user wrote with a plain
``open()``, a file the finishing start would not write. The commit takes the folder whole, so each start empties
it before the training function is called, under the run's lock: what is committed is what the start that
finished wrote, whatever its names.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("gwenlake_hpc.job")


def output_dir(run_dir: Path, rank: int) -> Path:
    """The folder every ``Output`` binding of rank ``rank`` is bound to: ``<run_dir>/output`` on rank 0 (the one
    committed), ``<run_dir>/.ranks/rank-NNNNN/output`` on the others (identical models, a scratch folder)."""
    return run_dir / "output" if rank == 0 else run_dir / ".ranks" / f"rank-{rank:05d}" / "output"


def clear_unfinished(out: Path) -> list[str]:
    """Remove everything in ``out`` (the folder itself stays): what earlier starts that did not finish left there.

    Called with the run's lock held, before the training function: no other start writes there. Entries are
    removed without following symlinks (a symlink planted in the folder is unlinked, its target untouched).

    Returns:
        The names removed (relative to ``out``, sorted), logged at INFO; [] when the folder is empty or absent.

    Raises:
        OSError: an entry could not be removed (permissions): the start must not commit a mix.
    """
    if not out.is_dir() or out.is_symlink():
        return []
    removed = sorted(e.name for e in os.scandir(out))
    for name in removed:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if removed:
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        log.info("removed what an unfinished start left in %s (%s): a version holds only the files of the start "
                 "that finishes", out, shown)
    return removed
