"""Start and stop a real ``mlflow server`` on the loopback interface, for tests.

Usage::

    from helpers.mlflow_server import MlflowServer, serve, sqlite_backend

    with MlflowServer(sqlite_backend(tmp_path), workdir=tmp_path) as server:
        client = mlflow.MlflowClient(server.uri)      # "http://127.0.0.1:<port>"
        server.stop(kill=True)                        # an outage (SIGKILL of the process group)
        server.start()                                # same port, same backend

    @pytest.fixture(scope="module")
    def mlflow_server(tmp_path_factory):
        yield from serve(tmp_path_factory.mktemp("mlflow"))

The server runs in its own session (process group), so that ``stop`` ends it with all its
workers; any server still running when the interpreter exits is killed. Start-up takes a few
seconds (``mlflow server`` imports a lot), so share one server per test module.

The backend is SQLite by default. :func:`postgres_backend` creates a fresh database on a
PostgreSQL reachable at 127.0.0.1:5432 (user ``postgres``, trust auth) with ``psql``; the server
then also needs a PostgreSQL driver (``psycopg2`` or ``psycopg``) in this interpreter: check
:func:`postgres_available` and skip otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

_LIVE: set[MlflowServer] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Tell whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def sqlite_backend(workdir: str | os.PathLike[str], name: str = "mlflow.db") -> str:
    """Return ``sqlite:///<absolute workdir>/<name>`` (the file is created by the server)."""
    return f"sqlite:///{Path(workdir).absolute() / name}"


def postgres_driver() -> str | None:
    """The SQLAlchemy PostgreSQL driver importable here: ``"psycopg"``, ``"psycopg2"`` or None.

    Named explicitly in URIs: SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg (3).
    """
    for name in ("psycopg", "psycopg2"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def postgres_available(host: str = "127.0.0.1", port: int = 5432) -> bool:
    """Tell whether a PostgreSQL backend can be used: server reachable, ``psql`` and a driver."""
    return (
        postgres_driver() is not None and shutil.which("psql") is not None and port_open(host, port)
    )


def postgres_backend(
    dbname: str | None = None, host: str = "127.0.0.1", port: int = 5432, user: str = "postgres"
) -> str:
    """Create a fresh, empty database with ``psql`` and return its SQLAlchemy URI.

    Args:
        dbname: database name; default a random ``mlflow_test_<hex>``.
        host, port, user: the PostgreSQL server (trust auth: no password).

    Returns:
        ``postgresql+<driver>://<user>@<host>:<port>/<dbname>`` (see :func:`postgres_driver`).
        Drop it with :func:`drop_postgres_database`.

    Raises:
        subprocess.CalledProcessError: ``psql`` failed (server down, name taken...).
    """
    dbname = dbname or f"mlflow_test_{uuid.uuid4().hex[:12]}"
    _psql(f'CREATE DATABASE "{dbname}"', host, port, user)
    driver = postgres_driver() or "psycopg2"
    return f"postgresql+{driver}://{user}@{host}:{port}/{dbname}"


def drop_postgres_database(
    dbname: str, host: str = "127.0.0.1", port: int = 5432, user: str = "postgres"
) -> None:
    """Drop a database made by :func:`postgres_backend` (``WITH (FORCE)``: PostgreSQL >= 13)."""
    _psql(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)', host, port, user)


def _psql(sql: str, host: str, port: int, user: str) -> None:
    subprocess.run(
        ["psql", "-h", host, "-p", str(port), "-U", user, "-d", "postgres", "-v",
         "ON_ERROR_STOP=1", "-c", sql],
        check=True,
        capture_output=True,
        timeout=30,
    )


class MlflowServer:
    """A real ``mlflow server`` process bound to loopback.

    Args:
        backend_uri: ``--backend-store-uri`` (e.g. :func:`sqlite_backend`).
        port: TCP port; default a free one, picked once, so that a restart uses the same port
            (clients keep their URI across an outage).
        workdir: folder for the server's log (``mlflow-server-<port>.log``), its artifacts
            (``mlartifacts/``) and its working directory; default a new temporary folder.
        host: interface to bind, 127.0.0.1 by default.
        startup_timeout_s: how long :meth:`start` waits for ``/health`` to answer, in seconds.
            A new PostgreSQL database is migrated first (silently: the log stays empty); on a
            loaded CI machine that took 62 s, so the default is generous.

    Attributes:
        uri: ``http://<host>:<port>``, the tracking URI to give clients.
        port, backend_uri, workdir, log_path.

    Job execution (MLflow's huey workers) is disabled: it is not needed for tracking and
    doubles the process count.
    """

    def __init__(
        self,
        backend_uri: str,
        port: int | None = None,
        workdir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.backend_uri = backend_uri
        self.host = host
        self.port = int(port) if port is not None else free_port(host)
        if workdir is None:
            workdir = tempfile.mkdtemp(prefix="mlflow-server-")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"mlflow-server-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        """The tracking URI of this server: ``http://<host>:<port>``."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server process started by :meth:`start` is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the ``mlflow server`` process (its process group id too), or None."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> MlflowServer:
        """Start the server and wait until ``GET /health`` answers; no-op if running.

        Raises:
            RuntimeError: the port is taken by another process, the server exited, or it did
                not answer within ``startup_timeout_s`` (it is stopped then); the message ends
                with the tail of its log.
        """
        if self.running:
            return self
        if port_open(self.host, self.port):
            raise RuntimeError(f"port {self.port} on {self.host} is already in use")
        env = dict(os.environ)
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", self.backend_uri,
            "--artifacts-destination", str(self.workdir / "mlartifacts"),
            "--host", self.host,
            "--port", str(self.port),
            "--workers", "1",
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
            log.flush()
            # A new session: stop() signals the whole process group (uvicorn runs as a child).
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._cleanup_group()
                raise RuntimeError(
                    f"mlflow server exited with status {self._proc.returncode}\n{self.log_tail()}"
                )
            if self._healthy():
                return self
            time.sleep(0.1)
        self.stop(kill=True)
        raise RuntimeError(
            f"mlflow server did not answer within {self.startup_timeout_s} s\n{self.log_tail()}"
        )

    def stop(self, kill: bool = False, timeout_s: float = 15.0) -> None:
        """Stop the server and every process of its group; no-op if not started.

        Args:
            kill: SIGKILL at once (a crash, for outage tests) instead of SIGTERM first.
            timeout_s: after SIGTERM, how long to wait before SIGKILL.
        """
        if self._proc is None:
            return
        pgid = self._proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self._group_alive(pgid) and time.monotonic() < deadline:
            self._proc.poll()  # reap the leader so that it does not count as alive
            time.sleep(0.05)
        self._cleanup_group()
        self._proc.wait()
        _LIVE.discard(self)

    def restart(self, kill: bool = False) -> MlflowServer:
        """Stop (SIGKILL if ``kill``) and start again, on the same port and backend."""
        self.stop(kill=kill)
        return self.start()

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server's log, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=1.0) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _cleanup_group(self) -> None:
        if self._proc is None:
            return
        pgid = self._proc.pid
        if self._group_alive(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while self._group_alive(pgid) and time.monotonic() < deadline:
                self._proc.poll()
                time.sleep(0.05)

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        """Tell whether a process of group ``pgid`` is still running (zombies do not count)."""
        proc = Path("/proc")
        if not proc.is_dir():
            try:
                os.killpg(pgid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the ")" closing the command name: state, ppid, pgrp, ...
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) >= 3 and fields[2] == str(pgid) and fields[0] != "Z":
                return True
        return False

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"MlflowServer({self.uri}, backend={self.backend_uri!r}, {state})"


def serve(
    workdir: str | os.PathLike[str], backend: str = "sqlite", port: int | None = None
) -> Iterator[MlflowServer]:
    """Yield a started server and stop it afterwards: ``yield from serve(...)`` in a fixture.

    Args:
        workdir: the server's folder (see :class:`MlflowServer`); holds the SQLite file.
        backend: ``"sqlite"`` (default), ``"postgresql"`` (a fresh database, dropped at the
            end; needs :func:`postgres_available`), or a backend URI used as is.
        port: default a free port.
    """
    dbname = None
    if backend == "sqlite":
        backend_uri = sqlite_backend(workdir)
    elif backend == "postgresql":
        backend_uri = postgres_backend()
        dbname = backend_uri.rsplit("/", 1)[-1]
    else:
        backend_uri = backend
    server = MlflowServer(backend_uri, port=port, workdir=workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if dbname is not None:
            with contextlib.suppress(Exception):
                drop_postgres_database(dbname)


@atexit.register
def _stop_all() -> None:
    # A test that failed between start() and stop() must not leave a server behind.
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(kill=True, timeout_s=5.0)


def mlflow_server_fixture(tmp_path_factory):
    """Body of a module-scoped ``mlflow server`` fixture: PostgreSQL-backed when one answers, else SQLite."""
    yield from serve(tmp_path_factory.mktemp("mlflow"), backend="postgresql" if postgres_available() else "sqlite")
