"""The tracking tests' MLflow server (one per module), SQLite folder, polling and readers of the spool."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gwenlake_hpc.stores.tracking import (
    SPOOL_DIR,
)
from gwenlake_hpc.stores.tracking.delivery.spool import points_of, read_all
from mlflow import MlflowClient

from helpers.concurrency import wait_until
from helpers.mlflow_server import MlflowServer, serve

LOGGER = "gwenlake_hpc.tracking"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory.mktemp("mlflow-server"))


@pytest.fixture
def live(server: MlflowServer) -> MlflowServer:
    """The module's server, started again if an earlier test left it stopped."""
    return server.start()


@pytest.fixture(scope="module")
def sqlite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One SQLite store for the module: creating one costs a second of migrations.
    return tmp_path_factory.mktemp("sqlite-store")


def wait_for(pred, timeout_s: float = 60.0, what: str = "") -> None:
    wait_until(pred, timeout_s, what)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def spool_points(state_dir: Path) -> list[dict]:
    """Every point in the spool, oldest first (whole lines; a torn one is skipped, as the delivery does)."""
    return [{"key": k, "value": v, "step": s, "timestamp": t} for k, v, s, t in points_of(read_all(state_dir))]


def spool_empty(state_dir: Path) -> bool:
    return not (state_dir / "spool.jsonl").exists() and not any((state_dir / SPOOL_DIR).glob("*.jsonl"))


def loss(step: int) -> float:
    return round(10.0 / step, 6)


def tracking_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
