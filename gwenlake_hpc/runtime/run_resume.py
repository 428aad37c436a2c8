"""Where a Run resumes from, and the levels of checkpoints it writes to: :class:`RunResume`.

The Run builds one in ``__init__``; it owns:

- the levels: the shared one (``<run_dir>/checkpoints``, the Run's ``store``) and, with ``checkpoint.local_dir``,
  the node-local first level (rank 0 makes its folder, every rank takes rank 0's path; off when the ranks are on
  several nodes), rank 0's copier from the local level to the shared one, and the local level released at the
  end of a committed run;
- the resume choice: rank 0 removes the partials an interrupted writer left and chooses the newest intact
  checkpoint of either level by the resume rule (:func:`~gwenlake_hpc.stores.checkpoints.resume.resume_from`);
  every rank resumes from its choice;
- this rank's state in that checkpoint (rank 0's Run state, the other ranks' rank files; re-seeded on another
  number of ranks), checked against the loop's length when the loop begins, its RNG states restored there when
  the batch stream does not restore them.

It declares what it uses (the store, the process group, the run's key, folder and seed) and imports no Run;
the Run keeps the public resume facts (``resumed``, ``resume_path``, ``start_step``).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any, Callable

from ..base.errors import ConfigError
from ..stores.checkpoints import Checkpoint, CheckpointStore
from ..stores.checkpoints.levels import LEVELS, SharedCopier, drop_local, local_store
from ..stores.checkpoints.resume import resume_from
from .distributed import Dist
from .feed import is_plan
from .rng import rng_state, seed_everything, set_rng_state

log = logging.getLogger("gwenlake_hpc.run")


class RunResume:
    """The checkpoint a Run resumes from, this rank's state in it, and the Run's checkpoint levels.

    Args:
        store: the shared level's store (``<run_dir>/checkpoints``).
        dist: this process's place in a multi-task run.
        run_dir: the run directory; run_key: the run's key.
        seed: the run's seed (a rank re-seeded on another number of ranks draws from ``seed + rank``).
        resume: ``"auto"`` or ``"never"`` (``job.resume``).
        local_dir: the run's folder on a node-local first level, or None.

    Attributes:
        local: the node-local level's store, or None (off, or ranks on several nodes).
        checkpoint: the checkpoint chosen (None: from step 0).
        state: this rank's state in it (None without one).
        copier: rank 0's copier to the shared level (with a local level), else None.

    Raises:
        ConfigError: ``resume`` is ``never`` and the store already holds checkpoints of this run.
        RuntimeError: a rank other than 0 cannot read the checkpoint rank 0 chose.
    """

    def __init__(self, store: CheckpointStore, dist: Dist, run_dir: Path, run_key: str, seed: int, resume: str,
                 local_dir: Path | None):
        self.store, self.dist, self.run_dir, self.run_key, self.seed = store, dist, run_dir, run_key, seed
        self._copy_resumed: Checkpoint | None = None  # a local checkpoint resumed from, to copy when the loop begins
        self.local = self._local_level(local_dir)
        latest = self._choose_checkpoint(resume)
        self.checkpoint: Checkpoint | None = latest
        self.state = self._own_state(latest) if latest else None
        self.copier = self._copier(latest)

    def _choose_checkpoint(self, resume: str) -> Checkpoint | None:
        """The checkpoint this run resumes from (None: from step 0).

        Rank 0 removes the partial checkpoints an interrupted writer left, and chooses the newest complete one
        (setting damaged ones aside) by the resume rule (:func:`~gwenlake_hpc.stores.checkpoints.resume.resume_from`);
        every rank resumes from its choice.

        Raises:
            ConfigError: ``resume`` is ``never`` and the store already holds checkpoints of this run.
            RuntimeError: a rank other than 0 cannot read the checkpoint rank 0 chose.
        """
        latest = None
        if self.dist.is_main:
            removed = self.store.clean_partials() + (self.local.clean_partials() if self.local else [])
            if removed:
                log.info("removed %d partial checkpoint(s) left by an interrupted writer", len(removed))
            latest = resume_from(self.store, resume, verify=True, local=self.local)
            if latest is not None and self.local is not None and latest.path.parent == self.local.root:
                log.info("resuming from the node-local level: %s is newer than the shared level's newest", latest.path)
        name, near = self.dist.broadcast((latest.path.name, latest.path.parent != self.store.root) if latest
                                         else (None, False))
        if not self.dist.is_main and name is not None:
            latest = (self.local if near and self.local else self.store).open(name)
            if latest is None:
                raise RuntimeError(f"rank {self.dist.rank}: checkpoint {name} chosen by rank 0 is not readable here; "
                                   "is the run directory on a filesystem shared by all nodes?")
        return latest

    def _local_level(self, local_dir: Path | None) -> CheckpointStore | None:
        """The store of the node-local first level (rank 0 makes its folder; every rank takes rank 0's path), or
        None: off, or ranks on several nodes (a checkpoint of several nodes' ranks is one folder they all write
        into: the shared one). Without a local level, rank 0 removes a levels' record an earlier start left."""
        if self.dist.enabled:
            local_dir = self.dist.broadcast(local_dir)
            host = socket.gethostname()
            if local_dir is not None and self.dist.any(self.dist.broadcast(host) != host):
                if self.dist.is_main:
                    log.info("checkpoint.local_dir is not used: this run's ranks are on several nodes, and each "
                             "checkpoint is one folder they all write into (the shared level)")
                local_dir = None
        if local_dir is None:
            if self.dist.is_main:
                (self.store.root / LEVELS).unlink(missing_ok=True)  # no local level now: nothing to show
            return None
        if self.dist.is_main:
            return local_store(Path(local_dir), self.run_dir, self.run_key)
        return CheckpointStore(Path(local_dir) / "checkpoints", self.run_key)

    def _copier(self, latest: Checkpoint | None) -> SharedCopier | None:
        """Rank 0's copier to the shared level (with a local level). A resume from a local checkpoint newer than
        the shared level's newest has it copied once the loop begins (after the training loaded it: a file
        damaged since its seal is found by ``load_state`` first)."""
        if self.local is None or not self.dist.is_main:
            return None
        shared = self.store.complete()
        copier = SharedCopier(self.local, self.store, shared[-1].step if shared else None)
        if latest is not None and latest.path.parent == self.local.root and \
                (copier.shared_step is None or latest.step > copier.shared_step):
            self._copy_resumed = latest
        return copier

    def _own_state(self, ck: Checkpoint) -> dict[str, Any]:
        """This rank's state from a checkpoint: rank 0's is the Run state, the others' their rank files."""
        rank, world_size = self.dist.rank, self.dist.world_size
        state = ck.run_state()
        if rank == 0 and state.get("world_size", 1) == world_size:
            return state
        mine = ck.rank_state(rank) if rank else state
        if mine is None or state.get("world_size", 1) != world_size:
            log.warning("checkpoint %s was written by %s rank(s), this run has %d: rank %d's RNG is re-seeded "
                        "and the rest of the epoch is split among the new ranks, so the resumed run is not "
                        "identical to an uninterrupted one",
                        ck.path.name, state.get("world_size", 1), world_size, rank)
            seed_everything(self.seed + rank)
            return {**{k: v for k, v in state.items() if k != "rng_epoch_start"}, "rng": rng_state()}
        if mine is not state and "rng_epoch_start" not in mine:
            state = {k: v for k, v in state.items() if k != "rng_epoch_start"}  # rank 0's, not this rank's
        return {**state, **mine}

    def copy_resumed(self) -> None:
        """As the loop begins (the training has loaded it by now): a resume from a local checkpoint newer than the
        shared level's newest has it copied to the shared level."""
        if self._copy_resumed is not None and self.copier is not None:
            self.copier.submit(self._copy_resumed, None)
            self._copy_resumed = None

    def begin_loop(self, batches: Any, total: int, per_epoch: int | None, by_epochs: bool) -> dict[str, Any] | None:
        """Check the resume against the loop's length, restore the RNG states where the batch stream does not,
        and say where the training starts. Returns the state the batch stream restores (None: nothing to restore
        there).

        Raises:
            ConfigError: a resume with another number of ranks under ``job.epochs`` (``by_epochs``).
        """
        world_size, start_step = self.dist.world_size, self.checkpoint.step if self.checkpoint else 0
        was = (self.state or {}).get("world_size", 1)
        if self.state is not None and by_epochs and was != world_size:
            # An epoch is len(batches) // world_size steps: another number of ranks changes the run's length.
            raise ConfigError(f"this run's checkpoints were written by {was} rank(s) and this job has "
                              f"{world_size}: with job.epochs the number of steps depends on it; run it with "
                              f"{was} task(s), or set job.steps, or start a new run (job.model=...)")
        resume = self.state
        if resume is not None and (batches is None or start_step >= total
                                   or (is_plan(batches) and per_epoch)):
            set_rng_state(resume["rng"])  # else the stream restores it, see feed.batch_stream
            resume = None
        if self.checkpoint is not None:
            log.info("resuming from step %d (%s)", start_step, self.checkpoint.path)
        elif self.dist.is_main:  # say where it looked: a mistyped paths.runs_root would otherwise start over silently
            log.info("no checkpoint of this run in %s: training from step 0", self.store.root)
        return resume

    def release_local_level(self, wait: Callable[..., Any]) -> None:
        """At the end of a run whose version is committed (rank 0): wait for the copy of the newest checkpoint
        (``wait``: the Run's checkpoints' ``wait``), then remove the run's local level. Nothing when the shared
        level lacks the newest (a failed copy: the local one stays for a resume)."""
        copier = self.copier
        if copier is None or self.local is None:
            return
        wait(raise_error=False)
        kept = self.local.complete()  # a newest one found damaged while copied was set aside
        if not kept or (copier.shared_step is not None and copier.shared_step >= kept[-1].step):
            drop_local(self.local, self.store)
