"""``torchrun`` whose exit status says an eviction: ``python -m gwenlake_hpc.launch.torchrun [torchrun's
arguments] -m gwenlake_hpc +job=...``.

torchrun's agent counts any worker exiting other than 0 as a failure: an evicted job's rank 0 exits 75 (its
checkpoint sealed), the agent then stops the other ranks and torchrun exits 1 (``ChildFailedError``), so a
script or scheduler that reruns on 75 never reruns. Its own exit status cannot say 75. This command runs
torchrun itself (``torch.distributed.run.main``, the same arguments, the same agent), with
``GWENLAKE_EXIT_STATUS_DIR`` set for the workers: each rank of ``python -m gwenlake_hpc`` records its exit status
there as it exits (:func:`gwenlake_hpc.runtime.distributed.record_exit_status`). Its exit status:

- torchrun's own where it succeeded (0) or failed for another reason;
- 75 where torchrun failed (``ChildFailedError``) or was stopped by a signal (``SignalException``: SLURM's
  SIGTERM to the whole step) and every rank of the last attempt that recorded a status recorded 75 (the ranks
  the agent killed after the first one exited record nothing: they had passed the job's end together, see
  ``teardown``), and every rank torchrun names as failed exited 75: a rank that crashed or was SIGKILLed is a
  failure (1), though the agent's SIGTERM then ended the others as evicted.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..runtime.distributed import EXIT_STATUS_DIR_ENV

#: The exit status of an evicted job (the checkpoint is sealed; rerun to resume).
EVICTED = 75


def statuses(folder: Path) -> dict[int, int]:
    """The exit statuses recorded in ``folder`` by the ranks of torchrun's last attempt: ``{rank: status}``
    (an unreadable record counts as a failure, 1)."""
    found: dict[int, dict[int, int]] = {}
    for path in Path(folder).iterdir():
        try:
            attempt, rank = (int(part) for part in path.name.split("-"))
        except ValueError:
            continue
        try:
            code = int(path.read_text().strip())
        except (OSError, ValueError):
            code = 1
        found.setdefault(attempt, {})[rank] = code
    return found[max(found)] if found else {}


def verdict(torchrun_status: int, recorded: dict[int, int], failed: dict[int, int] | None = None) -> int:
    """The exit status to report: :data:`EVICTED` where torchrun failed, every recorded rank exited 75 and
    every rank torchrun names as failed (``failed``: ``{rank: exitcode}`` of its ``ChildFailedError``; negative:
    killed by that signal) exited 75, else torchrun's. A rank that crashed or was SIGKILLed (the OOM killer) is a
    failure even where the agent's SIGTERM then made the others end as evicted."""
    if torchrun_status == 0 or not recorded or set(recorded.values()) != {EVICTED}:
        return torchrun_status
    if failed and set(failed.values()) != {EVICTED}:
        return torchrun_status
    return EVICTED


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see the module's
    docstring). torchrun's usage errors exit 2 from its own parser."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    folder = Path(tempfile.mkdtemp(prefix="gwenlake-exit-"))
    os.environ[EXIT_STATUS_DIR_ENV] = str(folder)  # the workers inherit the agent's environment
    try:
        failed: dict[int, int] = {}
        try:
            torchrun(list(sys.argv[1:] if argv is None else argv))
            status = 0
        except (ChildFailedError, SignalException) as exc:
            status = 1
            failed = {int(r): int(f.exitcode) for r, f in getattr(exc, "failures", {}).items()}
            print(f"torchrun: {type(exc).__name__}: {exc}".strip(), file=sys.stderr)
        recorded = statuses(folder)
        final = verdict(status, recorded, failed)
        if final != status:
            print(f"gwenlake_hpc: the ranks' exit statuses {dict(sorted(recorded.items()))}: evicted, exit "
                  f"{final} (rerun to resume)", file=sys.stderr)
        return final
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
