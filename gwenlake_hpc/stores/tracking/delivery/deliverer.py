"""Delivery: the spool of a run into its MLflow run, out of the training process.

:class:`Deliverer` does the work (connect, create or reattach, deliver the spool in order and exactly once,
remove what was delivered). It runs in the delivery process that each training starts
(``python -m gwenlake_hpc.stores.tracking.delivery``, see :func:`main`), and in ``tracking sync``.

The delivery process talks to the training over its standard input and output, one JSON object a line:

- it reads its settings first: ``{"state_dir", "uri", "flush_interval_s", "retry_max_s", "ppid"}`` (the URI,
  password included, never appears on a command line or in a file);
- then commands: ``{"op": "wake"}`` (points are waiting), ``{"op": "finish", "status", "end_time",
  "timeout_s", "after"}`` (``after``: optional ``"module:function"`` called with (state_dir, uri) once done) or ``{"op": "close", "timeout_s"}`` (the training ends; deliver everything, then reply);
- it writes events: ``{"event": "attached", "run_id", "created", "marks"}``, ``{"event": "log", "name",
  "level", "msg"}`` (its log records, re-emitted by the training's logging), ``{"event": "done", "result"}``.

It ignores SIGTERM, SIGINT and SIGUSR2 (the time-limit warning): SLURM signals every process of a job step at eviction, and the delivery must go
on until the training has written its last points and says so. When the training dies without a word (end of
its standard input, or a new parent process), the delivery process delivers what is there for up to 30 s and
exits. One process at a time delivers a state folder: it holds ``deliver.lock`` (``flock``). While the training is
stopped (``scontrol suspend``) it stops itself too, and the training continues it (:mod:`gwenlake_hpc.base.suspend`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ....base.errors import ConfigError
from ....base.lease import read_holder
from ....base.suspend import follow_parent_stops
from .session import MAX_METRICS_PER_BATCH, RunSession, http_settings
from .spool import Entry, Point, SpoolReader, segment_paths, try_lock
from ..sqlite import BrokenStoreError
from .state import DELIVER_LOCK, PENDING_STATUS_FILE, TRACKING_JSON, read_run_id
from ..uri import redact_uri, scrub, validate_uri

logger = logging.getLogger("gwenlake_hpc.tracking")

#: How long a delivery process whose training died without a word goes on delivering (seconds).
ORPHAN_DELIVERY_S = 30.0


def read_config(state_dir: Path) -> dict[str, Any]:
    """The run description in ``state_dir/tracking.json``.

    Raises:
        ConfigError: missing or unreadable (not the tracking folder of a run).
    """
    path = state_dir / TRACKING_JSON
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        missing = [k for k in ("uri", "experiment", "run_name") if not isinstance(cfg, dict) or k not in cfg]
        if missing:
            raise ValueError(f"not a tracking.json: {', '.join(missing)} missing")
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{state_dir} has no {TRACKING_JSON}: not the tracking folder of a run "
                          f"(expected <run_dir>/tracking)") from None
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path} is unreadable ({exc})") from None
    return cfg


class DeliverLock:
    """``<state_dir>/deliver.lock``: one delivering process per state folder (``flock``, released at exit)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DELIVER_LOCK
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock without waiting; True when held (also where the filesystem has no locks)."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        got = try_lock(fd)
        if got is False:
            os.close(fd)
            return False
        self._fd = fd
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        return True

    def holder(self) -> str:
        """``"host pid"`` of the holder, as it wrote it, or ``"?"``."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        """Release the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class Deliverer:
    """Delivers the spool of ``state_dir`` into the run's MLflow run, in order, each point once.

    Args:
        state_dir: the tracking state folder (``tracking.json`` must exist).
        uri: the tracking URI (with its password, which ``tracking.json`` does not hold).

    Raises:
        ConfigError: no readable ``tracking.json``.
    """

    def __init__(self, state_dir: Path, uri: str) -> None:
        self.state_dir = Path(state_dir)
        self.uri = uri
        self.cfg = {**read_config(self.state_dir), "uri": uri}
        self.reader = SpoolReader(self.state_dir)
        self.session: RunSession | None = None
        self.opened = False
        self.created = False
        self.delivered = 0  # points stored, all sessions
        self.writer_closed = False
        self._warned_malformed = 0
        #: False once the start this delivery serves lost its run (the delivery process's lease check): nothing
        #: more is sent or removed. Always True for ``tracking sync``.
        self.holds: Callable[[], bool] = lambda: True

    @property
    def run_id(self) -> str | None:
        """The run id once known (this process's session, else ``state_dir/run_id``)."""
        if self.session is not None and self.session.run_id:
            return self.session.run_id
        return read_run_id(self.state_dir)

    def connect(self, *, resume: bool, update: bool) -> RunSession:
        """Open a session: the first one creates or reattaches to the run, later ones re-read the marks.

        Raises:
            BrokenStoreError: the SQLite store is unusable. Other exceptions: the store is unreachable.
        """
        session = RunSession(self.uri)
        if not self.opened:
            self.created = session.open_run(self.cfg, read_run_id(self.state_dir), self.state_dir, resume=resume,
                                            update=update)
            self.opened = True
        else:
            session.run_id = read_run_id(self.state_dir)
            session.fetch_marks()
        self.session = session
        return session

    def drop_session(self) -> None:
        """Forget the session after a failure (the next one re-reads the server's marks)."""
        if self.session is not None:
            self.delivered += self.session.delivered
            self.session = None

    def total_delivered(self) -> int:
        """Points stored by this Deliverer so far."""
        return self.delivered + (self.session.delivered if self.session else 0)

    def deliver(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Deliver every whole line in the spool now; remove the segments that are done.

        Returns the number of points stored. Raises on a failure of the store; what was delivered before it
        stays delivered, and the rest is delivered by the next call (a new session filters what arrived).
        """
        session = self.session
        assert session is not None, "connect() first"
        before = session.delivered
        for path in segment_paths(self.state_dir):
            while True:
                start = self.reader.offsets.get(path, 0)
                entries, end = self.reader.read(path, MAX_METRICS_PER_BATCH)
                if end == start:
                    break
                if not self.holds():  # read, then checked: the lease is newer than any segment of a newer start
                    return session.delivered - before
                self._send(session, entries)
                self.reader.advance(path, end)
                if should_stop():
                    return session.delivered - before
            if not self.holds():  # flock is local to a node: a newer start's live segment looks finished here
                return session.delivered - before
            self.reader.try_remove(path, self.writer_closed)
        if self.reader.malformed > self._warned_malformed:
            logger.warning("tracking: skipped %d malformed line(s) in the spool of %s",
                           self.reader.malformed - self._warned_malformed, self.state_dir)
            self._warned_malformed = self.reader.malformed
        return session.delivered - before

    @staticmethod
    def _send(session: RunSession, entries: list[Entry]) -> None:
        points: list[Point] = []
        for entry in entries:
            if isinstance(entry, dict):
                if points:
                    session.log_points(points)
                    points = []
                if "rollout" in entry:
                    session.log_rollout(entry["rollout"])
                elif "params" in entry:
                    session.log_params(entry["params"], existing=session.run_params())
                elif "artifact" in entry:
                    session.log_artifact(entry["artifact"]["file"], entry["artifact"]["path"])
                elif "rename_tags" in entry:
                    session.rename_tags(entry["rename_tags"])
                elif "inputs" in entry:
                    session.log_inputs(entry["inputs"])
                else:
                    session.log_tags(entry["tags"])
            else:
                points.append(entry)
        if points:
            session.log_points(points)

    def remaining(self) -> int:
        """Points in the spool not delivered yet."""
        return self.reader.remaining()


# --------------------------------------------------------------------------------------------
# the delivery process


class _ProtocolHandler(logging.Handler):
    """Sends this process's log records to the training, which logs them as its own."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(logging.INFO)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send({"event": "log", "name": record.name, "level": record.levelno, "msg": record.getMessage()})
        except Exception:  # noqa: BLE001 - the training is gone: stderr still has it
            sys.stderr.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")


class DeliveryProcess:
    """The loop of ``python -m gwenlake_hpc.stores.tracking.delivery`` (see the module docstring)."""

    def __init__(self, setup: dict[str, Any], send: Callable[[dict[str, Any]], None],
                 ops: queue.Queue[dict[str, Any] | None]) -> None:
        self.state_dir = Path(setup["state_dir"])
        self.uri = validate_uri(setup["uri"])
        self.flush_interval_s = float(setup.get("flush_interval_s", 2.0))
        self.retry_max_s = float(setup.get("retry_max_s", 30.0))
        self.ppid = int(setup.get("ppid") or os.getppid())
        self.send = send
        self.ops = ops
        self.d = Deliverer(self.state_dir, self.uri)
        self.lock = DeliverLock(self.state_dir)
        self.outage = False
        self.outage_mark = 0
        self.monitor: Any = None
        self.after_attach = setup.get("after_attach")
        self.hook: threading.Thread | None = None
        lease = setup.get("lease")  # the training's start holds its run by this lease: delivered only while it does
        self.lease = (Path(lease["run_dir"]), str(lease["token"])) if lease else None
        self.d.holds = lambda: not self.lost_lease()

    def lost_lease(self) -> bool:
        """True once the training's start no longer holds its run's lease (a newer start took the run): its
        delivery must stop, the newer start's delivery process delivers the spool from then on."""
        if self.lease is None:
            return False
        holder = read_holder(self.lease[0])
        if holder is not None and holder.token == self.lease[1]:
            return False
        logger.error("tracking: the start of this delivery no longer holds run %s (a newer start took it); "
                     "the delivery stops, the newer start's delivers the spool", self.lease[0])
        return True

    # -- main loop ---------------------------------------------------------------------------

    def run(self) -> None:
        backoff_min = min(1.0, self.retry_max_s)
        backoff, next_try = backoff_min, 0.0
        waited_lock = False
        while True:
            now = time.monotonic()
            if self.lost_lease():
                self.lock.release()
                return
            locked = self.lock.try_acquire()
            if not locked:
                if not waited_lock:
                    waited_lock = True
                    logger.info("tracking: waiting for the delivery process %s of an earlier start to end",
                                self.lock.holder())
            elif now >= next_try or self.d.session is not None:
                try:
                    self._step()
                    backoff = backoff_min
                except Exception as exc:  # noqa: BLE001 - an outage: keep the spool, retry later
                    self._on_failure(exc)
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, self.retry_max_s)
            op = self._next_op(self.flush_interval_s if locked else 0.5)
            if op is False:
                continue
            if op is None or op.get("op") in ("finish", "close"):
                self._stop(op)
                return

    def _next_op(self, timeout: float) -> dict[str, Any] | None | bool:
        """The next command; None when the training is gone; False on timeout or a wake."""
        try:
            op = self.ops.get(timeout=timeout)
        except queue.Empty:
            return None if os.getppid() != self.ppid else False
        if op is not None and op.get("op") == "wake":
            return False
        return op

    def _step(self) -> None:
        if self.d.session is None:
            first = not self.d.opened
            self.d.connect(resume=True, update=True)
            if first:
                self._attached()
        self.d.deliver()
        if self.outage:
            self.outage = False
            logger.info("tracking: server back, delivered %d points", self.d.total_delivered() - self.outage_mark)

    def _attached(self) -> None:
        session = self.d.session
        assert session is not None
        if not self.d.created:
            # This start takes the run over: a status an earlier one could not deliver is stale.
            (self.state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
        self.send({"event": "attached", "run_id": session.run_id, "created": self.d.created,
                   "marks": session.marks})
        self._start_system_metrics(session.rid)
        if self.after_attach:
            self.hook = threading.Thread(target=self._run_hook, args=(str(self.after_attach),),
                                         name="gwenlake-after-attach", daemon=True)
            self.hook.start()

    def _run_hook(self, spec: str) -> None:
        try:
            module, _, name = spec.partition(":")
            getattr(importlib.import_module(module), name)(self.state_dir, self.uri)
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to the delivery
            logger.warning("tracking: %s failed after the run was attached: %s: %s", spec, type(exc).__name__,
                           scrub(exc, self.uri))

    def _on_failure(self, exc: Exception) -> None:
        self.d.drop_session()
        if self.outage:
            return
        self.outage = True
        self.outage_mark = self.d.total_delivered()
        with contextlib.suppress(Exception):
            self.send({"event": "outage"})
        spool = self.state_dir / "spool"
        if isinstance(exc, BrokenStoreError):
            logger.error("tracking: %s; points are kept in %s", exc, spool)
            return
        logger.warning("tracking: MLflow at %s is not answering (%s: %s); points are kept in %s and retried "
                       "(every %.0f s at most); the training goes on", redact_uri(self.uri), type(exc).__name__,
                       scrub(exc, self.uri), spool, self.retry_max_s)

    # -- the end -----------------------------------------------------------------------------

    def _stop(self, op: dict[str, Any] | None) -> None:
        kind = op.get("op") if op else "orphan"
        status = str(op.get("status")) if op and kind == "finish" else None
        timeout_s = float(op.get("timeout_s", 30.0)) if op else ORPHAN_DELIVERY_S
        deadline = time.monotonic() + max(timeout_s - 0.5, 0.0)
        # The training closed its segment before it said so (or is dead): every segment can be finished.
        self.d.writer_closed = True
        self._stop_system_metrics()  # its last points before the run's status
        backoff = 0.25
        result = False
        while True:
            if self.lost_lease():
                break
            if self.lock.try_acquire():
                try:
                    self._step()
                    if self.d.remaining() == 0:
                        if status is not None:
                            assert self.d.session is not None
                            self.d.session.terminate(status, op.get("end_time") if op else None)
                            (self.state_dir / PENDING_STATUS_FILE).unlink(missing_ok=True)
                        result = True
                        break
                except Exception as exc:  # noqa: BLE001
                    self._on_failure(exc)
            if time.monotonic() + backoff >= deadline:
                break
            time.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        if self.hook is not None:
            self.hook.join(max(deadline - time.monotonic(), 0.0))
        if result and op is not None and op.get("after"):
            self._run_hook(str(op["after"]))
        if op is not None:
            with contextlib.suppress(Exception):
                self.send({"event": "done", "result": result})

    # -- MLflow's system metrics ---------------------------------------------------------------

    def _start_system_metrics(self, run_id: str) -> None:
        """MLflow's system metrics (``system/*``), when its own switch ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``
        is on, logged into this run by MLflow's monitor thread in this process; steps continue after the last
        one a previous start logged (``resume_logging``)."""
        if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "").strip().lower() not in ("true", "1"):
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=self.uri)
            self.monitor.start()
        except Exception as exc:  # noqa: BLE001 - psutil missing, an old MLflow: say so, never fail the run
            self.monitor = None
            logger.warning("tracking: MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING is on but MLflow's system metrics "
                           "cannot start (%s: %s)", type(exc).__name__, exc)

    def _stop_system_metrics(self) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            with contextlib.suppress(Exception):
                monitor.finish()


def main() -> int:
    """Entry point of the delivery process (started by the Tracker; not a user command)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(OSError, ValueError):
        os.nice(int(os.environ.get("GWENLAKE_DELIVERY_NICE", "0")))
    # Our events travel on the original standard output; anything else printing there goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    send_lock = threading.Lock()

    def send(event: dict[str, Any]) -> None:
        with send_lock:
            try:
                proto.write(json.dumps(event) + "\n")
            except (OSError, ValueError):
                # The training is gone (killed): its events have no reader, which says nothing about MLflow.
                # A log record still reaches stderr (_ProtocolHandler); other events are for nobody now.
                if event.get("event") == "log":
                    raise

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pkg = logging.getLogger("gwenlake_hpc")
    pkg.setLevel(logging.INFO)
    pkg.propagate = False
    pkg.addHandler(_ProtocolHandler(send))
    line = sys.stdin.readline()
    if not line:
        return 0
    setup = json.loads(line)
    # A suspended SLURM job (scontrol suspend) stops its delivery too: no CPU, no network. Only under SLURM, whose
    # resume continues both: a training SIGSTOPped by hand elsewhere could leave it stopped for good, holding a
    # lock of the tracking store (a SQLite write) that other runs' deliveries wait for.
    if setup.get("ppid") and os.environ.get("SLURM_JOB_ID"):
        follow_parent_stops(int(setup["ppid"]))
    ops: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_ops() -> None:
        for raw in sys.stdin:
            with contextlib.suppress(ValueError):
                ops.put(json.loads(raw))
        ops.put(None)  # the training closed its end, or died

    threading.Thread(target=read_ops, name="gwenlake-delivery-ops", daemon=True).start()
    try:
        with http_settings():
            DeliveryProcess(setup, send, ops).run()
    except Exception:  # noqa: BLE001 - a bug: the spool keeps the points, the next start delivers them
        logger.exception("tracking: the delivery process failed; points stay in the spool of %s",
                         setup.get("state_dir"))
        return 1
    return 0
