"""The delivery process as the training sees it: started, woken, started again when it died, asked to end.

:class:`gwenlake_hpc.stores.tracking.tracker.Tracker` owns one :class:`DeliveryProcess`. The process itself
(``python -m gwenlake_hpc.stores.tracking.delivery``, :mod:`.deliverer`) imports MLflow and sends the spool; this
side only speaks the line protocol: one JSON setup line and then operations (``wake``, ``close``, ``finish``) on
its standard input, events (``log``, ``attached``, ``outage``, ``done``) on its standard output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ....base.lease import current as current_lease
from ....base.processes import shield_children
from ....base.suspend import watch as suspend_watch
from .session import http_env
from .state import sync_hint

logger = logging.getLogger("gwenlake_hpc.tracking")

# After finish()/close() times out, how long the caller still waits for the delivery process's answer before
# it stops that process and records the state itself.
SHUTDOWN_GRACE_S = 1.0
# A delivery process that died while the training runs is started again at the tracker's next check (within
# ``flush_interval_s``), up to QUICK_RESTARTS times in RESTART_WINDOW_S seconds; one that keeps dying (a bug,
# a lost lease) is then started again at most every RESTART_EVERY_S seconds, not in a loop.
QUICK_RESTARTS = 3
RESTART_WINDOW_S = 300.0
RESTART_EVERY_S = 30.0
# The delivery process's niceness: it yields the CPU to the training where they compete for it.
DELIVERY_NICE = 5


class DeliveryProcess:
    """One training's delivery process, from the training's side.

    Args:
        setup: the first line the process reads: ``state_dir``, ``uri`` (with its password: it goes through
            the pipe, never a file), ``flush_interval_s``, ``retry_max_s``, ``after_attach``; ``ppid`` is added,
            and ``lease`` (run directory and token) when this process holds its run's lease.
        on_attached: called as ``on_attached(run_id, marks)`` from the events thread when the process created
            or reattached to the MLflow run (``marks``: the highest step MLflow holds per metric key).

    Attributes:
        attached: set once the run is attached. outage: set while MLflow does not answer (cleared on attach).
    """

    def __init__(self, setup: Mapping[str, Any], on_attached: Callable[[str, Mapping[str, int]], None]) -> None:
        self._setup = dict(setup)
        self._state_dir = Path(str(setup["state_dir"]))
        self._on_attached = on_attached
        self.attached = threading.Event()
        self.outage = threading.Event()
        self._answer = threading.Event()
        self._answer_result = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._proc_lock = threading.Lock()
        self._last_start = -math.inf
        self._restarts: list[float] = []  # monotonic times of the restarts by check(), the recent ones
        # check() (the spool thread) and end()/stop() never both start a process: end() marks this first
        self._restart_lock = threading.Lock()
        self._ending = False

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The running process (None before the start, after :meth:`stop`, or when it could not start)."""
        with self._proc_lock:
            return self._proc

    def start(self) -> None:
        """Start ``python -m gwenlake_hpc.stores.tracking.delivery`` and the thread that reads its events; a failure to
        start is logged (the points stay in the spool for ``tracking sync``)."""
        self._last_start = time.monotonic()
        env = http_env()
        if env.get("MLFLOW_TRACKING_URI", "").startswith("gwenlake-job:"):  # the training's own, not the store's
            env.pop("MLFLOW_TRACKING_URI")
            env.pop("MLFLOW_RUN_ID", None)
        env.setdefault("OMP_NUM_THREADS", "1")
        package_root = str(Path(__file__).resolve().parents[4])  # <root>/gwenlake_hpc/stores/tracking/delivery/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env["GWENLAKE_DELIVERY_NICE"] = str(DELIVERY_NICE)
        try:
            # A session of its own: a Ctrl-C in the terminal is for the training, which then ends the delivery.
            # Stop signals blocked until it ignores them itself (SLURM signals every process of a job step).
            with shield_children():
                proc = subprocess.Popen([sys.executable, "-m", "gwenlake_hpc.stores.tracking.delivery"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        start_new_session=True)
            assert proc.stdin is not None
            lease = current_lease()  # the delivery of a start that loses its run stops delivering (it checks)
            fence = {"lease": {"run_dir": str(lease.run_dir), "token": lease.token}} if lease is not None else {}
            proc.stdin.write((json.dumps({**self._setup, **fence, "ppid": os.getpid()}) + "\n").encode())
            proc.stdin.flush()
        except OSError as exc:
            logger.warning("tracking: cannot start the delivery process (%s); points are kept in %s; `%s` "
                           "delivers them", exc, self._state_dir / "spool", sync_hint(self._state_dir))
            return
        with self._proc_lock:
            self._proc = proc
        # it stops itself while this process is stopped (scontrol suspend; SLURM stops the job step's process
        # group, not its session): this process's watch continues it once this process runs again
        suspend_watch().follow(proc.pid)
        threading.Thread(target=self._read_events, args=(proc,), name="gwenlake-delivery-events",
                         daemon=True).start()

    def _read_events(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "log":
                logging.getLogger(str(event.get("name") or logger.name)).log(
                    int(event.get("level", logging.INFO)), "%s", event.get("msg", ""))
            elif kind == "attached":
                self._on_attached(str(event["run_id"]), event.get("marks") or {})
                self.outage.clear()
                self.attached.set()
            elif kind == "outage":
                self.outage.set()
            elif kind == "done":
                self._answer_result = bool(event.get("result"))
                self._answer.set()
        proc.stdout.close()

    def send(self, op: Mapping[str, Any]) -> bool:
        """Write one operation line; False when the process is not running or its pipe is closed."""
        with self._proc_lock:
            proc = self._proc
            if proc is None or proc.stdin is None or proc.poll() is not None:
                return False
            try:
                proc.stdin.write((json.dumps(op) + "\n").encode())
                proc.stdin.flush()
                return True
            except (OSError, ValueError):
                return False

    def check(self) -> None:
        """Start the process again if it died on its own (killed, a bug, the OOM killer), with a warning naming
        its exit status or signal: at once (the Tracker checks every ``flush_interval_s``), up to
        :data:`QUICK_RESTARTS` times in :data:`RESTART_WINDOW_S` seconds, then at most every
        :data:`RESTART_EVERY_S` seconds. Its points wait in the spool meanwhile: none is lost."""
        with self._restart_lock:
            if not self._ending:
                self._check()

    def _check(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            return
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= QUICK_RESTARTS and now - self._last_start < RESTART_EVERY_S:
            return
        if proc is not None:
            logger.warning("tracking: the delivery process (pid %d) died while the training runs (%s); started "
                           "again (its points wait in the spool of %s)", proc.pid, exit_description(proc.returncode),
                           self._state_dir)
            _reap(proc)
        self._restarts.append(now)
        self.start()

    def end(self, kind: str, status: str | None, end_time: int, timeout_s: float, after: str | None = None) -> bool:
        """Tell the process to deliver everything and end (``finish``: then mark the run ``status``, at
        ``end_time`` ms since the epoch, and call ``after``); True when it answered that it did within
        ``timeout_s`` seconds (plus :data:`SHUTDOWN_GRACE_S` for the answer). A process that is dead, or dies
        meanwhile (killed on its own), is started again at once, twice at most, within the time left."""
        deadline = time.monotonic() + timeout_s + SHUTDOWN_GRACE_S
        with self._restart_lock:  # from now on only this end restarts a dead process
            self._ending = True
        restarts = 0
        while True:
            proc = self.proc
            if proc is None or proc.poll() is not None:
                if restarts >= 2 or time.monotonic() >= deadline - SHUTDOWN_GRACE_S:
                    return False
                restarts += 1
                if proc is not None:
                    logger.warning("tracking: the delivery process (pid %d) died (%s); starting it again to "
                                   "deliver the last points", proc.pid, exit_description(proc.returncode))
                    _reap(proc)
                self.start()
                proc = self.proc
                if proc is None:
                    return False
            left = max(deadline - SHUTDOWN_GRACE_S - time.monotonic(), 0.0)
            op: dict[str, Any] = {"op": kind, "timeout_s": left}
            if status is not None:
                op.update(status=status, end_time=end_time)
            if after:
                op["after"] = after
            self._answer.clear()
            self.send(op)
            while not self._answer.is_set() and proc.poll() is None and time.monotonic() < deadline:
                self._answer.wait(0.1)
            if self._answer.is_set():
                return self._answer_result
            if time.monotonic() >= deadline:
                return False

    def stop(self) -> None:
        """Close the pipe and, if the process is still there, kill it and reap it."""
        with self._restart_lock:
            self._ending = True
        with self._proc_lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _reap(proc)


def exit_description(returncode: int | None) -> str:
    """A process's end in words: ``killed by signal SIGKILL`` for a negative ``returncode`` (Popen's way of
    saying a signal ended it), ``exit status N`` otherwise."""
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exit status {returncode}"


def _reap(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        if proc.stdin is not None:
            proc.stdin.close()
    with contextlib.suppress(OSError):
        if proc.poll() is None:
            proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)
