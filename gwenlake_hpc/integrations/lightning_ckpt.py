"""The files of a Lightning training in the run's store: a distributed checkpoint folder, and the user's
``ModelCheckpoint``.

- A strategy with a distributed checkpoint (``ModelParallelStrategy()``, ``FSDPStrategy(state_dict_type=
  "sharded")``) makes ``trainer.save_checkpoint(path)`` write a folder at ``path`` (DCP: ``.metadata``,
  ``__<rank>_<n>.distcp`` of every rank, ``meta.pt``), every rank into rank 0's path (Lightning broadcasts it).
  :func:`record_folder` hashes, on each rank, the shards that rank wrote and records them in the checkpoint
  (``verify: on_load``, gathered to rank 0 by the Run as for ``save_state``'s shards); rank 0's other files are
  hashed by the seal. :func:`verify_folder` checks the shards before Lightning reads them, the ranks sharing the
  work: a damaged one is a :class:`DamagedFileError` on every rank (the job sets the checkpoint aside).
- The user's ``ModelCheckpoint(monitor=..., save_top_k=..., dirpath=...)`` is kept: Lightning writes its best-k
  files into ``dirpath`` and its state (``best_k_models``, ``best_model_score``) travels in the run's checkpoints;
  :func:`adopt_model_checkpoint` makes each of its saves a named checkpoint of the run's model as well (the
  weights, with the monitored value), removed when Lightning removes the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..base.errors import DamagedFileError
from ..stores.checkpoints.damage import entry_problem
from ..stores.checkpoints.digest import file_digest
from ..stores.checkpoints.manifest import MANIFEST
from ..stores.checkpoints.named import remove_named

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def record_folder(writer: Any, path: Path, rank: int) -> None:
    """Record in the open checkpoint the shards this rank wrote into the folder ``path`` (``ck.path(...)``) that
    ``trainer.save_checkpoint`` made; nothing for a file (the seal hashes it).

    Raises:
        OSError: a shard cannot be read.
    """
    pending = writer._pending
    real = pending.sharded_target(Path(path))  # rank 0's folder, where Lightning wrote every rank's shards
    if not real.is_dir():
        return
    for p in sorted(real.iterdir()):
        m = _SHARD.match(p.name)
        if m and int(m.group(1)) == rank and p.is_file():  # DCP's writer fsynced it
            pending.record_shard(p, p.stat().st_size, file_digest(p))


def verify_folder(run: Any, folder: Path) -> None:
    """Check the distributed checkpoint ``folder`` of the checkpoint resumed from against its manifest before
    Lightning reads it: every file listed, with its size; the shards' digests, each rank hashing its share.
    A collective in a multi-task run (every rank calls it).

    Raises:
        DamagedFileError: on every rank, when a rank found a file missing, changed, or not in the manifest.
    """
    ck = Path(run.resume_path)
    problem = None
    try:
        manifest = json.loads((ck / MANIFEST).read_text())
        files = manifest.get("files", {})
        alg_default = manifest.get("digest", "sha256")
        prefix = folder.relative_to(ck).as_posix() + "/"
        listed = sorted(rel for rel in files if rel.startswith(prefix))
        present = sorted(p.relative_to(ck).as_posix() for p in folder.rglob("*") if p.is_file())
        extra = sorted(set(present) - set(listed))
        if extra:
            problem = f"{ck / extra[0]} is not in {ck.name}'s manifest (a file added after the seal)"
        for i, rel in enumerate(listed):
            if problem is not None:
                break
            # the shards' digests shared among the ranks: each hashes every world_size-th file
            problem = entry_problem(ck, rel, files[rel], alg_default, hash_on_load=i % run.world_size == run.rank)
            if problem is not None:
                problem = f"{problem} in checkpoint {ck}"
    except (OSError, ValueError, KeyError) as exc:
        problem = f"{ck / MANIFEST} cannot be read ({type(exc).__name__}: {exc})"
    bad = run.dist.any(problem is not None) if run.dist.enabled else problem is not None
    if bad:
        raise DamagedFileError(problem or f"rank {run.rank}: another rank found a file of {folder} damaged "
                               "(see its log)", folder, ck)


def _named(run: Any, filepath: str) -> str:
    """The named checkpoint of a ModelCheckpoint's file: ``<run key>.<file stem>`` in the names' alphabet."""
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", Path(str(filepath)).name.removesuffix(".ckpt"))
    return f"{run.run_key}.{stem}"[:128]


def adopt_model_checkpoint(cb: Any, run: Any) -> None:
    """Keep the user's ``ModelCheckpoint`` ``cb`` (its top-k files in its ``dirpath``) and mirror each file it
    saves as a named checkpoint of the run's model (``gwenlake_hpc.checkpoint``: the module's weights, metadata
    ``monitor``, ``score``, ``step``, ``epoch``, ``file``), removed with the file.

    Its version counter is off: a resumed run saves the step it trains again under the same name (the same
    weights: the resume is exact), not as ``-v1`` beside it."""
    from ..runtime.current import checkpoint

    cb._enable_version_counter = False
    save, remove = cb._save_checkpoint, cb._remove_checkpoint

    def _save_checkpoint(trainer: Any, filepath: str) -> None:
        save(trainer, filepath)
        score = cb.current_score
        meta = {"monitor": cb.monitor, "score": None if score is None else float(score),
                "step": int(trainer.global_step), "epoch": int(trainer.current_epoch), "file": str(filepath)}
        checkpoint(trainer.lightning_module.state_dict(), path=_named(run, filepath), metadata=meta)

    def _remove_checkpoint(trainer: Any, filepath: str) -> None:
        remove(trainer, filepath)
        if run.is_main:
            remove_named(run.run_dir.parent, _named(run, filepath))

    cb._save_checkpoint, cb._remove_checkpoint = _save_checkpoint, _remove_checkpoint
