"""A sealed checkpoint as it lies on disk: its names, its manifest's format, and :class:`Checkpoint`, its reader.

Layout under ``<run_dir>/checkpoints/``::

    step-000001000/            a complete checkpoint: the function's files, the Run's state, MANIFEST.json
    .partial-000002000-<id>/   being written (or left by a killed process); never read as a checkpoint

This module owns the names the writer (:mod:`.partial`) and the store (:mod:`.store`) share: ``MANIFEST.json``,
the partial's mark, the Run's state files (``gwenlake-run-state.json``, one file a rank under
``gwenlake-ranks/``), the folder names (:data:`COMPLETE_RE`, :data:`PARTIAL_RE`), and the format:

Manifest format 2 (this version) records ``digest`` (the algorithm, XXH3-128) and per file ``size`` and
``digest``; format 1 manifests (sha256) still load. A manifest or state file of a newer format is refused with
:class:`CheckpointFormatError` (exit 2) instead of being misread (:func:`check_format`, :func:`writer_version`).
:func:`manifest_entry` reads what the manifest of the checkpoint holding a file says of it (``load_state``).
Imports nothing of the writer or the store: both import this.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ...base.errors import CheckpointFormatError
from .digest import entry_digest

MANIFEST = "MANIFEST.json"
PARTIAL_MARK = ".gwenlake-partial"
RUN_STATE = "gwenlake-run-state.json"
#: Per-rank state of a multi-task run (RNG, data position): ``gwenlake-ranks/rank-00001.json``.
RANKS_DIR = "gwenlake-ranks"
#: Manifest format written by this version; a reader refuses a larger one.
FORMAT = 2
#: A sealed checkpoint's folder name, ``step-<n>``.
COMPLETE_RE = re.compile(r"^step-(\d{9,})$")
#: A partial checkpoint's folder name, ``.partial-<n>-<id>``.
PARTIAL_RE = re.compile(r"^\.partial-(\d{9,})-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk.

    Attributes:
        path: its directory.
        step: the number of training steps completed when it was written (1-based steps, so step k means
            steps 1..k are done).
        manifest: the parsed MANIFEST.json (``files``: relative path -> {size, sha256}, ``metrics``,
            ``created`` as Unix seconds).
    """

    path: Path
    step: int
    manifest: Mapping[str, Any] = field(repr=False)

    @property
    def metrics(self) -> dict[str, float]:
        """Metrics attached when it was written (``ck.metrics``), empty if none."""
        return dict(self.manifest.get("metrics") or {})

    def run_state(self) -> dict[str, Any]:
        """The Run's own state saved with it (step, epoch, data position, RNG states, tracking run id)."""
        return json.loads((self.path / RUN_STATE).read_text())

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        """The state rank ``rank`` of a multi-task run saved with it (RNG, data position), or None."""
        p = self.path / rank_state_name(rank)
        return json.loads(p.read_text()) if p.is_file() else None


def rank_state_name(rank: int) -> str:
    """Relative path of rank ``rank``'s state inside a checkpoint."""
    return f"{RANKS_DIR}/rank-{int(rank):05d}.json"


@functools.lru_cache(maxsize=1)
def writer_version() -> str:
    """``gwenlake_hpc <version>``, recorded in manifests and state files (read once per process: the package
    metadata lookup costs milliseconds, inside every checkpoint block)."""
    try:
        from importlib.metadata import version

        return f"gwenlake_hpc {version('gwenlake_hpc')}"
    except Exception:  # not installed as a distribution (a bare checkout on PYTHONPATH)
        return "gwenlake_hpc (unknown version)"


def check_format(found: Any, known: int, what: str, writer: Any) -> None:
    """Refuse ``found`` > ``known`` with a :class:`CheckpointFormatError` naming ``what`` and its ``writer``."""
    if isinstance(found, int) and found > known:
        raise CheckpointFormatError(
            f"{what} has format {found}, written by {writer or 'a newer gwenlake_hpc'}; this {writer_version()} "
            f"reads formats up to {known}: run the job with the gwenlake_hpc version that wrote it or a newer one "
            "(update the commit the job is pinned to)")


def manifest_entry(path: str | os.PathLike) -> tuple[Path, str, str, int] | None:
    """What the manifest of the complete checkpoint holding ``path`` says of it, if it is in one.

    Returns:
        ``(checkpoint directory, algorithm, hex digest, size)``, or None when ``path`` is not a file listed
        in the manifest of a ``step-<n>`` directory among its parents.

    Raises:
        CheckpointFormatError: the manifest is of a newer format.
    """
    p = Path(path).absolute()
    for parent in p.parents:
        if not COMPLETE_RE.match(parent.name):
            continue
        try:
            manifest = json.loads((parent / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        check_format(manifest.get("format"), FORMAT, f"checkpoint manifest {parent / MANIFEST}", manifest.get("writer"))
        info = manifest.get("files", {}).get(p.relative_to(parent).as_posix())
        if info is None:
            return None
        alg, digest = entry_digest(info, manifest.get("digest", "sha256"))
        return parent, alg, digest, int(info["size"])
    return None
