"""The run's lease: one start trains a run at a time, across nodes, and an older start is fenced off.

``flock`` (the job's first line) is local to a node on BeeGFS, on Lustre mounted ``localflock`` and on FUSE
filesystems: two nodes both get it. The lease does not rely on any lock service, only on what NFS, Lustre,
GPFS, BeeGFS and FUSE network filesystems all do atomically on the server:

- **Take.** ``<run_dir>/.lease`` is created with ``O_CREAT | O_EXCL`` (one creator wins on the server). Its
  record (host, pid, SLURM job, the start's fence number, a random token, a beat counter) is a fixed-size JSON
  block written in place, so a reader on another node never sees a size its attribute cache disagrees with.
- **Renew.** A thread rewrites the record every ``timeout_s / 4`` seconds with the beat counter raised.
- **Break.** A lease is stale when its record did not change for ``timeout_s`` seconds of the observer's own
  monotonic clock (10 s for a record without a token: empty or damaged), or at once when its holder ran on this
  host (in this pid namespace) and its pid is gone. No other host's clock breaks a lease: a record whose own time
  is older than ``2 * timeout_s`` plus a minute only makes the start watch it for the timeout even past its
  ``wait_s``. Breaking renames the file aside (one renamer wins), checks it renamed the record it judged stale
  (else puts it back), and logs a line naming the holder.
- **Fence.** Every start takes a number above all before it (``<run_dir>/.fence``, only written by a lease
  holder). :func:`check_fence` reads the lease file (an ``open`` and ``read``: NFS's close-to-open and FUSE's
  open revalidate it, unlike a cached ``stat`` or listing) and refuses with :class:`FencedError` when this
  process's start no longer holds it: the checkpoint seal, the tracking spool, the end status of the MLflow run
  and the version's commit call it first, so a start that wakes up after a newer one took the run (a SIGSTOP,
  a node back from a network partition) changes nothing of the newer start's.
- **Lost.** The renewing thread that finds the lease gone or taken sets :attr:`Lease.lost` and calls
  ``on_lost`` once (the job asks the loop to stop, so the start ends at a step boundary instead of training on).

Not here: when to wait for a held lease and for how long (the job's ``job.lease_wait_s``), the ``flock`` first
line (:class:`gwenlake_hpc.job.run_lock.RunLock`). What remains: a start that passed its check and is then frozen
before the rename it checked for can still complete that one rename after it is fenced (a check and a rename
are two operations on a filesystem without compare-and-swap); every later write is refused.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigError
from .fsutil import write_atomic
from .processes import pid_gone

log = logging.getLogger("gwenlake_hpc.lease")

LEASE = ".lease"
FENCE = ".fence"
#: Size of the lease record in bytes (JSON padded with spaces): a fixed size, rewritten in place.
RECORD_BYTES = 512
#: Clocks of two nodes are assumed to differ by less than this (seconds): a record whose own time is older than
#: ``2 * timeout_s`` plus this looks dead, and is watched for ``timeout_s`` (then broken) even past ``wait_s``.
MAX_CLOCK_SKEW_S = 60.0
#: Seconds a lease record without a token (empty or damaged) is watched before it is broken, at most.
EMPTY_RECORD_S = 10.0
#: Default seconds without renewal after which a lease is broken (``job.lease_timeout_s``).
DEFAULT_TIMEOUT_S = 60.0


class FencedError(ConfigError):
    """This start no longer holds its run: a newer start took the lease (exit 2; not requeued, the newer start
    trains the run). Raised by :func:`check_fence` before a write that only the holder may make."""


class RunHeldError(ConfigError):
    """Another live start holds the run's lease (exit 2, naming it)."""


@dataclass(frozen=True)
class Holder:
    """A lease record as read from ``.lease``.

    Attributes:
        token: the holder's random id ("" when the record is not written yet or unreadable).
        fence: the holder's start number (0 when unknown).
        host, pid, slurm_job_id: where it runs.
        beat: renewals so far; ``time``: the holder's wall clock at its last renewal (Unix seconds).
        raw: the bytes read (a renewal changes them).
        pidns: the holder's pid namespace (its pid is checked only from the same one).
    """

    token: str
    fence: int
    host: str
    pid: int
    slurm_job_id: str
    beat: int
    time: float
    raw: bytes
    pidns: str = ""

    def describe(self) -> str:
        if not self.token:
            return "a start whose lease record is not written yet"
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        age = max(0.0, time.time() - self.time)
        return f"start {self.fence} (pid {self.pid} on {self.host}{job}, renewed {age:.0f} s ago by its clock)"


def read_holder(run_dir: str | os.PathLike) -> Holder | None:
    """The lease record of ``run_dir``, or None when no lease file exists. Reads the file's content (an open and
    a read), never a cached attribute. A file being created or torn reads as a holder with an empty token."""
    try:
        with open(Path(run_dir) / LEASE, "rb") as fh:
            raw = fh.read(RECORD_BYTES * 2)
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(raw.decode("utf-8"))
        return Holder(str(rec["token"]), int(rec["fence"]), str(rec["host"]), int(rec["pid"]),
                      str(rec.get("slurm_job_id") or ""), int(rec["beat"]), float(rec["time"]), raw,
                      str(rec.get("pidns") or ""))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return Holder("", 0, "", 0, "", 0, 0.0, raw)


def _read_settled(run_dir: Path) -> Holder | None:
    """:func:`read_holder`, read again (up to 3 times, 50 ms apart) while the record does not parse: a read
    racing a renewal's write on a network filesystem may see it torn, and a torn record is no proof of a loss."""
    holder = read_holder(run_dir)
    for _ in range(3):
        if holder is None or holder.token or not holder.raw:
            break
        time.sleep(0.05)
        holder = read_holder(run_dir)
    return holder


def read_fence(run_dir: str | os.PathLike) -> int:
    """The highest start number handed out for ``run_dir`` (0 before the first)."""
    try:
        return int((Path(run_dir) / FENCE).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def pid_namespace() -> str:
    """This process's pid namespace (``/proc/self/ns/pid``), "" where it cannot be read: a pid names the same
    process only within one namespace (a container has its own)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def holder_gone(holder: Holder) -> bool:
    """True when ``holder``'s process ran on this host, in this pid namespace, and is gone; False when it may
    live (another host or namespace, where this process cannot see it)."""
    return holder.host == socket.gethostname() and holder.pidns == _PIDNS and pid_gone(holder.pid)


class Lease:
    """The lease of one start on ``run_dir`` (see the module docstring).

    Args:
        run_dir: the run directory (on the shared filesystem).
        timeout_s: seconds without renewal after which others break it (``job.lease_timeout_s``); it is renewed
            every ``timeout_s / 4``.
        wait_s: seconds :meth:`acquire` waits for a live holder before refusing (0: refuse at once).
        facts: what the record names besides host and pid (``slurm_job_id``).
        on_lost: called once, from the renewing thread, with the reason when the lease is found lost.
    """

    def __init__(self, run_dir: str | os.PathLike, *, timeout_s: float = DEFAULT_TIMEOUT_S, wait_s: float = 0.0,
                 facts: Mapping[str, Any] | None = None, on_lost: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEASE
        self.timeout_s, self.wait_s = float(timeout_s), float(wait_s)
        self.token = uuid.uuid4().hex
        self.fence = 0
        self.lost: str | None = None  # why, once the renewing thread found the lease gone or taken
        self._facts = dict(facts or {})
        self._on_lost = on_lost
        self._beat = 0
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- take --------------------------------------------------------------------------------------------------

    def acquire(self) -> "Lease":
        """Take the lease (breaking a stale one), number this start, start renewing; returns self.

        Raises:
            RunHeldError: a live start holds it and ``wait_s`` ran out (the message names it).
        """
        started = time.monotonic()
        deadline = started + self.wait_s
        last, since = b"\x00", started  # the record last read, and since when it reads so (this process's clock)
        while True:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                pass
            except PermissionError:
                # sshfs answers an exclusive create that loses a race with another mount's as EPERM (the
                # server's generic failure), not EEXIST: the same answer when the file is there now.
                if not os.path.lexists(self.path):
                    raise
            holder = _read_settled(self.run_dir)
            if holder is None:
                continue  # released or broken in between: create again
            now = time.monotonic()
            if holder.raw != last:
                last, since = holder.raw, now
            if holder_gone(holder):
                self._break(holder, f"its process {holder.pid} on {holder.host} is gone")
                continue
            # A record without a token (empty: its creator died before writing it; or damaged) is judged sooner:
            # a live creator writes it within milliseconds.
            limit = self.timeout_s if holder.token else min(self.timeout_s, EMPTY_RECORD_S)
            if now - since >= limit:
                self._break(holder, f"no renewal for {now - since:.0f} s (job.lease_timeout_s={self.timeout_s:g})"
                            if holder.token else f"its record stayed unreadable for {now - since:.0f} s")
                continue
            # Only what this process saw breaks a lease, never another host's clock. A record that looks old by
            # its own time (or has no token) is watched for its limit even past job.lease_wait_s, so that a
            # start after a lost node takes the run over by itself.
            looks_dead = not holder.token or time.time() - holder.time > 2 * self.timeout_s + MAX_CLOCK_SKEW_S
            if now >= deadline and (not looks_dead or now - started >= limit + 1.0):
                raise RunHeldError(
                    f"run {self.run_dir} is being trained by {holder.describe()}; two starts on one run would fork "
                    f"its checkpoints and its MLflow curve. Wait for it to end; a lease not renewed for "
                    f"{self.timeout_s:g} s (job.lease_timeout_s) is broken by the next start, and "
                    f"job.lease_wait_s=SECONDS makes a start wait that long for it")
            time.sleep(min(1.0, max(0.05, self.timeout_s / 20), max(0.05, deadline - now) if not looks_dead else 1.0))
        self.fence = read_fence(self.run_dir) + 1
        write_atomic(self.run_dir / FENCE, f"{self.fence}\n")
        self._write()
        self._thread = threading.Thread(target=self._renew_loop, name="gwenlake-lease", daemon=True)
        self._thread.start()
        _install(self)
        return self

    def _break(self, holder: Holder, why: str) -> None:
        aside = self.run_dir / f".lease-broken-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else broke or released it first
        try:
            with open(aside, "rb") as fh:
                got = fh.read(RECORD_BYTES * 2)
        except OSError:
            got = b""
        if got != holder.raw:  # renamed a record renewed or taken since it was judged: put it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass  # a third start took it meanwhile; the one put aside is judged again by its next renewal
            os.unlink(aside)
            return
        os.unlink(aside)
        log.warning("broke the lease of run %s held by %s: %s", self.run_dir, holder.describe(), why)

    # -- renew ---------------------------------------------------------------------------------------------------

    def _record(self) -> bytes:
        rec = {"token": self.token, "fence": self.fence, "host": socket.gethostname(), "pid": os.getpid(),
               "slurm_job_id": str(self._facts.get("slurm_job_id") or ""), "beat": self._beat, "time": time.time(),
               "pidns": _PIDNS}
        data = json.dumps(rec, sort_keys=True).encode()
        if len(data) >= RECORD_BYTES:
            raise ValueError(f"lease record over {RECORD_BYTES} bytes: {data[:80]!r}...")
        return data + b" " * (RECORD_BYTES - len(data) - 1) + b"\n"

    def _write(self) -> None:
        assert self._fd is not None
        os.pwrite(self._fd, self._record(), 0)
        os.fsync(self._fd)  # on NFS and FUSE: on the server, where the other nodes read it

    def _renew_loop(self) -> None:
        every = max(0.05, self.timeout_s / 4)
        while not self._stop.wait(every):
            try:
                holder = _read_settled(self.run_dir)
                if holder is None or holder.token != self.token:
                    self._mark_lost(f"taken by {holder.describe()}" if holder is not None else "broken by another "
                                    "start (the lease file is gone)")
                    return
                self._beat += 1
                self._write()
            except OSError as exc:  # the filesystem is away: try again at the next renewal
                log.warning("could not renew the lease of run %s: %s", self.run_dir, exc)

    def _mark_lost(self, why: str) -> None:
        self.lost = why
        log.error("this start (start %d, pid %d) lost the lease of run %s: %s; it stops at the next step and "
                  "writes nothing more of the run", self.fence, os.getpid(), self.run_dir, why)
        if self._on_lost is not None:
            self._on_lost(f"lease lost: {why}")

    # -- fence ---------------------------------------------------------------------------------------------------

    def check(self, what: str) -> None:
        """Refuse ``what`` unless this start still holds the lease (reads the file, see the module docstring).

        Raises:
            FencedError: the lease is gone, names another start, or a newer start number was handed out.
        """
        holder = _read_settled(self.run_dir)
        newest = read_fence(self.run_dir)
        if holder is not None and holder.token == self.token and newest <= self.fence and not self.lost:
            return
        who = holder.describe() if holder is not None and holder.token != self.token else \
            f"start {newest}" if newest > self.fence else "nobody (the lease was broken)"
        if not self.lost:
            self._mark_lost(f"now held by {who}")
        raise FencedError(f"{what} refused: start {self.fence} (pid {os.getpid()} on {socket.gethostname()}) no "
                          f"longer holds run {self.run_dir}, {who} does (this start's lease went "
                          f"{self.timeout_s:g} s without renewal: the process was stopped or its node cut off). "
                          "Its work since its last sealed checkpoint is discarded; the newer start goes on")

    # -- release -------------------------------------------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours (a lost one is left to its new holder)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        _uninstall(self)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            holder = read_holder(self.run_dir)
            if holder is not None and holder.token == self.token:
                aside = self.run_dir / f".lease-released-{uuid.uuid4().hex[:12]}"
                try:  # renamed, then checked: never unlink a record a breaker put in its place meanwhile
                    os.rename(self.path, aside)
                    with open(aside, "rb") as fh:
                        if fh.read(RECORD_BYTES * 2) != holder.raw and not self.path.exists():
                            os.link(aside, self.path)
                    os.unlink(aside)
                except OSError:
                    pass


_PIDNS = pid_namespace()


# --- this process's lease: the checks of the stores -----------------------------------------------------------

_CURRENT: Lease | None = None
_CURRENT_LOCK = threading.Lock()


def _install(lease: Lease) -> None:
    global _CURRENT
    with _CURRENT_LOCK:
        _CURRENT = lease


def _uninstall(lease: Lease) -> None:
    global _CURRENT
    with _CURRENT_LOCK:
        if _CURRENT is lease:
            _CURRENT = None


def check_fence(what: str) -> None:
    """Refuse ``what`` when this process holds a run's lease no longer (nothing when it holds none: a rank
    other than 0, a test, a tool).

    Raises:
        FencedError: see :meth:`Lease.check`.
    """
    lease = _CURRENT
    if lease is not None:
        lease.check(what)


def current() -> Lease | None:
    """The lease this process holds, or None."""
    return _CURRENT
