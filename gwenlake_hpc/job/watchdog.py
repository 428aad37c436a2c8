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
  ``verdict-rank<r>.json``, and in a multi-rank job makes ``hangs/.request-<start>``, on which every other
  rank's watchdog (polling for it once its own rank has been silent a while) takes its own rank's stacks too. After gathering the ranks' records
  (:func:`gather_window_s`) one watchdog writes the job's verdict (:mod:`gwenlake_hpc.job.hang_report`: the
  ranks that stopped first, their host, where they are), prints it and queues it for the MLflow run; then each
  SIGKILLs its rank, whose job step ends killed by a signal: the SLURM teardown requeues it within
  ``launcher.max_retries`` (it resumes from the newest sealed checkpoint), unless the start before hung at the
  same step (:mod:`gwenlake_hpc.launch.requeue`).

No false alarms: a rank stopped by SIGSTOP (``T`` in ``/proc``) is not silent while stopped, nor are the other
ranks of its job, which wait for it (its watchdog marks it, ``hangs/.stopped-<start>-rank<r>``), and a gap in
the watchdog's own polling (the whole job stopped, the machine suspended) is not counted either. It ends when its
standard input closes: the training ended, however it ended.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import ConfigError
from ..base.fsutil import write_json_atomic
from ..base.processes import shield_children
from ..base.waits import snapshot as thread_snapshot
from ..runtime import heartbeat as hb
from ..runtime.ranks import node_name
from . import hang_report as report

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
#: Rank 0's watchdog writes the rank's step and when it began to ``<run_dir>/progress.json`` at most this often
#: (seconds): what ``status`` shows as a running job's last step and its age.
PROGRESS_EVERY_S = 5.0
PROGRESS_FILE = "progress.json"
#: Times a watchdog process that ended while its training runs is started again.
RESTARTS = 3
#: Seconds between two looks at the training's threads (their names, which of ours each waits for), written
#: beside the heartbeat when they changed: a hang's verdict names the thread the main thread waits for.
THREADS_EVERY_S = 1.0


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
        world_size: the job's ranks (their watchdogs gather their records into one verdict).
        tracking_state_dir: the MLflow run's state folder where this rank reports (rank 0), else None: the
        verdict is queued there for the run (the tag ``gwenlake.hang``, the stack files as artifacts).
        ledger: this start's goodput ledger file (rank 0, :mod:`gwenlake_hpc.runtime.ledger`), else None: once
        the rank is killed, its end is recorded there as ``hang``.

    Its thread also writes, every :data:`THREADS_EVERY_S` when they changed, the process's thread names and
    waits (:func:`gwenlake_hpc.base.waits.snapshot`) to :func:`threads_path` beside the heartbeat: the watchdog
    process reads them on a hang, to name the thread the main thread waits for and where that one blocks.

    A watchdog process that ends while the training runs (killed by hand, out of memory) is started again, with
    a warning, up to :data:`RESTARTS` times: a thread of the training waits on it (no cost to the loop).
    """

    def __init__(self, rule: HangRule, run_dir: Path, rank: int, heartbeat: Path, started: str,
                 world_size: int = 1, tracking_state_dir: Path | None = None, ledger: Path | None = None):
        self.rule, self.run_dir, self.rank, self.heartbeat = rule, Path(run_dir), rank, Path(heartbeat)
        hangs = self.run_dir / "hangs"
        hangs.mkdir(parents=True, exist_ok=True)
        self.dump_path = hangs / f".stacks-rank{rank:05d}-{os.getpid()}.txt"
        self._dump = open(self.dump_path, "w")
        self.threads_path = threads_path(self.heartbeat)
        self._threads: dict[str, Any] | None = None  # the snapshot last written
        faulthandler.register(DUMP_SIGNAL, file=self._dump, all_threads=True, chain=False)
        self._spec = {"rule": asdict(rule), "run_dir": str(self.run_dir), "rank": rank, "pid": os.getpid(),
                      "heartbeat": str(self.heartbeat), "dump": str(self.dump_path),
                      "threads": str(self.threads_path),
                      "host": node_name(), "started": started,
                      "world_size": int(world_size),
                      "tracking_state_dir": str(tracking_state_dir) if tracking_state_dir else None,
                      "ledger": str(ledger) if ledger else None}
        self._lock = threading.Lock()
        self._stopping = False
        self._proc = self._spawn()
        threading.Thread(target=self._guard, name="gwenlake-watchdog-guard", daemon=True).start()

    def _spawn(self) -> subprocess.Popen:
        with shield_children():  # an eviction's SIGTERM must not end the watchdog before the training
            proc = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc.job.watchdog"],
                                    stdin=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(self._spec) + "\n").encode())
        proc.stdin.flush()
        return proc

    def _guard(self) -> None:
        attempt = 0
        while True:
            try:
                status = self._proc.wait(timeout=THREADS_EVERY_S)
            except subprocess.TimeoutExpired:
                self._publish_threads()
                continue
            with self._lock:
                if self._stopping:
                    return
                if attempt == RESTARTS:
                    log.warning("the hang watchdog of rank %d ended again (status %s): this rank's hangs are no "
                                "longer watched", self.rank, status)
                    return
                attempt += 1
                log.warning("the hang watchdog of rank %d ended (status %s) while the training runs: started "
                            "again (%d of %d)", self.rank, status, attempt, RESTARTS)
                self._proc = self._spawn()

    def _publish_threads(self) -> None:
        """Write the threads' snapshot when it changed: a temporary file renamed over it (whole for a reader;
        node-local memory, not fsynced: it is of no use after a crash). A failure is no hang's business."""
        now = thread_snapshot()
        if now == self._threads:
            return
        tmp = self.threads_path.with_name(self.threads_path.name + ".tmp")
        with self._lock:  # never after stop() removed it
            if self._stopping:
                return
            try:
                tmp.write_text(json.dumps(now))
                os.replace(tmp, self.threads_path)
                self._threads = now
            except OSError as exc:
                log.debug("could not write %s: %s", self.threads_path, exc)

    def stop(self) -> None:
        """End the watchdog (it reads the end of its standard input) and drop the dump file if unused."""
        with self._lock:
            self._stopping = True
            proc = self._proc
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
        faulthandler.unregister(DUMP_SIGNAL)
        self._dump.close()
        self.threads_path.unlink(missing_ok=True)
        try:  # a newer start's sweep may have removed it already (this start lost its run meanwhile)
            if self.dump_path.stat().st_size == 0:
                self.dump_path.unlink()
        except FileNotFoundError:
            pass


def heartbeat_name(run_key: str, rank: int) -> str:
    """This process's heartbeat file name (in :func:`~gwenlake_hpc.runtime.heartbeat.heartbeat_dir`): the user,
    the run, the process and the rank."""
    return f"gwenlake-{os.getuid()}-{run_key}-{os.getpid()}-rank{rank}.heartbeat"


def threads_path(heartbeat: Path) -> Path:
    """Where the training's threads' snapshot lies: beside its heartbeat (node-local), ``.threads``."""
    return Path(heartbeat).with_suffix(".threads")


def sweep_leftovers(run_dir: Path, run_key: str, is_main: bool) -> None:
    """Before a start's watchdogs: remove what killed ranks of earlier starts of this run left (a rank SIGKILLed
    with its watchdog, by ``scancel`` or srun, cannot): this run's heartbeats on this node whose process is gone,
    and, on rank 0 (one start of a run trains at a time: the run lock), the run's stack scratch files and
    markers (``hangs/.stacks-*``, ``.stopped-*``, ``.request-*``)."""
    prefix = f"gwenlake-{os.getuid()}-{run_key}-"
    for path in [*hb.heartbeat_dir().glob(f"{prefix}*-rank*.heartbeat"),
                 *hb.heartbeat_dir().glob(f"{prefix}*-rank*.threads")]:
        try:
            os.kill(int(path.name[len(prefix):].split("-")[0]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue
    if is_main:
        for pattern in (".stacks-*", ".stopped-*", ".request-*"):
            for path in (Path(run_dir) / "hangs").glob(pattern):
                path.unlink(missing_ok=True)


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, ...); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _stopped(pid: int) -> bool:
    """True while process ``pid`` is stopped (SIGSTOP, a debugger): its state in ``/proc`` is T or t."""
    return (_proc_stat(pid) or [""])[0] in ("T", "t")


def _alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (dead, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    return fields is not None and fields[:1] != ["Z"]


def _take(spec: Mapping[str, Any], beat: hb.Beat | None, silent_s: float, limit_s: float,
          detected: bool) -> dict[str, Any] | None:
    """Dump the rank's stacks and write its record (``hangs/<start>/rank<r>.txt``, ``verdict-rank<r>.json``);
    None (nothing written) when ``detected`` (its own limit passed) and the rank made progress meanwhile (the
    dump's signal can end a blocking call early). ``detected`` False: another rank's watchdog asked for it."""
    pid, rank, dump = int(spec["pid"]), int(spec["rank"]), Path(spec["dump"])
    before = dump.stat().st_size if dump.exists() else 0
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return None
    deadline, size = time.monotonic() + 5.0, -1
    while time.monotonic() < deadline:  # faulthandler writes at once; wait until the file stops growing
        time.sleep(0.2)
        now = dump.stat().st_size if dump.exists() else 0
        if now > before and now == size:
            break
        size = now
    stacks = dump.read_text(errors="replace")[before:] if dump.exists() else ""
    now_beat = hb.read(Path(spec["heartbeat"]))
    if detected and beat is not None and now_beat is not None and now_beat.count != beat.count:
        print(f"gwenlake_hpc: hang watchdog: rank {rank} on {spec['host']} was silent for {silent_s:.0f} s in step "
              f"{beat.step} and went on after its stacks were taken: not ended", file=sys.stderr, flush=True)
        return None
    folder = _folder(spec)
    folder.mkdir(parents=True, exist_ok=True)
    step = beat.step if beat is not None else 0
    phase = (hb.PHASE_NAMES.get(beat.phase, str(beat.phase)) if beat is not None else "unknown") + (
        " (evaluation step)" if beat is not None and beat.at_eval else "") + (
        " (first step)" if beat is not None and beat.first else "")
    head = (f"host {spec['host']}\nrank {rank}\npid {pid}\nstep {step}\nphase {phase}\n"
            f"silent {silent_s:.1f} s\nlimit {limit_s:.1f} s\n"
            f"found by {'this rank' if detected else 'another rank'}'s watchdog\n\n")
    stack_file = folder / f"rank{rank}.txt"
    stack_file.write_text(head + (stacks or "(no stacks: the process did not answer the dump signal)\n"))
    thread_id = beat.thread_id if beat is not None else 0
    main, user = report.where(stacks, thread_id)
    record = {"rank": rank, "host": spec["host"], "pid": pid, "step": step, "phase": phase,
              "silent_s": math.ceil(silent_s * 10) / 10, "limit_s": round(limit_s, 1), "detected": detected,
              "activity": report.activity(stacks, thread_id), "main_thread_at": main, "user_code_at": user,
              "waits_for": report.waited_thread(stacks, thread_id, _read_threads(spec)),
              "stacks": str(stack_file), "time": time.time()}
    report.write_record(folder, record)
    at = report.main_thread_text(record)
    print(f"gwenlake_hpc: hang watchdog: rank {rank} on {spec['host']}: no progress for {silent_s:.0f} s in step "
          f"{step} ({phase}; limit {limit_s:.0f} s), {record['activity']}: {at}; stacks: {stack_file}",
          file=sys.stderr, flush=True)
    return record


def _read_threads(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The training's threads' snapshot (:meth:`Watchdog._publish_threads`), None when missing or unreadable."""
    try:
        data = json.loads(Path(spec["threads"]).read_text()) if spec.get("threads") else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _folder(spec: Mapping[str, Any]) -> Path:
    """This start's ``<run_dir>/hangs/<start>/`` (the same for every rank)."""
    return Path(spec["run_dir"]) / "hangs" / str(spec["started"])


def gather_window_s(limit_s: float) -> float:
    """Seconds a watchdog waits for the other ranks' records before it ends its rank: every rank's watchdog
    takes its stacks within about a second of the request, a lost node's never (10-60 s)."""
    return min(60.0, max(10.0, limit_s / 4))


def _end(spec: Mapping[str, Any], record: Mapping[str, Any], limit_s: float) -> None:
    """Wait for the other ranks' records, report the job's verdict (one watchdog does, rank 0's when it can),
    then SIGKILL the rank and its children."""
    folder, world = _folder(spec), int(spec.get("world_size", 1))
    records = report.gather(folder, world, gather_window_s(limit_s)) if world > 1 else [dict(record)]
    if int(record["rank"]) != 0 and world > 1:
        time.sleep(2.0)  # rank 0's watchdog reports first when it is there (it holds the tracking folder)
    verdict = report.joint_verdict(records or [dict(record)], folder)
    if report.publish_verdict(folder, verdict):
        print(verdict["line"], file=sys.stderr, flush=True)
        state_dir = spec.get("tracking_state_dir")
        if state_dir:
            try:
                report.queue_for_tracking(Path(state_dir), folder, verdict)
            except OSError as exc:
                print(f"gwenlake_hpc: hang watchdog: could not queue the hang for MLflow: {exc}", file=sys.stderr,
                      flush=True)
    pid = int(spec["pid"])
    _clean(spec, killing=True)  # before the kill: srun may end this watchdog with the step
    from ..runtime.ledger import append_end, process_age_s

    age_s = process_age_s(pid) if spec.get("ledger") else None  # the hung start's time, up to its kill
    children = _children(pid)  # DataLoader workers and the like: read before the rank dies (then reparented)
    for target in [pid, *children]:
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:  # so that its files can be removed (watch's end)
        time.sleep(0.1)
    if spec.get("ledger"):  # rank 0's goodput ledger: its start ended by a hang (the rank can no longer say so)
        try:
            append_end(spec["ledger"], "hang", elapsed_s=age_s or None)
        except OSError as exc:
            print(f"gwenlake_hpc: hang watchdog: could not record the hang in the ledger: {exc}", file=sys.stderr,
                  flush=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``; this watchdog excepted)."""
    mine = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != mine
            and ((_proc_stat(e) or [])[1:2] == [str(pid)])]


def _clean(spec: Mapping[str, Any], killing: bool = False) -> None:
    """The rank's heartbeat file, its stack scratch file (its stacks are in ``rank<r>.txt`` once taken) and its
    stopped marker, once the rank is gone or about to be killed (a killed rank cannot remove them)."""
    Path(spec["heartbeat"]).unlink(missing_ok=True)
    if spec.get("threads"):
        Path(spec["threads"]).unlink(missing_ok=True)
    hangs = Path(spec["run_dir"]) / "hangs"
    (hangs / f".stopped-{spec['started']}-rank{int(spec['rank'])}").unlink(missing_ok=True)
    dump = Path(spec["dump"])
    try:
        if killing or dump.stat().st_size == 0 or not _alive(int(spec["pid"])):
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
    pid, path, rank = int(spec["pid"]), Path(spec["heartbeat"]), int(spec["rank"])
    shared = int(spec.get("world_size", 1)) > 1
    hangs, started = Path(spec["run_dir"]) / "hangs", str(spec["started"])
    request, stopped_mark = hangs / f".request-{started}", hangs / f".stopped-{started}-rank{rank}"
    progress = Path(spec["run_dir"]) / PROGRESS_FILE if rank == 0 else None
    written, written_step = -PROGRESS_EVERY_S, 0
    marked = False  # whether this rank's stopped marker is there (changed only when the state does)
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
        stopped = _stopped(pid)
        if shared and stopped != marked:  # the other ranks' watchdogs must know: their ranks wait for this one
            marked = _mark(stopped_mark, stopped)
        if last is None or beat.count != last.count:  # progress, seen now (to within a poll: beats hold no time)
            seen = time.monotonic_ns()
            if last is not None and last.phase == hb.STEP and beat.phase == hb.STEP and beat.step > last.step:
                steps = (steps + [(seen - since) / 1e9 / (beat.step - last.step)])[-100:]
            last, since = beat, seen
            if progress is not None and now - written >= PROGRESS_EVERY_S and beat.step > written_step:
                written, written_step = now, beat.step
                _write_progress(progress, beat.step, time.time())
            continue
        limit = rule.limit(beat, max(steps, default=0.0))
        # Only a rank silent for a while reads the shared folder (a listing a second): a peer stopped, a request.
        names = _names(hangs) if shared and (time.monotonic_ns() - since) / 1e9 > min(limit / 4, 10.0) else set()
        peer_stopped = any(n.startswith(f".stopped-{started}-rank") for n in names - {stopped_mark.name})
        if stopped or peer_stopped or gap > 5 * POLL_S:  # stopped (this rank, another, this watchdog): no silence
            since = min(since + int(gap * 1e9), time.monotonic_ns())
        silent = max(0.0, (time.monotonic_ns() - since) / 1e9)
        if silent > limit:
            record = _take(spec, beat, silent, limit, detected=True)
            if record is not None:
                if shared:
                    request.touch()  # the other ranks' watchdogs take their stacks now (they poll for it)
                _end(spec, record, limit)
                return 0
        elif request.name in names:  # another rank hung: this one's stacks, then its end
            record = _take(spec, beat, silent, limit, detected=False)
            if record is not None:
                _end(spec, record, limit)
                return 0


def _names(folder: Path) -> set[str]:
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def _mark(path: Path, present: bool) -> bool:
    """Make or remove the marker ``path``; returns whether it is there now (best effort: a shared folder that
    fails is no hang, and the next poll tries again)."""
    try:
        if present:
            path.touch()
        else:
            path.unlink(missing_ok=True)
        return present
    except OSError:
        return not present


def _write_progress(path: Path, step: int, when: float) -> None:
    """``<run_dir>/progress.json``: the rank's step and when it began (Unix s), written durably; what ``status``
    shows of a running job. A failure to write it is no hang's business (a status hint)."""
    try:
        write_json_atomic(path, {"step": step, "time": round(when, 3)})
    except OSError as exc:
        log.debug("could not write %s: %s", path, exc)


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
