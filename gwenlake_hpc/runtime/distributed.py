"""Multi-task runs: the process group from the SLURM environment, and the few collective decisions the Run needs.

A job with several tasks (``launcher.nodes`` x ``launcher.tasks_per_node``) runs the same training function in
every task. SLURM's facts (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_JOB_NODELIST``...) are read through
submitit's ``TorchDistributedEnvironment``, which exports ``MASTER_ADDR`` (the first node), ``MASTER_PORT``
(derived from the job id, so a requeued job finds the same one), ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
Outside SLURM, a launcher such as ``torchrun`` that sets ``RANK``/``WORLD_SIZE`` works the same way.

The training's own collectives (DDP's gradient all-reduce) use the default group: ``nccl`` on CUDA, ``gloo`` on
the CPU. The Run's control decisions (did any rank get a stop request? which checkpoint do we resume?) go
through a separate ``gloo`` group on CPU tensors, so they never synchronise a GPU stream. The background
checkpoint writer has a ``gloo`` group of its own (:meth:`Dist.background`): its collectives (DCP's plans, the
shards' digests, the seal) run in its thread while the training's run in the main thread, and two threads must
never share a group.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .signals import StopRequest


log = logging.getLogger("gwenlake_hpc.distributed")

#: Seconds a collective may wait for the other ranks before it fails (instead of hanging forever).
#: It must cover a restarted rank 0 waiting for a lost node's run lock (up to 180 s).
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Dist:
    """This process's place in the job: ``rank`` of ``world_size`` (``local_rank`` on its node).

    A single-process run is ``Dist()`` (rank 0 of 1) and every method is a no-op there.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    _control: Any = field(default=None, repr=False)
    _background: "Dist | None" = field(default=None, repr=False)
    #: seconds a collective of a group made here may wait (the default group's, from :func:`setup`)
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: every rank's host and pid as it joined (:class:`~.peers.Peer`, by rank); empty for a single process
    peers: list = field(default_factory=list, repr=False)

    #: set once :meth:`lost_peer` found a rank gone: the job's end then waits for no one (see :func:`teardown`)
    peer_lost: bool = False

    def lost_peer(self, exc: BaseException | None, where: str, then: str | None = None) -> str | None:
        """The one-line verdict when ``exc`` is a collective's failure because a rank is gone (naming it, its
        pid and host), or None (see :func:`.peers.verdict`); always None for a single process."""
        if not self.enabled:
            return None
        from .peers import verdict

        found = verdict(self.peers, self.rank, exc, where, then)
        if found is not None:
            self.peer_lost = True
        return found

    @property
    def enabled(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes checkpoints, logs to tracking and commits."""
        return self.rank == 0

    @property
    def group(self) -> Any:
        """The process group of this Dist's collectives (None: the default group)."""
        return self._control

    def background(self) -> "Dist":
        """The same ranks on a ``gloo`` group of their own, for the collectives of the background checkpoint
        writer's thread. Made by the first call, which is a collective of the default group: every rank makes
        it at the same point of the training (the first asynchronous sharded checkpoint). A single process:
        itself.
        """
        if not self.enabled:
            return self
        if self._background is None:
            import torch.distributed as dist

            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            self._background = Dist(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                                    backend="gloo", _control=group, timeout_s=self.timeout_s)
        return self._background

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one (a collective: all ranks must call it)."""
        if not self.enabled:
            return bool(flag)
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return bool(t.item())

    def max(self, value: int) -> int:
        """The largest ``value`` over all ranks, on every rank (an int64; a collective: all ranks must call it)."""
        if not self.enabled:
            return int(value)
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return int(t.item())

    def maxima(self, values: list[int]) -> list[int]:
        """The element-wise largest of ``values`` (ints, the same length on every rank) over all ranks, on every
        rank: several decisions in one collective (all ranks must call it)."""
        if not self.enabled:
            return [int(v) for v in values]
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return [int(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable value; a collective)."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (picklable), by rank, on rank 0; None on the other ranks (a collective over the
        control group: all ranks must call it)."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self._control)
        return out

    def where_all(self, here: tuple) -> list[tuple]:
        """Every rank's ``here`` (a small picklable tuple whose first item names the call: ``("end",)``,
        ``("gwenlake_hpc.checkpoint", name, ...)``), by rank, on every rank (a collective of the control group).

        The calls that a user might make on one rank alone meet here: a rank that reads another call's name in
        the answer knows at once which rank is where, instead of two different collectives waiting for each
        other until the timeout. A single process: ``[here]``."""
        if not self.enabled:
            return [here]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, here, group=self._control)
        return [tuple(o) if isinstance(o, (list, tuple)) else (str(o),) for o in out]

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        if self.enabled:
            import torch.distributed as dist

            dist.barrier(group=self._control)


def agree_on_stop(d: Dist, stop: StopRequest) -> bool:
    """Whether any rank was asked to stop; a rank that was not records the other's reason (for its log).

    One decision for all ranks (a collective in a multi-task run): a stop request seen by any rank stops
    every rank after the same step (the Run's loop asks before each step)."""
    if not d.enabled:
        return stop.requested
    # One collective carries who stopped and why: signal number (0: a request without a signal), then rank.
    mine = ((int(stop.signum or 0) + 1) << 20) + d.rank if stop.requested else 0
    agreed = d.max(mine)
    if agreed and not stop.requested:
        signum, rank = (agreed >> 20) - 1, agreed & ((1 << 20) - 1)
        why = signal.Signals(signum).name if signum > 0 else "a stop request"
        stop.request(f"{why} on rank {rank}")
    return bool(agreed)


def from_environment() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` of a multi-task job, or None for a single process.

    SLURM (``SLURM_STEP_NUM_TASKS`` > 1: a job step of several tasks) first, through submitit's ``TorchDistributedEnvironment``;
    then ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set by torchrun and the like.
    """
    # Only inside an srun step: the batch script itself also sees SLURM_NTASKS but is no rank.
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        # CUDA_VISIBLE_DEVICES is left as SLURM set it: the device is chosen from LOCAL_RANK instead.
        env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return env.rank, env.world_size, env.local_rank
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    return None


def setup(timeout_s: float | None = None) -> Dist:
    """Join the job's process group (once per process) and return this process's :class:`Dist`.

    The default group uses ``nccl`` when CUDA is available and ``gloo`` otherwise (``GWENLAKE_DIST_BACKEND``
    overrides); a second ``gloo`` group carries the Run's control decisions. ``timeout_s`` (default
    ``GWENLAKE_DIST_TIMEOUT_S`` or 600 s) bounds every collective: a rank that died makes the others fail
    after it, not hang.

    Raises:
        RendezvousError: the process group did not form within ``timeout_s``: a rank never joined (it died or
            hangs in its start-up), or ``MASTER_ADDR`` does not resolve on a node (list the node names in
            ``/etc/hosts`` or DNS); one line naming what joined, not the store's traceback.
    """
    facts = from_environment()
    if facts is None:
        return Dist()
    import torch
    import torch.distributed as dist

    rank, world, local = facts
    if timeout_s is None:
        timeout_s = float(os.environ.get("GWENLAKE_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = os.environ.get("GWENLAKE_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
        log.info("joining the process group: rank %d of %d (local rank %d), backend %s, master %s:%s",
                 rank, world, local, backend, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        try:
            dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the store's timeout or connection error, as one line
            raise _rendezvous_error(rank, world, timeout_s, exc) from None
    from .peers import from_gathered, me

    gathered: list[Any] = [None] * world  # who is who, for the verdict when a rank is gone
    try:
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        dist.all_gather_object(gathered, me(), group=control)
    except Exception as exc:  # noqa: BLE001 - a rank that died between the store and the first collective
        raise _rendezvous_error(rank, world, timeout_s, exc) from None
    return Dist(rank=rank, world_size=world, local_rank=local, backend=backend, _control=control,
                timeout_s=timeout_s, peers=from_gathered(gathered))


def _rendezvous_error(rank: int, world: int, timeout_s: float, exc: BaseException) -> Exception:
    """The one line for a process group that did not form (see :func:`setup`), with what the store said
    (``1/2 clients joined``) and no C++ frames."""
    from ..base.errors import RendezvousError

    said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    joined = re.search(r"(\d+)/(\d+) clients joined", str(exc))
    who = (f"{joined.group(1)} of {joined.group(2)} ranks joined" if joined else
           f"rank 0's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} did not answer or "
           "a rank left")
    return RendezvousError(
        f"rank {rank} of {world}: the job's process group did not form within {timeout_s:g} s ({who}): a rank "
        "never started, died or hangs in its start-up (its own log says where), or MASTER_ADDR/MASTER_PORT lead "
        f"nowhere; nothing was trained or written here. Start every rank again (GWENLAKE_DIST_TIMEOUT_S bounds "
        f"the wait). The store said: {said}")


_ABANDONED: list[bool] = []  # a process group left undestroyed after a failure (teardown with ok=False)


#: A folder where each rank records its exit status (set by ``python -m gwenlake_hpc.launch.torchrun`` for its
#: workers: torchrun itself reports any non-zero status as a failure, 75 included).
EXIT_STATUS_DIR_ENV = "GWENLAKE_EXIT_STATUS_DIR"


def record_exit_status(code: int) -> None:
    """Write ``code`` to ``$GWENLAKE_EXIT_STATUS_DIR/<torchrun restart>-<rank>`` where that variable is set
    (nothing otherwise; a failure to write is logged, the exit goes on)."""
    folder = os.environ.get(EXIT_STATUS_DIR_ENV)
    if not folder:
        return
    name = f"{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') or 0):04d}-{int(os.environ.get('RANK', '0')):05d}"
    try:
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(f"{int(code)}\n")
    except OSError as exc:
        log.warning("could not record the exit status in %s: %s", folder, exc)


def exit_process(code: int) -> None:
    """End the process with exit status ``code`` (what ``python -m gwenlake_hpc`` and ``gwenlake-train`` do).

    After a failure of a multi-task run the process group is left undestroyed (:func:`teardown`): at interpreter
    finalisation gloo's threads would then be destroyed still running and abort the process (SIGABRT, "terminate
    called without an active exception") instead of exiting ``code``. So then the exit handlers run (tracking
    writes what is left), the streams and logs are flushed and the process ends at once (``os._exit``), before
    finalisation. Otherwise: ``sys.exit(code)``.
    """
    import sys

    record_exit_status(code)
    if not _ABANDONED:
        sys.exit(code)
    import atexit

    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - the handlers os._exit would skip
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


#: What :func:`teardown` says when another rank is not at the job's end but in one of our collectives.
MISMATCHED = "mismatched"


def teardown(d: Dist, ok: bool = True) -> bool | str:
    """Leave the process group.

    ``ok`` (every rank ended the same way: done or evicted): wait for all ranks first, so no rank tears its
    side down while another still completes the last collective (a gloo rank leaving early could abort with
    "terminate called without an active exception"), then destroy the group. After a failure nothing is
    destroyed: the other ranks may be blocked in a collective, and destroying would wait for them; this
    process's exit closes its connections, and theirs fail at once; :func:`exit_process` then ends it before
    the interpreter's finalisation could abort it.

    Returns:
        True, or: False when the final agreement failed (a rank is gone: the one-line verdict naming it is
        logged, and the job must not end with success on this rank); :data:`MISMATCHED` when another rank is in
        another call of ours (``gwenlake_hpc.checkpoint`` called on that rank alone: named in the log; a misuse,
        exit 2).
    """
    if not d.enabled:
        return True
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    if not ok or d.peer_lost:  # a rank known gone (its verdict logged already) would fail the barrier again
        _ABANDONED.append(True)  # the process ends through exit_process (see there)
        return True
    try:
        elsewhere = [(r, w) for r, w in enumerate(d.where_all(("end",))) if w[:1] != ("end",)]
        if elsewhere:  # the others meet our end in another call: no barrier, no destroy (they wait no more)
            _ABANDONED.append(True)
            log.error("%s", "; ".join(f"rank {r} called {w[0]}{'(' + repr(w[1]) + ')' if len(w) > 1 else ''} "
                                      f"while rank {d.rank} ended its training function" for r, w in elsewhere)
                      + ": it is a collective, call it on every rank (not under `if run.is_main:`)")
            return MISMATCHED
        d.barrier()  # after the gather, before the destroy: no rank tears down while another still reads
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a rank gone at the very end: this rank must not report success
        _ABANDONED.append(True)
        then = ("this rank exits 1, not 0; the version it committed stays (a rerun prints it)" if d.is_main else
                "this rank exits 1, not 0; rank 0's log says whether it committed the version before it went: a "
                "rerun prints that version, or resumes from the newest sealed checkpoint and commits it")
        log.error("%s", d.lost_peer(None, "at the job's end (the final barrier)", then)
                  or f"leaving the process group: {exc}")
        return False
    return True
