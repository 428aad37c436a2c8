"""Shared fixtures: a temporary project (``project``) and one observed job (``observed_job``).

The helpers live in tests/helpers/ (a package: ``from helpers.project import make_test_project``); test files
import from there, never from each other. The tiers are folders: unit/ (no services, seconds), integration/
(real MLflow, git, whole jobs in subprocesses: ``slow``), cluster/ (SLURM and SSH: ``slurm``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # `import helpers` from any tier's folder, whatever pytest's import mode
    sys.path.insert(0, str(TESTS))

from helpers.project import Project, make_test_project  # noqa: E402

# Fixtures used by tests in more than one tier, defined beside their helpers (a test module's own fixture of the
# same name takes precedence): `trained`; the tracking tests' `server`, `live`, `sqlite_dir`; `mlproject`,
# `mlflow_server` of the user-MLflow tests.
pytest_plugins = ["helpers.bad_input", "helpers.tracking", "helpers.user_mlflow"]


@pytest.fixture
def project(tmp_path) -> Project:
    return make_test_project(tmp_path / "project")


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
