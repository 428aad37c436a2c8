"""Shared fixtures: a temporary project (``project``), one observed job (``observed_job``), and the check that
the hang watchdog raised no false alarm in the whole session (``_no_false_hangs``).

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

from helpers.project import HANG_EXPECTED, Project, make_test_project  # noqa: E402

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


@pytest.fixture(scope="session", autouse=True)
def _no_false_hangs(tmp_path_factory):
    """Zero false alarms of the hang watchdog across the suite (it is on by default in every job): at the
    session's end, a hang verdict (``hangs/<start>/verdict*.json``) anywhere under the session's temporary folder
    fails the session, unless a folder above it holds :data:`HANG_EXPECTED`."""
    yield
    base = tmp_path_factory.getbasetemp()
    unexpected = [p for p in base.rglob("hangs/*/verdict*.json")
                  if not any((parent / HANG_EXPECTED).exists() for parent in p.parents if base in parent.parents)]
    assert not unexpected, f"the hang watchdog called these runs hung (false alarms): {sorted(map(str, unexpected))}"
