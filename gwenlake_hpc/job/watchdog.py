"""The hang watchdog: a process of its own beside each rank, which notices a rank that makes no progress, writes
where every thread of it stands, says so in one line and ends it.

Responsibilities:

- the rule (:class:`HangRule`, ``job.hang_timeout_s``): how long a rank may go without starting a new step,
  by phase (start-up until the first step; a step; a step that holds a checkpoint block or an evaluation);
- the training's side (:class:`Watchdog`): starts the process (SLURM's stop signals blocked in it, so an
  eviction never ends it before the training), registers ``faulthandler`` on :data:`DUMP_SIGNAL` to write all
  threads' stacks into a file opened ahead (it works while the main thread holds the GIL in C code), stops the
  process at the end;
- the process (:func:`watch`, ``python -m gwenlake_hpc.job.watchdog``): reads the rank's heartbeat
  (:mod:`gwenlake_hpc.runtime.heartbeat`) once a second; on a hang it signals the dump, writes
  ``<run_dir>/hangs/<start>/rank<r>.txt`` (host, rank, step, phase, how long silent, the limit, the stacks) and
  ``verdict-rank<r>.json``, prints the verdict line (the rank, its host, where its main thread is, the innermost
  frame outside the libraries) and SIGKILLs the rank, whose job step then ends killed by a signal: the SLURM
  teardown requeues it within ``launcher.max_retries`` (it resumes from the newest sealed checkpoint).

No false alarms: a rank stopped by SIGSTOP (``T`` in ``/proc``) is not silent while stopped, and a gap in the
watchdog's own polling (the whole job stopped, the machine suspended) is not counted either. It ends when its
standard input closes: the training ended, however it ended.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import ConfigError
from ..base.processes import shield_children
from ..runtime import heartbeat as hb

log = logging.getLogger("gwenlake_hpc.watchdog")

#: The signal that makes a rank write its threads' stacks (faulthandler); real-time, so no library uses it.
DUMP_SIGNAL = signal.SIGRTMIN + 3
#: Seconds between two readings of the heartbeat.
POLL_S = 1.0
#: The floor of the ``auto`` rule: no step is called hung before this many seconds.
AUTO_FLOOR_S = 300.0
#: ``auto``: a step may last this many times the longest of the recent steps.
AUTO_FACTOR = 10.0
#: ``auto``: steps holding a checkpoint or an evaluation.
AUTO_LONG_S = 1800.0
#: ``auto``: start-up, from the Run's creation until the first step starts (data opening, model building, a
#: resume's load_state, whatever the function does before its loop).
AUTO_STARTUP_S = 3600.0
#: A number N: start-up, checkpoint and evaluation steps may last this many times N.
LONG_FACTOR = 3.0


@dataclass(frozen=True)
class HangRule:
    """``job.hang_timeout_s``: ``auto`` (None here), a number of seconds, or 0 (off).

    ``auto``: a step may last ``max(300 s, 10 x the longest of the last 100 steps)``; the first step of a start and
    a step that holds a checkpoint block or an evaluation ``max(1800 s, that)``; start-up (from the training
    function's call to its first step) 3600 s. A number N (at least 1): steps N seconds, start-up, first,
    checkpoint and evaluation steps 3 x N.
    """

    timeout_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s is None or self.timeout_s > 0

    def limit(self, beat: hb.Beat, recent_step_s: float) -> float:
        """Seconds rank ``beat`` may stay silent in its phase; ``recent_step_s``: its longest recent step. The
        first step of a start (it compiles, warms up) is a long one."""
        long = beat.phase in (hb.STARTING, hb.CHECKPOINT) or beat.at_eval or beat.first
        if self.timeout_s is not None:
            return self.timeout_s * (LONG_FACTOR if long else 1.0)
        if beat.phase == hb.STARTING:
            return AUTO_STARTUP_S
        step = max(AUTO_FLOOR_S, AUTO_FACTOR * recent_step_s)
        return max(AUTO_LONG_S, step) if long else step


def hang_rule(value: Any) -> HangRule:
    """``job.hang_timeout_s`` as a rule.

    Raises:
        ConfigError (exit 2): neither ``auto`` nor a number of seconds >= 0.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return HangRule(None)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not seconds >= 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"job.hang_timeout_s={value!r}: use auto (the default: derived from the run's step times, "
                          "never below 300 s), a number of seconds, or 0 to turn the hang watchdog off")
    if 0 < seconds < POLL_S:
        raise ConfigError(f"job.hang_timeout_s={value!r}: give at least {POLL_S:.0f} s (the watchdog reads the "
                          "heartbeat once a second), auto, or 0 to turn it off")
    return HangRule(seconds)


class Watchdog:
    """The training's side of one rank's watchdog.

    Args:
        rule: the hang rule. run_dir: the run's directory (``hangs/`` goes there). rank: this process's rank.
        heartbeat: the rank's heartbeat file (made by the caller, written by the Run).
        started: this start's name, the same on every rank (``hangs/<started>/``).
    """

    def __init__(self, rule: HangRule, run_dir: Path, rank: int, heartbeat: Path, started: str):
        self.rule, self.run_dir, self.rank, self.heartbeat = rule, Path(run_dir), rank, Path(heartbeat)
        hangs = self.run_dir / "hangs"
        hangs.mkdir(parents=True, exist_ok=True)
        self.dump_path = hangs / f".stacks-rank{rank:05d}-{os.getpid()}.txt"
        self._dump = open(self.dump_path, "w")
        faulthandler.register(DUMP_SIGNAL, file=self._dump, all_threads=True, chain=False)
        spec = {"rule": asdict(rule), "run_dir": str(self.run_dir), "rank": rank, "pid": os.getpid(),
                "heartbeat": str(self.heartbeat), "dump": str(self.dump_path), "host": socket.gethostname(),
                "started": started}
        with shield_children():  # an eviction's SIGTERM must not end the watchdog before the training
            self._proc = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc.job.watchdog"],
                                          stdin=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(spec) + "\n").encode())
        self._proc.stdin.flush()

    def stop(self) -> None:
        """End the watchdog (it reads the end of its standard input) and drop the dump file if unused."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        faulthandler.unregister(DUMP_SIGNAL)
        self._dump.close()
        if self.dump_path.exists() and self.dump_path.stat().st_size == 0:
            self.dump_path.unlink()


def _stopped(pid: int) -> bool:
    """True while process ``pid`` is stopped (SIGSTOP, a debugger): its state in ``/proc`` is T or t."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def _alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (dead, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[:1] != ["Z"]
    except OSError:
        return False


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')
_LIBRARIES = ("site-packages", "dist-packages", "/lib/python", "gwenlake_hpc/")


def where(stacks: str, thread_id: int) -> tuple[str | None, str | None]:
    """``(innermost frame of the main thread, innermost frame outside the libraries)`` of a faulthandler dump
    (``file:line in function``), None where not found. The main thread is ``thread_id`` (its ident)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)
    wanted = f"0x{thread_id:016x}"
    block = next((b for b in blocks if b.strip() and wanted in b.splitlines()[0]), blocks[0])
    frames = [m for m in (_FRAME.match(line) for line in block.splitlines()) if m]
    text = [f"{m['file']}:{m['line']} in {m['fn']}" for m in frames]
    user = next((t for t, m in zip(text, frames)
                 if not m["file"].startswith("<") and not any(s in m["file"] for s in _LIBRARIES)), None)
    return (text[0] if text else None), user


def _on_hang(spec: Mapping[str, Any], beat: hb.Beat, silent_s: float, limit_s: float) -> bool:
    """Dump the rank's stacks, write the hang record and the verdict, SIGKILL the rank; False (nothing ended)
    when the rank made progress meanwhile (the dump's signal can end a blocking call early)."""
    pid, rank, dump = int(spec["pid"]), int(spec["rank"]), Path(spec["dump"])
    before = dump.stat().st_size if dump.exists() else 0
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return True
    deadline, size = time.monotonic() + 5.0, -1
    while time.monotonic() < deadline:  # faulthandler writes at once; wait until the file stops growing
        time.sleep(0.2)
        now = dump.stat().st_size if dump.exists() else 0
        if now > before and now == size:
            break
        size = now
    stacks = dump.read_text(errors="replace")[before:] if dump.exists() else ""
    now = hb.read(Path(spec["heartbeat"]))
    if now is not None and now.count != beat.count:
        print(f"gwenlake_hpc: hang watchdog: rank {rank} on {spec['host']} was silent for {silent_s:.0f} s in step "
              f"{beat.step} and went on after its stacks were taken: not ended", file=sys.stderr, flush=True)
        return False
    folder = Path(spec["run_dir"]) / "hangs" / str(spec["started"])
    folder.mkdir(parents=True, exist_ok=True)
    phase = hb.PHASE_NAMES.get(beat.phase, str(beat.phase)) + (" (evaluation step)" if beat.at_eval else "") + (
        " (first step)" if beat.first else "")
    head = (f"host {spec['host']}\nrank {rank}\npid {pid}\nstep {beat.step}\nphase {phase}\n"
            f"silent {silent_s:.1f} s\nlimit {limit_s:.1f} s\n\n")
    stack_file = folder / f"rank{rank}.txt"
    stack_file.write_text(head + (stacks or "(no stacks: the process did not answer the dump signal)\n"))
    main, user = where(stacks, beat.thread_id)
    verdict = {"rank": rank, "host": spec["host"], "pid": pid, "step": beat.step, "phase": phase,
               "silent_s": round(silent_s, 1), "limit_s": round(limit_s, 1), "main_thread_at": main,
               "user_code_at": user, "stacks": str(stack_file), "time": time.time()}
    (folder / f"verdict-rank{rank}.json").write_text(json.dumps(verdict, indent=1))
    at = f"its main thread is at {main}" if main else "its stacks could not be read"
    if user and user != main:
        at += f" (in your code: {user})"
    print(f"gwenlake_hpc: hang: rank {rank} on {spec['host']} made no progress for {silent_s:.0f} s in step "
          f"{beat.step} ({phase}; the limit is {limit_s:.0f} s, job.hang_timeout_s): {at}; all threads' stacks: "
          f"{stack_file}; ending it (the job step fails killed, a SLURM job is requeued and resumes from its "
          "newest checkpoint)", file=sys.stderr, flush=True)
    children = _children(pid)  # DataLoader workers and the like: read before the rank dies (then reparented)
    for target in [pid, *children]:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:  # so that its files can be removed (watch's end)
        time.sleep(0.1)
    return True


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``; this watchdog excepted)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _clean(spec: Mapping[str, Any]) -> None:
    """The rank's heartbeat file and its unused stack file, once the rank is gone (a killed rank cannot)."""
    Path(spec["heartbeat"]).unlink(missing_ok=True)
    dump = Path(spec["dump"])
    try:
        if dump.stat().st_size == 0 or not _alive(int(spec["pid"])):
            dump.unlink()
    except OSError:
        pass


def watch(spec: Mapping[str, Any], stdin: Any) -> int:
    """The watchdog's loop (see the module's docstring); returns when ``stdin`` ends, the rank is gone, or after
    it ended a hung rank, having removed what the rank left (:func:`_clean`). Returns 0."""
    try:
        return _watch(spec, stdin)
    finally:
        if not _alive(int(spec["pid"])):
            _clean(spec)


def _watch(spec: Mapping[str, Any], stdin: Any) -> int:
    rule = HangRule(**spec["rule"])
    pid, path = int(spec["pid"]), Path(spec["heartbeat"])
    last: hb.Beat | None = None
    since = time.monotonic_ns()  # when the rank was last seen making progress (or stopped)
    steps: list[float] = []  # recent step durations (s): between two readings, the time per step started
    polled = time.monotonic()
    while True:
        readable, _, _ = select.select([stdin], [], [], POLL_S)
        if readable and not os.read(stdin.fileno(), 65536):
            return 0  # the training closed it: it ended
        if not _alive(pid):
            return 0
        now = time.monotonic()
        gap, polled = now - polled, now
        beat = hb.read(path)
        if beat is None or beat.phase == hb.DONE:
            continue
        if last is None or beat.count != last.count:
            if last is not None and last.phase == hb.STEP and beat.phase == hb.STEP and beat.step > last.step:
                steps = (steps + [(beat.beat_ns - last.beat_ns) / 1e9 / (beat.step - last.step)])[-100:]
            last, since = beat, beat.beat_ns
            continue
        if _stopped(pid) or gap > 5 * POLL_S:  # stopped, or this watchdog was: not silence
            since += int(gap * 1e9)
        silent = (time.monotonic_ns() - since) / 1e9
        limit = rule.limit(beat, max(steps, default=0.0))
        if silent > limit and _on_hang(spec, beat, silent, limit):
            return 0


def main() -> int:
    """``python -m gwenlake_hpc.job.watchdog``: one JSON line (the spec) on standard input, then its end."""
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):  # the training decides when this ends
        signal.signal(sig, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    return watch(json.loads(line), sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main())
