"""A rank's heartbeat: where its loop is and since when, in a small memory-mapped file a watchdog process reads.

Responsibilities:

- the writer side (:class:`Heartbeat`): the Run beats at the start of every step (the step, whether it is an
  evaluation step, a count) and marks the checkpoint blocks (:meth:`Heartbeat.phase`): integers stored into a
  mapped page, no system call, about 0.2 us a step (``benchmarks/bench_hang.py``);
- the reader side (:func:`read`): what the watchdog (:mod:`gwenlake_hpc.job.watchdog`), a process of its own,
  sees once a second. It works whatever the training's main thread is doing: blocked in a collective, in C code
  holding the GIL, or stopped.

Layout (little-endian, :data:`_FORMAT`): magic ``GWHB``, format version, pid, main thread id (to find the main
thread in a faulthandler dump), step, phase (:data:`STARTING`, :data:`STEP`, :data:`CHECKPOINT`, :data:`DONE`),
flags (1: an evaluation step, 2: the first step of this start), the time of the last phase change
(``time.monotonic_ns()``: CLOCK_MONOTONIC, the same clock in every process of the machine), and the number of
beats (a step's beat stores no time: the watchdog notes when it sees the count change, once a second). The file lives on the node (``/dev/shm`` where it exists): only that node's
watchdog reads it. Standard library only.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: Phases of a rank's loop.
STARTING, STEP, CHECKPOINT, DONE = 0, 1, 2, 3
PHASE_NAMES = {STARTING: "starting", STEP: "step", CHECKPOINT: "checkpoint", DONE: "done"}

_FORMAT = "<4sIqQqqqqq"
_SIZE = struct.calcsize(_FORMAT)
_MAGIC = b"GWHB"
_VERSION = 1
# Offsets of the fields a beat rewrites: step, phase, eval flag, beat time, count (after magic, version, pid,
# thread id).
_BEAT_FORMAT = "<qqqqq"
_BEAT_OFFSET = struct.calcsize("<4sIqQ")
_pack_beat = struct.Struct(_BEAT_FORMAT).pack_into  # compiled once: a beat is one call into C


def heartbeat_dir() -> Path:
    """Where heartbeat files go on this node: ``/dev/shm`` (memory) where it exists, else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class Beat:
    """One reading of a heartbeat file.

    Attributes:
        pid: the training process. thread_id: its main thread's ``threading.get_ident()``.
        step: the step running (its start was the last beat; 0 before the first). phase: one of the phases.
        at_eval: the step is an evaluation step. first: it is the first step of this start (it compiles,
        warms up, fills caches). beat_ns: ``time.monotonic_ns()`` of the last phase change (a step's beat
        writes no time: the watchdog notes when it sees the count change).
        count: beats so far (grows with every beat and phase change).
    """

    pid: int
    thread_id: int
    step: int
    phase: int
    at_eval: bool
    beat_ns: int
    count: int
    first: bool = False


class Heartbeat:
    """The writer side, owned by the Run (or the job before it). ``path``: the file, made or overwritten."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._count = 0
        struct.pack_into(_FORMAT, self._map, 0, _MAGIC, _VERSION, os.getpid(), threading.main_thread().ident or 0,
                         0, STARTING, 0, time.monotonic_ns(), 0)
        self._words = memoryview(self._map).cast("q")  # 8 int64 words: [3] step, [4] phase, [5] flags, [7] count
        self._step, self._eval = 0, 0

    def beat(self, step: int, at_eval: bool, first: bool = False) -> None:
        """Step ``step`` starts now (``at_eval``: it is an evaluation step; ``first``: the first of this start).

        Four stores into the mapped page (about 0.2 us; no clock read: the watchdog times what it sees change),
        the count last, so that a reader that sees the new count sees the new step too."""
        words = self._words
        words[3] = step
        words[4] = STEP
        words[5] = self._eval = (at_eval and 1) | (first and 2)
        self._step, self._count = step, self._count + 1
        words[7] = self._count

    def phase(self, phase: int) -> None:
        """The loop enters ``phase`` now (:data:`CHECKPOINT` for a checkpoint block, :data:`STEP` after it,
        :data:`DONE` at the end), with the time (``phase_ns``)."""
        self._count += 1
        _pack_beat(self._map, _BEAT_OFFSET, self._step, phase, self._eval, time.monotonic_ns(), self._count)

    def close(self) -> None:
        """Mark the loop done and unmap (the file stays for the watchdog until it ends)."""
        if not self._map.closed:
            self.phase(DONE)
            self._words.release()
            self._map.close()


def read(path: str | os.PathLike) -> Beat | None:
    """The heartbeat in ``path``, or None when it is missing, short or not a heartbeat file."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(_SIZE)
    except OSError:
        return None
    if len(data) < _SIZE:
        return None
    magic, version, pid, tid, step, phase, at_eval, beat_ns, count = struct.unpack(_FORMAT, data)
    if magic != _MAGIC or version != _VERSION:
        return None
    return Beat(pid, tid, step, phase, bool(at_eval & 1), beat_ns, count, bool(at_eval & 2))
