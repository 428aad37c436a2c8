"""Shared fixtures: a temporary project (conf/, a training module, a git repository, a dataset)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@localhost", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@dataclass
class Project:
    """A user's project: cwd of the jobs, its own git repository (also the model repository)."""

    root: Path

    def run(self, *args, env=None, timeout=300, check=None):
        """Run ``python -m gwenlake_hpc ARGS`` in the project; returns CompletedProcess (text)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        full_env.pop("GWENLAKE_CONF", None)
        proc = subprocess.run([sys.executable, "-m", "gwenlake_hpc", *args], cwd=self.root, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        if check is not None and proc.returncode != check:
            raise AssertionError(f"exit {proc.returncode} != {check}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
        return proc

    def popen(self, *args, env=None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", *args], cwd=self.root, env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def git(self, *args):
        return git(self.root, *args)


@pytest.fixture
def project(tmp_path) -> Project:
    return make_test_project(tmp_path / "project")


def make_test_project(root: Path) -> Project:
    """The tests' user project (conf/, tests/project's trainer and job t, dataset t.rows) at ``root``."""
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copy(HERE / "project" / "conf" / "job" / "t.yaml", root / "conf" / "job" / "t.yaml")
    shutil.copy(HERE / "project" / "trainer.py", root / "trainer.py")
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "code")

    from gwenlake_hpc.data import Catalog

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32) + 0.1 * rng.normal(size=200)).astype(np.float32)
    Catalog(root / "data").write("t.rows", {"x": x, "y": y})
    return Project(root)


def make_churn_project(root: Path, message: str = "code") -> Project:
    """A user's project holding the churn example (conf/, examples/), committed in its own git repository."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return Project(root)


def mlflow_server_fixture(tmp_path_factory):
    """Body of a module-scoped ``mlflow server`` fixture: PostgreSQL-backed when one answers, else SQLite."""
    from mlflow_server import postgres_available, serve

    yield from serve(tmp_path_factory.mktemp("mlflow"), backend="postgresql" if postgres_available() else "sqlite")


def run_concurrently(n: int, work) -> dict:
    """Call ``work(i)`` for i in 0..n-1 in n threads released together; returns {i: result}.

    Raises the first exception a thread raised (after all threads ended)."""
    import threading

    barrier = threading.Barrier(n)
    results, errors = {}, []

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def wait_until(pred, timeout_s: float = 60.0, what: str = "") -> None:
    """Poll ``pred()`` every 50 ms until it is true; AssertionError after ``timeout_s`` (generous: loaded machines)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")


@pytest.fixture(scope="session")
def observed_job(tmp_path_factory):
    """One job (``+job=t``, 30 steps) that sends its loss to StatsD (a real UDP socket here, via ``statsd.*``),
    logs tagged metrics and RL rollouts: read by the custom-metric, metric-tag and rollout tests.

    Returns a namespace with ``project``, ``proc`` (CompletedProcess) and ``datagrams`` (bytes received).
    """
    import socket
    import threading
    from types import SimpleNamespace

    project = make_test_project(tmp_path_factory.mktemp("observed") / "project")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(1)
    got: list[bytes] = []
    done = threading.Event()

    def receive():
        while not done.is_set():
            try:
                got.append(sock.recv(65536))
            except socket.timeout:
                continue

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        proc = project.run("+job=t", "job.steps=30", "statsd.host=127.0.0.1", f"statsd.port={sock.getsockname()[1]}",
                           "statsd.prefix=ci", env={"GWL_TEST_CUSTOM_METRIC": "1", "GWL_TEST_TAGGED": "1",
                                                    "GWL_TEST_ROLLOUTS": "1", "STATSD_HOST": ""}, timeout=600)
    finally:
        done.set()
        t.join(10)
        sock.close()
    return SimpleNamespace(project=project, proc=proc, datagrams=got)
