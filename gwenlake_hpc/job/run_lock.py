"""One start trains a run at a time: the run's lock, taken by the job before anything of the run is written.

- :class:`RunLock`: an exclusive ``flock`` on ``<run_dir>/.lock`` (the fast first line), then the run's lease
  (:class:`gwenlake_hpc.base.lease.Lease`, what holds across nodes), both held while the job runs; the holder
  (pid and host) written into ``.lock`` for the refusal of a second start and for ``report``
  (:meth:`RunLock.may_be_held`);
- the run directory made as the lock is opened, retried while this node's cache of the shared filesystem
  still shows a folder deleted elsewhere (:data:`STALE_DIR_WAIT_S`).

The job (:mod:`gwenlake_hpc.job.execute`) takes it on rank 0 for all ranks.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from ..base.errors import ConfigError
from ..base.fsutil import open_append, refuse_symlinks
from ..base.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S
from ..base.lease import Lease, holder_gone, read_holder
from ..base.processes import pid_gone

log = logging.getLogger("gwenlake_hpc.job")


class RunLock:
    """One start trains a run at a time: an exclusive ``flock`` on ``<run_dir>/.lock``, then the run's lease
    (:class:`gwenlake_hpc.base.lease.Lease`), both held while the job runs.

    ``flock`` is the fast first line: on a local disk and on NFS with lock support it refuses a second process
    at once. Where the filesystem refuses locks (ENOLCK) the job goes on with a warning; where ``flock`` is local
    to a node (BeeGFS, Lustre ``localflock``, FUSE) the lease, taken by an atomic create on the server, is what
    holds across nodes, and its fence refuses every write of a start that lost it.

    Args:
        run_dir: the run directory.
        wait_s: seconds to wait for the ``flock`` and the lease of a live holder; None: 0 for a first start,
            ``max(180, 2 x lease_timeout_s)`` for a requeued SLURM start (the lock or lease of its lost node
            may outlive it that long). ``job.lease_wait_s`` when set.
        lease_timeout_s: ``job.lease_timeout_s``, seconds without renewal after which a lease is broken.
        on_lost: called once with the reason if this start's lease is found taken (the job requests a stop).

    Raises:
        ConfigError: another process holds the run (its host and pid are named), or the lease is held by a live
            start (:class:`~gwenlake_hpc.base.lease.RunHeldError`, naming it).
    """

    def __init__(self, run_dir: Path, wait_s: float | None = None, lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
                 on_lost: Any = None):
        import fcntl

        if wait_s is None:
            # A requeued SLURM job may start while the lock of its lost node has not expired yet (NFS leases
            # last about 90 s): wait for it there; locally, a second process is refused at once.
            requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
            wait_s = max(180.0, 2.0 * float(lease_timeout_s)) if requeued else 0.0
        self._fh = _open_lock(run_dir)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(2.0)
                    continue
                self._fh.seek(0)
                holder = self._fh.read().strip() or "another process"
                self._fh.close()
                raise ConfigError(f"run {run_dir} is being trained by {holder}; wait for it to end (two processes "
                                  "on one run would fork its checkpoints and its MLflow curve)") from None
            except OSError as exc:
                log.warning("cannot lock %s (%s): the run's lease alone keeps a second start out", run_dir, exc)
                break
        try:
            self.lease = Lease(run_dir, timeout_s=lease_timeout_s, wait_s=max(0.0, deadline - time.monotonic()),
                               facts={"slurm_job_id": os.environ.get("SLURM_JOB_ID", "")},
                               on_lost=on_lost).acquire()
        except BaseException:
            self._fh.close()
            raise
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._fh.flush()

    def release(self) -> None:
        self.lease.release()
        self._fh.close()  # closing drops the flock

    @staticmethod
    def may_be_held(run_dir: Path) -> bool:
        """Whether a process may be training ``run_dir`` now: the last holder named in ``.lock`` runs on another
        host (it cannot be seen from here) or is alive on this one. False when no process ever held it or its
        holder on this host is gone. Reads only: probing the flock itself could refuse a start at that moment.
        The run's lease, when there is one, names the holder (a lease released at a start's end is gone)."""
        lease = read_holder(run_dir)
        if lease is not None and lease.token:
            return not holder_gone(lease)
        try:
            m = re.fullmatch(r"pid (\d+) on (\S+)", (run_dir / ".lock").read_text().strip())
        except OSError:
            return False
        if m is None:
            return False
        return m.group(2) != socket.gethostname() or not pid_gone(int(m.group(1)))


#: Seconds a start retries its run directory that this node's cache shows but the server no longer has (deleted
#: from another node): NFS's ``acdirmax`` is 60 s by default.
STALE_DIR_WAIT_S = 90.0


def _open_lock(run_dir: Path) -> Any:
    """Open ``<run_dir>/.lock``, making the folder. A folder deleted on the shared filesystem from elsewhere that
    this node's cache still shows cannot be made again until the cache expires: retried for
    :data:`STALE_DIR_WAIT_S`.

    Raises:
        ConfigError: still not possible after that.
    """
    deadline = time.monotonic() + STALE_DIR_WAIT_S
    while True:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            refuse_symlinks(run_dir)  # again as the lock is taken: a link planted since the plan is refused too
            return open_append(run_dir / ".lock", read=True)  # O_NOFOLLOW
        except FileNotFoundError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"cannot make the run directory {run_dir} ({exc.strerror}): this node's cache of "
                                  "the shared filesystem still shows a folder deleted elsewhere; run the job again "
                                  "in a minute") from None
            time.sleep(1.0)
