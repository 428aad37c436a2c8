"""Tests of gwenlake_hpc.stores.tracking: URIs, params, and the Tracker against a real MLflow SQLite store.

The tests against a real server, its outages, and a hung one are in tests/integration/test_tracking_e2e.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.stores.tracking import (
    ATTACH_COUNT_TAG,
    PENDING_STATUS_FILE,
    RUN_ID_FILE,
    TRACKING_JSON,
    NullTracker,
    Tracker,
    default_uri,
    flatten,
    is_sqlite,
    sync,
    validate_uri,
)

from helpers.mlflow_server import free_port
from helpers.tracking import history, loss, spool_empty, spool_points, tracking_warnings, wait_for


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


def test_sqlite_store_one_point_per_step(sqlite_dir: Path, tmp_path: Path) -> None:
    uri = default_uri(sqlite_dir)
    state_dir = tmp_path / "run" / "tracking"
    params = flatten({"model": {"lr": 0.001, "layers": [64, 32]}, "seed": 7})
    tracker = Tracker(
        uri, "exp-sqlite", "run-a", state_dir, params=params, tags={"slurm.job_id": "123"},
        artifact_location=str(sqlite_dir / "artifacts"), flush_interval_s=0.2,
    )
    for step in range(1, 51):
        tracker.log_metrics({"loss": loss(step)}, step=step)
        if step % 10 == 0:
            tracker.log_metrics({"auc": step / 100}, step=step)
    tracker.log_metrics({"loss": 123.0}, step=50)  # same step again: dropped
    tracker.log_metrics({"loss": 123.0}, step=7)  # lower step: dropped
    tracker.log_metrics({"gnorm": float("nan")}, step=1)
    tracker.log_metrics({"gnorm": 2.5, "bad": "not a number"}, step=2)  # type: ignore[dict-item]
    tracker.set_tags({"gwenlake.note": "done", "old.name": "7"})
    for _ in range(2):  # a repeated rename (a delivery again after a kill) and a tag the run lacks change nothing
        tracker.rename_tags({"old.name": "new.name", "absent": "never"})
    dataset = {"name": "d", "digest": "abc", "source_type": "code", "source": "{}", "schema": None, "profile": None}
    for _ in range(2):  # the store keeps one input per dataset name and digest (a resumed training logs it again)
        tracker.log_inputs([{"dataset": dataset, "tags": {"mlflow.data.context": "train"}}])
    with pytest.raises(ConfigError):
        tracker.finish("DONE")
    assert tracker.finish("FINISHED") is True
    assert tracker.finish("FINISHED") is True  # idempotent
    tracker.log_metrics({"loss": 0.0}, step=51)  # after finish: ignored

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-a"
    assert run.data.params == {"model.lr": "0.001", "model.layers": "[64, 32]", "seed": "7"}
    assert run.data.tags["slurm.job_id"] == "123"
    assert run.data.tags["gwenlake.note"] == "done"
    assert run.data.tags["new.name"] == "7" and not {"old.name", "absent", "never"} & set(run.data.tags)
    (given,) = run.inputs.dataset_inputs
    assert (given.dataset.name, given.dataset.digest, [(t.key, t.value) for t in given.tags]) == (
        "d", "abc", [("mlflow.data.context", "train")])
    assert run.data.tags[ATTACH_COUNT_TAG] == "0"
    assert history(client, tracker.run_id, "loss") == [(s, loss(s)) for s in range(1, 51)]
    assert history(client, tracker.run_id, "auc") == [(s, s / 100) for s in range(10, 51, 10)]
    gnorm = history(client, tracker.run_id, "gnorm")
    assert len(gnorm) == 2 and math.isnan(gnorm[0][1]) and gnorm[1] == (2, 2.5)
    assert client.get_metric_history(tracker.run_id, "bad") == []
    experiment = client.get_experiment_by_name("exp-sqlite")
    assert experiment.artifact_location.endswith("artifacts")

    assert (state_dir / RUN_ID_FILE).read_text().strip() == tracker.run_id
    assert json.loads((state_dir / TRACKING_JSON).read_text()) == {
        "uri": uri,
        "experiment": "exp-sqlite",
        "run_name": "run-a",
        "artifact_location": str(sqlite_dir / "artifacts"),
        "params": params,
        "tags": {"slurm.job_id": "123"},
    }
    assert spool_empty(state_dir)
    assert not (state_dir / PENDING_STATUS_FILE).exists()


def test_1000_waiting_points_are_sent_before_the_flush_interval(
    sqlite_dir: Path, tmp_path: Path
) -> None:
    uri = default_uri(sqlite_dir)
    tracker = Tracker(uri, "exp-batch", "r", tmp_path / "tracking", flush_interval_s=3600)
    assert tracker.wait_attached(30)
    for step in range(1, 1501):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    client = MlflowClient(uri)
    wait_for(lambda: len(client.get_metric_history(tracker.run_id, "loss")) >= 1000,
             what="a batch sent on size, not on time")
    assert tracker.finish("FINISHED") is True
    assert history(client, tracker.run_id, "loss") == [(s, loss(s)) for s in range(1, 1501)]


def test_refused_names_are_dropped_alone(
    sqlite_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = default_uri(sqlite_dir)
    tracker = Tracker(uri, "exp-refused", "r", tmp_path / "tracking",
                      params={"ok": "1", "bad param!": "2"}, flush_interval_s=0.2)
    for step in range(1, 11):
        tracker.log_metrics({"loss": loss(step), "bad key!": 1.0}, step=step)
    assert tracker.finish("FINISHED") is True
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"ok": "1"}
    assert history(client, tracker.run_id, "loss") == [(s, loss(s)) for s in range(1, 11)]
    messages = [r.getMessage() for r in tracking_warnings(caplog)]
    assert any("refused metric 'bad key!'" in m for m in messages)
    assert any("refused param 'bad param!'" in m for m in messages)


# ------------------------------------------------------------------------------------------
# reattach after eviction


# ------------------------------------------------------------------------------------------
# outages of a real server


def test_sync_needs_tracking_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.json"):
        sync(tmp_path)


def test_sync_drops_points_already_stored_and_torn_lines(
    sqlite_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = default_uri(sqlite_dir)
    state_dir = tmp_path / "tracking"
    first = Tracker(uri, "exp-crash", "r", state_dir, flush_interval_s=0.2)
    for step in range(1, 21):
        first.log_metrics({"loss": loss(step)}, step=step)
    assert first.close(timeout_s=60) is True  # generous: a loaded machine delivers slowly
    # A process crashed while delivering its spool (11..20 are stored already) and its last
    # append was torn.
    lines = [
        json.dumps({"key": "loss", "value": loss(s), "step": s, "timestamp": 1_700_000_000_000})
        for s in range(11, 26)
    ]
    (state_dir / "spool.jsonl").write_text("\n".join(lines) + '\n{"key": "loss", "val')

    # The next process cannot reach the server: its points go to a spool segment of its own.
    down = f"http://127.0.0.1:{free_port()}"
    second = Tracker(down, "exp-crash", "r", state_dir, flush_interval_s=0.2, retry_max_s=0.5)
    for step in range(21, 31):  # 21..25 are in the older spool already: dropped by the delivery
        second.log_metrics({"loss": loss(step)}, step=step)
    assert second.close(timeout_s=0.5) is False
    assert [p["step"] for p in spool_points(state_dir)] == list(range(11, 26)) + list(range(21, 31))

    assert sync(state_dir, uri=uri, timeout_s=30) == {
        "run_id": first.run_id, "delivered": 10, "remaining": 0, "status": None}
    client = MlflowClient(uri)
    assert history(client, first.run_id, "loss") == [(s, loss(s)) for s in range(1, 31)]
    assert client.get_run(first.run_id).info.status == "RUNNING"  # no status was pending
    assert any("1 malformed line" in r.getMessage() for r in tracking_warnings(caplog))
