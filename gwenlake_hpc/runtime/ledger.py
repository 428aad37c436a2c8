"""The goodput ledger: where every second of each start of a run went, written as the run goes.

Responsibilities:

- :class:`StartLedger` (rank 0 of each start; the job makes it, the Run feeds it): this start's own record in
  ``<run dir>/ledger/start-NNNN.jsonl``: start-up until the first step's batch arrived, the time in steps, the
  time blocked in checkpoint blocks, the step and step time of the newest checkpoint sealed in this start, the
  moment a stop signal arrived, the time after the loop, and the reason the start ended.
- :func:`read_ledger`: every start's last record, an end reason inferred for the starts that wrote none.
- :func:`summarize`: the goodput (kept step time / allocated time) and the parts of each start and in all.

The clock rule: every duration in a record is a difference of this process's ``time.perf_counter`` (a
monotonic clock), counted from the process's own start (its age from ``/proc/self/stat``, on the node's boot
clock). No wall-clock time is compared, within a start or across starts: a node whose clock is an hour behind
records the same ledger. Across starts only per-start durations are added (and SLURM's own times, which
``status`` joins: one controller, one clock).

Each record is one JSON line, the whole cumulative state. The file holds the start's *events* (its first
record, the first step, the loop's end, the end), each appended once, then two fixed-size *slots* after them
where the current totals are rewritten in place (``pwrite``), alternately, with a sequence number ``seq``: at
the first step, after every step long enough that the record costs under 1% of it (its write is timed), else
every :data:`FLUSH_EVERY_S`. A thread of the ledger writes one every :data:`FLUSH_EVERY_S` when no step did
(start-up, a long step, a hang), so the time until a kill is in ``elapsed_s`` to the second wherever the process
stood. The file's size is thus bounded by its events, not by the run's length (a 2-week start: a few KB). No
fsync but at the end record; a SIGKILL keeps what the process wrote (the kernel has it), so a kill loses at most
the last second; a write torn by a crash of the node spoils one slot, and the other slot (a second older) or the
last event remains, which SLURM's elapsed time covers. A reader reads the file's tail only (:func:`last_record`:
the valid record with the highest ``seq`` among the last lines, or the last valid line of a ledger written before
the slots, which appended every record).

Suspension: time the start spent stopped (``scontrol suspend``, :mod:`gwenlake_hpc.base.suspend`) is its own
part, ``suspended_s``; every other offset of a record (``startup_s``, ``step_end_s``, ``loop_end_s``,
``stop_s``) is on the start's *active* clock (elapsed less suspended), and ``step_s`` leaves out a suspension
inside a step. ``elapsed_s`` stays the whole time since the process began, suspension included.

Kept and lost: a start's steps up to its newest sealed checkpoint are kept (the next start resumes there); the
steps after it are lost and recomputed by the next start, unless the start finished (its model is committed)
or its loop ended with the checkpoint of its last step sealed (an eviction). A start that ended unannounced (a
kill, a lost node, a hang) in the middle of its loop also lost the step it was in: the time from its last whole
step to its last record (``step_end_s``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..base import suspend
from ..base.errors import ConfigError
from ..base.fsutil import open_nofollow

log = logging.getLogger("gwenlake_hpc.ledger")

#: The folder of the run directory that holds one file per start.
LEDGER_DIR = "ledger"
#: Seconds between two records while steps advance (a SIGKILL loses at most this much of a start).
FLUSH_EVERY_S = 1.0
#: End reasons a start records itself.
FINISHED, EVICTED, TIME_LIMIT, FAILURE, HANG = "finished", "evicted", "time limit", "failure", "hang"
#: End reasons inferred for a start that recorded none: the process was killed (SIGKILL, out of memory), its
#: node was lost (SLURM's NODE_FAIL), or it is still running (the newest start of a live job).
KILLED, LOST_NODE, RUNNING = "killed", "lost node", "running"
#: Ends no signal announced: what ``job.eval_every=auto``'s mean time between interruptions counts.
UNANNOUNCED = (KILLED, LOST_NODE, HANG)
#: The parts of a start's time, in the order ``report`` draws them; they add up to its ``elapsed_s``.
PARTS = ("startup_s", "kept_s", "lost_s", "checkpoint_s", "after_loop_s", "suspended_s", "other_s")


def process_age_s(pid: int | None = None) -> float:
    """Seconds since this process (or process ``pid`` of this host) began (``/proc/<pid>/stat`` start time
    against the boot clock), so that start-up counts the interpreter's own imports; 0.0 where that cannot be
    read (not Linux, no such process)."""
    try:
        with open(f"/proc/{pid if pid is not None else 'self'}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, clock ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def start_path(run_dir: str | os.PathLike[str], index: int) -> Path:
    """``<run dir>/ledger/start-NNNN.jsonl``: the file of start ``index`` (0-based, its place in ``run.json``)."""
    return Path(run_dir) / LEDGER_DIR / f"start-{int(index):04d}.jsonl"


def free_index(run_dir: str | os.PathLike[str], index: int) -> int:
    """``index`` (a start's place in ``run.json``), or one past the newest start file already in the ledger when
    that is not below it: a ``run.json`` that lost starts (edited, restored from a copy) never makes a start
    append to another start's file."""
    taken = [int(f.name[6:-6]) for f in (Path(run_dir) / LEDGER_DIR).glob("start-*.jsonl") if f.name[6:-6].isdigit()]
    return max(int(index), max(taken) + 1) if taken else int(index)


class StartLedger:
    """The ledger of one start, written by rank 0 (the other ranks have none).

    Args:
        path: the start's file (:func:`start_path`).
        index: the start's place in ``run.json``'s ``starts`` (0-based).
        facts: what the start is (host, SLURM job id and restart count), copied into every record.
        every_s: seconds between two records while steps advance.
        suspended_of: gives the seconds this process was stopped so far (tests pass a fake); None: the process's
            :func:`gwenlake_hpc.base.suspend.watch`.

    All times are seconds of this process's monotonic clock (see the module's docstring).

    Raises:
        OSError: the folder cannot be made or the file opened (the job fails before training: a ledger that
            cannot be written is a run directory that cannot be either).
    """

    def __init__(self, path: str | os.PathLike[str], index: int, facts: Mapping[str, Any] | None = None,
                 every_s: float = FLUSH_EVERY_S, suspended_of: Callable[[], float] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._every = float(every_s)
        # The process's start on this clock: every elapsed time is perf_counter() - origin.
        self._origin = time.perf_counter() - process_age_s()
        self._suspended_of = suspended_of or suspend.watch().suspended_s
        self._susp0 = self._suspended_of()  # a stop before the ledger began is start-up's (not seen)
        self._susp = 0.0  # seconds this start was stopped, as of the newest step or record
        self._susp_stepped = 0.0  # of them, those already left out of step_s (or before the first step)
        self.step_s = 0.0  # whole steps, from the batch's request to the loop's next turn, checkpoint blocks in
        self.checkpoint_s = 0.0  # blocked in run.checkpoint() blocks (added by the loop at each step)
        self._pending: dict[int, float] = {}  # step of a checkpoint block -> step time up to it (not sealed yet)
        self.rec: dict[str, Any] = {"v": 2, "start": int(index), **dict(facts or {}), "seq": 0, "elapsed_s": 0.0,
                                    "suspended_s": 0.0, "startup_s": None, "first_step": None, "last_step": None,
                                    "step_s": 0.0, "checkpoint_s": 0.0, "sealed_step": None, "kept_step_s": 0.0,
                                    "step_end_s": None, "loop_end_s": None, "stop_s": None, "stop_signal": None,
                                    "drain_s": None, "end": None}
        #: Gives the step of the newest sealed checkpoint (None: none yet); the Run sets it.
        self.sealed_of: Callable[[], int | None] = lambda: None
        # never through a link planted at its name (refused: ConfigError)
        self._fd: int | None = open_nofollow(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._base = os.fstat(self._fd).st_size  # where the slots begin (after the events)
        if self._base:  # a file already there (never, but for a hand copy): our lines begin on a line of their own
            os.pwrite(self._fd, b"\n", self._base)
            self._base += 1
        self._slot = 0  # bytes of one slot (fixed at the first record)
        self._turn = 0  # the slot the next record goes to (the first after an event: no hole before the second)
        self._next = 0.0
        self._cost = 1.0  # seconds a record takes to write, measured (a start's first records: assume slow)
        self._lock = threading.RLock()  # the loop's records and the ticking thread's
        self._step_end: float | None = None  # active seconds at the end of the last whole step
        self._closed = threading.Event()
        self.flush(event=True)
        self._ticker = threading.Thread(target=self._tick, name="gwenlake-ledger", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        """A record every ``every_s`` while no step writes one (start-up, a long step, a hang, the end)."""
        while not self._closed.wait(max(self._every, 0.1)):  # every_s=0 (a record at every step): not a spin
            if time.perf_counter() >= self._next:
                try:  # a checkpoint sealed by the background writer during a long step or a hang is kept
                    self.sealed(self.sealed_of())
                except Exception:  # noqa: BLE001 (the Run's view of its checkpoints; the next step retries)
                    pass
                self.flush()

    def now(self) -> float:
        """Seconds since this process began (suspension included)."""
        return time.perf_counter() - self._origin

    def _suspended(self) -> float:
        """Seconds this start was stopped since the ledger began (never decreasing)."""
        self._susp = max(self._susp, self._suspended_of() - self._susp0)
        return self._susp

    def first_step(self, step: int, batch_arrived: float) -> None:
        """The loop's first step got its batch at ``batch_arrived`` (``perf_counter`` s): start-up ends there
        (less the time the start was stopped)."""
        with self._lock:
            self.rec["first_step"] = int(step)
            self.rec["startup_s"] = round(batch_arrived - self._origin - self._suspended(), 6)
            self._susp_stepped = self._susp  # start-up's: not in a step
        self.flush(event=True)

    def step_done(self, step: int, whole_s: float, checkpoint_total_s: float, checkpointed: bool,
                  now: float) -> None:
        """Step ``step`` ended at ``now`` (``perf_counter`` s) after ``whole_s`` seconds; ``checkpoint_total_s``
        is the run's time in checkpoint blocks so far; ``checkpointed``: the step wrote one (not sealed yet,
        perhaps). Called at every step: a record is written at most every ``every_s``, with the newest sealed
        checkpoint's step as :attr:`sealed_of` tells it. A suspension since the previous step is left out of
        ``whole_s`` (a stopped process did not train)."""
        with self._lock:
            # the suspension since the previous step (the ticking thread may have counted it already)
            stopped = self._suspended() - self._susp_stepped
            self._susp_stepped = self._susp
            self.step_s += whole_s - min(stopped, whole_s)
            self.checkpoint_s = checkpoint_total_s
            self.rec["last_step"] = step
            self._step_end = now - self._origin - self._susp  # rounded into the record at its write
            if checkpointed:
                self._pending[step] = self.step_s - checkpoint_total_s
        # every step long enough that its record costs under 1% of it (a kill then loses nothing), else once
        # every ``every_s``
        if now >= self._next or whole_s >= 100.0 * self._cost:
            self.sealed(self.sealed_of())
            self.flush(now)

    def sealed(self, step: int | None) -> None:
        """The newest sealed checkpoint is of ``step`` (one of this start's blocks, else ignored)."""
        with self._lock:
            if step is None or step not in self._pending:
                return
            self.rec["sealed_step"], self.rec["kept_step_s"] = step, round(self._pending[step], 6)
            for s in [s for s in self._pending if s < step]:
                del self._pending[s]

    def loop_ended(self) -> None:
        """The loop is over (its final checkpoint sealed): what follows is the job's end (commit, tracking)."""
        self.sealed(self.sealed_of())
        with self._lock:
            self.rec["loop_end_s"] = round(self.now() - self._suspended(), 6)
        self.flush(event=True)

    def end(self, reason: str, stop_received_at: float | None = None, stop_signal: str | None = None) -> None:
        """Write the start's last record: ``reason`` (:data:`FINISHED`, :data:`EVICTED`, :data:`TIME_LIMIT`,
        :data:`FAILURE`), and the drain from the stop signal (``time.monotonic()`` when it arrived) to now.
        Synced to disk: the one record a crash of the node must not lose."""
        with self._lock:
            if stop_received_at is not None:
                self.rec["drain_s"] = round(max(0.0, time.monotonic() - stop_received_at), 6)
                self.rec["stop_s"] = round(max(0.0, self.now() - self._suspended() - self.rec["drain_s"]), 6)
                self.rec["stop_signal"] = stop_signal
            self.rec["end"] = reason
        self.flush(event=True)
        with self._lock:
            try:
                if self._fd is not None:
                    os.fsync(self._fd)
            except OSError:
                pass
        self.close()

    def flush(self, now: float | None = None, event: bool = False) -> None:
        """Write the cumulative record: into a slot, or appended for good when ``event`` (a start, the first
        step, the loop's end, the end). A write error is logged once: the ledger never fails a training."""
        with self._lock:
            self._flush(time.perf_counter() if now is None else now, event)

    def _flush(self, now: float, event: bool) -> None:
        if self._fd is None:
            return
        rec = self.rec
        rec["seq"] += 1
        rec["elapsed_s"] = round(now - self._origin, 6)
        rec["suspended_s"] = round(self._suspended(), 6)
        rec["step_end_s"] = None if self._step_end is None else round(self._step_end, 6)
        rec["step_s"] = round(max(self.step_s - self.checkpoint_s, 0.0), 6)
        rec["checkpoint_s"] = round(self.checkpoint_s, 6)
        # step time up to each checkpoint of this start not older than the sealed one: the next start's resume
        # point says which of them was kept (a seal may land between two records)
        rec["marks"] = {str(k): round(v, 6) for k, v in self._pending.items()}
        self._next = now + self._every
        began = time.perf_counter()
        line = json.dumps(rec, separators=(",", ":")).encode()
        try:
            if event or len(line) + 1 > self._slot:
                # appended for good where the slots were (the older slot's bytes cut off after it); a record
                # grown past the slots (more checkpoints in flight) makes them wider
                os.pwrite(self._fd, line + b"\n", self._base)
                self._base += len(line) + 1
                os.ftruncate(self._fd, self._base)
                self._turn = 0
                if not event or not self._slot:
                    self._slot = max(self._slot, 512, (len(line) * 3 // 2 + 255) // 256 * 256)
            else:  # the slot of this record's turn: the other one keeps the previous record whole
                os.pwrite(self._fd, line + b" " * (self._slot - len(line) - 1) + b"\n",
                          self._base + self._turn * self._slot)
                self._turn ^= 1
            took = time.perf_counter() - began
            self._cost = took if self._cost >= 1.0 else 0.8 * self._cost + 0.2 * took
        except (OSError, ConfigError) as exc:  # ConfigError: a link planted at its name
            log.warning("the goodput ledger %s could not be written: %s (training goes on)", self.path, exc)
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Stop writing (the ticking thread ends within ``every_s``)."""
        self._closed.set()
        with self._lock:
            self._close_fd()


def append_end(path: str | os.PathLike[str], reason: str, elapsed_s: float | None = None) -> bool:
    """Record ``reason`` as the end of a start from outside its process (the hang watchdog, once it killed it):
    the start's last record (its file, :func:`start_path`) again with ``end`` set (and the next ``seq``), and
    ``elapsed_s`` (the killed process's age at the kill, :func:`process_age_s` of its pid, seconds) where that is
    later than the record's. Returns False when the start has no record or already recorded an end."""
    path = Path(path)
    last = last_record(path)
    if last is None or last.get("end") is not None:
        return False
    last["end"] = reason
    if "seq" in last:
        last["seq"] = int(last["seq"]) + 1
    if elapsed_s is not None and elapsed_s > float(last.get("elapsed_s") or 0.0):
        last["elapsed_s"] = round(float(elapsed_s), 6)
    with os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), "ab") as fh:
        if fh.tell() and _last_byte(path) != b"\n":
            fh.write(b"\n")
        fh.write(json.dumps(last, separators=(",", ":")).encode() + b"\n")
    return True


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1)


#: Bytes of a ledger's tail read at first (doubled until it holds a whole record).
TAIL_BYTES = 16384
#: Records looked at from the file's end: the two slots, a torn line, an appended end.
_LAST_LINES = 6


def last_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A start's newest record, read from the file's tail (never the whole file): among the last whole lines
    that are JSON objects, the one with the highest ``seq``; in a ledger written before the slots (no ``seq``),
    the last one. A line torn by a kill or a crash is skipped. None when the file has no record or cannot be
    read."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            want = TAIL_BYTES
            while True:
                start = max(0, size - want)
                fh.seek(start)
                lines = fh.read(size - start).split(b"\n")
                if start:
                    lines = lines[1:]  # the first line of the tail may be cut
                recs = []
                for line in reversed(lines):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue  # a line torn by a kill or a crash in the middle of its write
                    if isinstance(rec, dict):
                        recs.append(rec)
                        if len(recs) >= _LAST_LINES:
                            break
                if recs or not start:
                    break
                want *= 4
    except OSError:
        return None
    if not recs:
        return None
    if any("seq" in r for r in recs):
        return max(recs, key=lambda r: int(r.get("seq") or 0))
    return recs[0]


_last_record = last_record  # the name of the older releases


def read_ledger(run_dir: str | os.PathLike[str], live: bool = False,
                lost_nodes: Iterable[int] = (), completed: bool = False) -> list[dict[str, Any]]:
    """Every start's last record, oldest first, each with ``end`` set.

    Args:
        run_dir: the run directory.
        live: the run's job is still running: its newest start without an end is :data:`RUNNING`.
        lost_nodes: indexes of starts SLURM says ended with their node (NODE_FAIL).
        completed: the run committed its version (``run.json``'s ``completed``): its newest start finished, even
            when it was killed after the commit, before its end record.

    Returns:
        The records (see :class:`StartLedger`); a start that recorded no end is :data:`KILLED`,
        :data:`LOST_NODE` or :data:`RUNNING`. Empty when the run has no ledger (an older run).
    """
    folder = Path(run_dir) / LEDGER_DIR
    recs = [r for r in (last_record(p) for p in sorted(folder.glob("start-*.jsonl"))) if r is not None]
    lost = set(lost_nodes)
    resumed_at = None  # the resume step of the next start that reached its loop
    for i in range(len(recs) - 1, -1, -1):
        rec = recs[i]
        if rec.get("end") is None:
            rec["end"] = (FINISHED if completed and i == len(recs) - 1 else
                          LOST_NODE if rec.get("start") in lost else
                          RUNNING if live and i == len(recs) - 1 else KILLED)
        rec["next_resumed_at"] = resumed_at
        if rec.get("first_step") is not None:
            resumed_at = int(rec["first_step"]) - 1
    return recs


def parts(rec: Mapping[str, Any]) -> dict[str, float]:
    """The parts of one start's ``elapsed_s`` (:data:`PARTS`, seconds; they add up to it).

    ``kept_s``: step time whose progress the run kept; ``lost_s``: step time after the newest checkpoint sealed
    in the start, recomputed by the next one, and for a start ended unannounced inside its loop the step it was
    in (from its last whole step to its last record); ``checkpoint_s``: blocked in checkpoint blocks;
    ``after_loop_s``: from the loop's end to the last record (final seal, commit, tracking); ``suspended_s``:
    stopped (``scontrol suspend``; not allocated to the run, see :func:`summarize`); ``other_s``: the rest
    (between steps). The second between a killed start's last record and the kill is in none of them. A record
    without ``suspended_s`` (written before it existed) was never suspended.
    """
    suspended = float(rec.get("suspended_s") or 0.0)
    active = max(0.0, float(rec.get("elapsed_s") or 0.0) - suspended)  # the offsets below are on this clock
    step_s = float(rec.get("step_s") or 0.0)
    startup = float(rec["startup_s"]) if rec.get("startup_s") is not None else active
    if rec.get("startup_s") is None:
        step_s = 0.0  # never reached its first step: all of it was start-up
    kept = min(_kept_step_s(rec), step_s)
    checkpoint = float(rec.get("checkpoint_s") or 0.0)
    after = max(0.0, active - float(rec["loop_end_s"])) if rec.get("loop_end_s") is not None else 0.0
    in_step = 0.0  # the step a kill or a hang interrupted: lost
    # (a record from before step_end_s existed has no such key: nothing is known of the step it was in)
    if (rec.get("end") in UNANNOUNCED and rec.get("loop_end_s") is None and rec.get("startup_s") is not None
            and "step_end_s" in rec):
        since = float(rec["step_end_s"]) if rec["step_end_s"] is not None else startup
        in_step = max(0.0, active - max(since, startup))
    other = max(0.0, active - startup - step_s - checkpoint - after - in_step)
    return {"startup_s": startup, "kept_s": kept, "lost_s": step_s - kept + in_step, "checkpoint_s": checkpoint,
            "after_loop_s": after, "suspended_s": suspended, "other_s": other}


def kept_step(rec: Mapping[str, Any]) -> int | None:
    """The last step of the start whose progress the run kept: its last step when it finished; else the step
    the next start resumed from (``next_resumed_at``, set by :func:`read_ledger`) when there is one, else the
    newest checkpoint sealed in the start; None when the start kept nothing (or had no step)."""
    first, last = rec.get("first_step"), rec.get("last_step")
    if first is None or last is None:
        return None
    if rec.get("end") == FINISHED:
        return int(last)
    kept = rec.get("next_resumed_at")
    if kept is None:
        kept = rec.get("sealed_step")
    if kept is None or int(kept) < int(first):
        return None
    return min(int(kept), int(last))


def _kept_step_s(rec: Mapping[str, Any]) -> float:
    kept = kept_step(rec)
    if kept is None:
        return 0.0
    if kept == rec.get("last_step") and rec.get("end") in (FINISHED, EVICTED, TIME_LIMIT):
        return float(rec.get("step_s") or 0.0)
    marks = rec.get("marks") or {}
    if str(kept) in marks:
        return float(marks[str(kept)])
    if kept == rec.get("sealed_step"):
        return float(rec.get("kept_step_s") or 0.0)
    # resumed from a step this start's records never saw sealed or written: its steps' mean time
    first, last = int(rec["first_step"]), int(rec["last_step"])
    return float(rec.get("step_s") or 0.0) * (kept - first + 1) / max(last - first + 1, 1)


def lost_steps(rec: Mapping[str, Any]) -> int:
    """Steps of the start recomputed by a later one (after the last step it kept, :func:`kept_step`)."""
    if rec.get("first_step") is None or rec.get("last_step") is None:
        return 0
    kept = kept_step(rec)
    since = int(rec["first_step"]) - 1 if kept is None else kept
    return max(0, int(rec["last_step"]) - since)


def summarize(recs: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's goodput from its starts' records (:func:`read_ledger`).

    Returns:
        ``starts`` (count), ``allocated_s`` (the starts' elapsed times added, less their ``suspended_s``: SLURM's
        elapsed time leaves a suspension out too, and the run had no use of its nodes then), each part of
        :data:`PARTS` added (seconds), ``lost_steps``, ``goodput`` (``kept_s / allocated_s``, 0..1; None with
        nothing allocated), ``largest_loss`` (the part other than ``kept_s`` and ``suspended_s`` with the most
        seconds, None when none), ``ends`` (reason -> count), ``unannounced`` (starts ended by a kill, a lost node
        or a hang) and ``drain_s`` (stop signal to exit, added over the starts that had one), ``queue_s`` (the
        starts' waits in SLURM's queue from eligible to started, as the controller timed them; not allocated
        time).
    """
    total = {k: 0.0 for k in PARTS}
    ends: dict[str, int] = {}
    allocated, lost, drain, queue = 0.0, 0, 0.0, 0.0
    for rec in recs:
        queue += float(rec.get("queue_s") or 0.0)
        for k, v in parts(rec).items():
            total[k] += v
        allocated += max(0.0, float(rec.get("elapsed_s") or 0.0) - float(rec.get("suspended_s") or 0.0))
        lost += lost_steps(rec)
        drain += float(rec.get("drain_s") or 0.0)
        ends[str(rec.get("end"))] = ends.get(str(rec.get("end")), 0) + 1
    losses = {k: v for k, v in total.items() if k not in ("kept_s", "suspended_s") and v > 0}
    return {"starts": len(recs), "allocated_s": allocated, **total, "lost_steps": lost,
            "goodput": total["kept_s"] / allocated if allocated > 0 else None,
            "largest_loss": max(losses, key=losses.__getitem__) if losses else None,
            "ends": ends, "unannounced": sum(ends.get(e, 0) for e in UNANNOUNCED), "drain_s": drain,
            "queue_s": queue}


def describe(summary: Mapping[str, Any]) -> str:
    """``goodput 0.82 of 1.4 h (largest loss: lost steps 0.1 h), suspended 60 s, queued 12 s``; "" when the run
    has no ledger."""
    if not summary.get("starts") or summary.get("goodput") is None:
        return ""
    loss = summary.get("largest_loss")
    said = (f" (largest loss: {loss[:-2].replace('_', ' ')} {_hours(summary[loss])})" if loss else "")
    queued = f", queued {_hours(summary['queue_s'])}" if summary.get("queue_s") else ""
    stopped = f", suspended {_hours(summary['suspended_s'])}" if summary.get("suspended_s", 0) >= 0.5 else ""
    return f"goodput {summary['goodput']:.2f} of {_hours(summary['allocated_s'])}{said}{stopped}{queued}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"
