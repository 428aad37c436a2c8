"""Tests of gwenlake_hpc.stores.tracking without a process: URIs, params, the NullTracker.

The Tracker itself (its delivery process) against a real MLflow SQLite store and a real server, its outages,
and a hung one are in tests/integration/test_tracking_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.stores.tracking import NullTracker, default_uri, flatten, is_sqlite, sync, validate_uri


# ------------------------------------------------------------------------------------------
# fixtures and helpers


# ------------------------------------------------------------------------------------------
# URIs, params


@pytest.mark.parametrize("bad", ["file:///x/mlruns", "/plain/path", "mlruns", "ftp://h/x", " "])
def test_validate_uri_rejects_file_store_and_paths(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.uri") as info:
        validate_uri(bad)
    if bad.strip():
        assert "sqlite:///" in str(info.value) and "http://host:port" in str(info.value)


def test_validate_uri_suggests_a_sqlite_file_for_a_path() -> None:
    with pytest.raises(ConfigError, match=r"sqlite:////plain/path/mlflow\.db"):
        validate_uri("/plain/path")
    with pytest.raises(ConfigError, match=r"sqlite:////x/mlruns/mlflow\.db"):
        validate_uri("file:///x/mlruns")


@pytest.mark.parametrize(
    "good",
    [
        "sqlite:////tmp/runs/mlflow.db",
        "http://127.0.0.1:5000",
        "https://mlflow.example.org",
        "postgresql+psycopg2://u@db:5432/mlflow",
        "postgresql://u@db/mlflow",
        "databricks",
    ],
)
def test_validate_uri_accepts(good: str) -> None:
    assert validate_uri(f"  {good} ") == good


def test_a_database_uri_needs_its_driver_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("MySQLdb") is None:
        with pytest.raises(ConfigError, match=r"tracking\.uri=.*needs the Python package MySQLdb"):
            validate_uri("mysql://u@db/mlflow")
    else:
        assert validate_uri("mysql://u@db/mlflow") == "mysql://u@db/mlflow"
    with pytest.raises(ConfigError, match="needs the Python package pg8000"):
        validate_uri("postgresql+pg8000://u@db/mlflow")


def test_a_relative_sqlite_uri_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # So that the delivery process, `tracking sync` from another folder and the next start open the same file.
    monkeypatch.chdir(tmp_path)
    assert validate_uri("sqlite:///rel/m.db") == f"sqlite:///{tmp_path}/rel/m.db"


def test_default_uri_and_is_sqlite(tmp_path: Path) -> None:
    uri = default_uri(tmp_path / "runs")
    assert uri == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert uri.startswith("sqlite:////")  # absolute path: four slashes
    assert is_sqlite(uri) and is_sqlite("sqlite+pysqlite:///x.db")
    assert not is_sqlite("http://127.0.0.1:5000") and not is_sqlite("postgresql://u@h/db")


def test_flatten() -> None:
    cfg = {"model": {"lr": 0.001, "layers": [64, 32], "opt": {"name": "adam"}}, "seed": 7,
           "empty": {}, "long": "x" * 7000}
    assert flatten(cfg) == {
        "model.lr": "0.001",
        "model.layers": "[64, 32]",
        "model.opt.name": "adam",
        "seed": "7",
        "empty": "{}",
        "long": "x" * 6000,
    }
    assert flatten({"a": {"b": 1}}, prefix="cfg.") == {"cfg.a.b": "1"}


def test_null_tracker(tmp_path: Path) -> None:
    t = NullTracker()
    t.log_metrics({"loss": 1.0}, step=1)
    t.set_tags({"a": "b"})
    assert t.run_id is None
    assert t.finish("FINISHED") is True and t.close() is True
    with pytest.raises(ConfigError):
        t.finish("DONE")


# ------------------------------------------------------------------------------------------
# SQLite store


# ------------------------------------------------------------------------------------------
# reattach after eviction


# ------------------------------------------------------------------------------------------
# outages of a real server


def test_sync_needs_tracking_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.json"):
        sync(tmp_path)
