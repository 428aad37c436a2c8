"""Tests of gwenlake_hpc.stores.tracking's Tracker (its delivery process) against a real MLflow: a SQLite store
and a real server.

The server (tests/helpers/mlflow_server.py) is started once for the module; the outage tests kill it
(SIGKILL of its process group) and start it again on the same port and backend.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.stores.tracking import (
    ATTACH_COUNT_TAG,
    PENDING_STATUS_FILE,
    RUN_ID_FILE,
    TRACKING_JSON,
    Tracker,
    default_uri,
    flatten,
    sync,
)

from helpers.mlflow_server import MlflowServer, free_port, postgres_available, serve
from helpers.tracking import history, LOGGER, loss, spool_empty, spool_points, tracking_warnings, wait_for


# ------------------------------------------------------------------------------------------
# fixtures and helpers


# ------------------------------------------------------------------------------------------
# URIs, params


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


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["close", "killed"])
@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_reattach_after_eviction(
    store: str, ending: str, sqlite_dir: Path, live: MlflowServer, tmp_path: Path
) -> None:
    uri = default_uri(sqlite_dir) if store == "sqlite" else live.uri
    experiment = f"exp-reattach-{store}-{ending}"
    state_dir = tmp_path / "tracking"
    client = MlflowClient(uri)

    first = Tracker(uri, experiment, "r", state_dir, params={"lr": "0.1"},
                    tags={"slurm.job_id": "1"}, flush_interval_s=0.2, retry_max_s=1)
    for step in range(1, 31):
        first.log_metrics({"loss": loss(step)}, step=step)
    if ending == "close":
        assert first.close() is True  # evicted: no terminal status
        assert client.get_run(first.run_id).info.status == "RUNNING"
    else:
        assert first.finish("KILLED") is True
        assert client.get_run(first.run_id).info.status == "KILLED"
    run_id = first.run_id
    assert history(client, run_id, "loss") == [(s, loss(s)) for s in range(1, 31)]

    # The requeued job resumes from its checkpoint at step 20 and replays 21..30.
    second = Tracker(uri, experiment, "r", state_dir, params={"lr": "0.1"},
                     tags={"slurm.job_id": "2"}, flush_interval_s=0.2, retry_max_s=1)
    assert second.run_id == run_id  # read from state_dir, before any server call
    for step in range(21, 61):
        second.log_metrics({"loss": loss(step)}, step=step)
    assert second.wait_attached(30)
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert run.data.tags[ATTACH_COUNT_TAG] == "1"
    assert run.data.tags["slurm.job_id"] == "2"
    assert second.finish("FINISHED") is True

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1"}
    assert history(client, run_id, "loss") == [(s, loss(s)) for s in range(1, 61)]
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]


# ------------------------------------------------------------------------------------------
# outages of a real server


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


@pytest.mark.slow
def test_server_outage_spools_then_delivers_once(
    live: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    state_dir = tmp_path / "tracking"
    client = MlflowClient(live.uri)
    tracker = Tracker(live.uri, "exp-outage", "r", state_dir, flush_interval_s=0.2,
                      retry_max_s=0.5)
    for step in range(1, 51):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    assert tracker.wait_attached(30)
    run_id = tracker.run_id
    wait_for(lambda: len(client.get_metric_history(run_id, "loss")) == 50, what="50 points")

    live.stop(kill=True)
    started = time.perf_counter()
    for step in range(51, 251):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    assert time.perf_counter() - started < 0.5  # the training loop does not wait
    # On disk while the server is down (the spool still holds 1..50 too: its writer is alive).
    wait_for(lambda: len([p for p in spool_points(state_dir) if p["step"] > 50]) == 200, what="200 spooled points")
    assert [p["step"] for p in spool_points(state_dir) if p["step"] > 50] == list(range(51, 251))
    assert [p for p in spool_points(state_dir) if p["step"] > 50][0] == {
        "key": "loss", "value": loss(51), "step": 51, "timestamp": pytest.approx(
            time.time() * 1000, abs=60_000)}
    time.sleep(1.0)  # several failed reconnections: still one warning
    warnings = tracking_warnings(caplog)
    assert len(warnings) == 1 and "not answering" in warnings[0].getMessage()

    live.start()
    for step in range(251, 301):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    assert tracker.finish("FINISHED", timeout_s=30) is True

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert history(client, run_id, "loss") == [(s, loss(s)) for s in range(1, 301)]
    assert len(tracking_warnings(caplog)) == 1
    back = [r.getMessage() for r in caplog.records if "server back, delivered" in r.getMessage()]
    assert len(back) == 1 and int(back[0].rsplit("delivered ", 1)[1].split()[0]) >= 200
    assert spool_empty(state_dir)


@pytest.mark.slow
def test_finish_while_server_down_then_sync(
    live: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    state_dir = run_dir / "tracking"
    client = MlflowClient(live.uri)
    tracker = Tracker(live.uri, "exp-finish-down", "r", state_dir, params={"p": "1"},
                      flush_interval_s=0.2, retry_max_s=0.5)
    for step in range(1, 21):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    assert tracker.wait_attached(30)
    run_id = tracker.run_id
    wait_for(lambda: len(client.get_metric_history(run_id, "loss")) == 20, what="20 points")

    live.stop(kill=True)
    for step in range(21, 41):
        tracker.log_metrics({"loss": loss(step)}, step=step)
    started = time.monotonic()
    assert tracker.finish("FINISHED", timeout_s=3) is False
    assert time.monotonic() - started < 3 + 2
    assert tracker.finish("FINISHED") is False  # idempotent
    assert json.loads((state_dir / PENDING_STATUS_FILE).read_text())["status"] == "FINISHED"
    assert [p["step"] for p in spool_points(state_dir) if p["step"] > 20] == list(range(21, 41))
    hint = f"python -m gwenlake_hpc tracking sync {run_dir}"
    assert any(hint in r.getMessage() for r in tracking_warnings(caplog))

    live.start()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # never FINISHED with points missing
    assert len(client.get_metric_history(run_id, "loss")) == 20

    assert sync(state_dir, timeout_s=30) == {
        "run_id": run_id, "delivered": 20, "remaining": 0, "status": "FINISHED"}
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"p": "1"}
    assert history(client, run_id, "loss") == [(s, loss(s)) for s in range(1, 41)]
    assert spool_empty(state_dir)
    assert not (state_dir / PENDING_STATUS_FILE).exists()
    # Nothing left: a second sync does nothing.
    assert sync(state_dir, timeout_s=5) == {
        "run_id": run_id, "delivered": 0, "remaining": 0, "status": None}


@pytest.mark.skipif(
    not postgres_available(), reason="needs PostgreSQL on 127.0.0.1:5432 and a driver (psycopg2)"
)
@pytest.mark.slow
def test_postgresql_store_and_server(tmp_path: Path) -> None:
    # A server on a fresh PostgreSQL database, then a Tracker on that database directly.
    for server in serve(tmp_path / "pg-server", backend="postgresql"):
        db_uri = server.backend_uri
        for uri, experiment in ((server.uri, "exp-pg-server"), (db_uri, "exp-pg-direct")):
            state_dir = tmp_path / experiment / "tracking"
            first = Tracker(uri, experiment, "r", state_dir, params={"lr": "0.1"},
                            flush_interval_s=0.2)
            for step in range(1, 31):
                first.log_metrics({"loss": loss(step)}, step=step)
            assert first.close() is True
            second = Tracker(uri, experiment, "r", state_dir, flush_interval_s=0.2)
            for step in range(21, 61):
                second.log_metrics({"loss": loss(step)}, step=step)
            assert second.finish("FINISHED") is True
            assert second.run_id == first.run_id
            client = MlflowClient(uri)
            run = client.get_run(second.run_id)
            assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
            assert history(client, run.info.run_id, "loss") == [(s, loss(s)) for s in range(1, 61)]


@pytest.mark.slow
def test_unreachable_at_start(
    live: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens there
    uri = f"http://alice:s3cret@127.0.0.1:{port}"
    state_dir = tmp_path / "tracking"
    started = time.perf_counter()
    tracker = Tracker(uri, "exp-unreachable", "r", state_dir, params={"lr": "0.1"},
                      tags={"k": "v"}, flush_interval_s=0.2, retry_max_s=0.5)
    for step in range(1, 101):
        tracker.log_metrics({"loss": loss(step), "acc": step / 100}, step=step)
    assert time.perf_counter() - started < 0.5
    assert tracker.run_id is None
    started = time.monotonic()
    assert tracker.finish("FINISHED", timeout_s=2) is False
    assert time.monotonic() - started < 2 + 2
    points = spool_points(state_dir)
    assert len(points) == 200
    assert sorted(p["step"] for p in points if p["key"] == "loss") == list(range(1, 101))
    assert not (state_dir / RUN_ID_FILE).exists()
    assert json.loads((state_dir / PENDING_STATUS_FILE).read_text())["status"] == "FINISHED"
    # No password in the state files nor in the logs.
    saved = json.loads((state_dir / TRACKING_JSON).read_text())
    assert saved["uri"] == f"http://alice@127.0.0.1:{port}" and saved["uri_password_removed"]
    warnings = tracking_warnings(caplog)
    assert warnings and all("s3cret" not in r.getMessage() for r in warnings)
    assert all("alice" not in r.getMessage() for r in warnings)

    # Later, delivered to a server that answers: the run is created from tracking.json.
    result = sync(state_dir, uri=live.uri, timeout_s=30)
    run_id = result["run_id"]
    assert result == {"run_id": run_id, "delivered": 200, "remaining": 0, "status": "FINISHED"}
    assert (state_dir / RUN_ID_FILE).read_text().strip() == run_id
    client = MlflowClient(live.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "r"
    assert run.data.params == {"lr": "0.1"} and run.data.tags["k"] == "v"
    assert history(client, run_id, "loss") == [(s, loss(s)) for s in range(1, 101)]
    assert history(client, run_id, "acc") == [(s, s / 100) for s in range(1, 101)]


@pytest.mark.slow
def test_next_tracker_delivers_the_spool_of_an_earlier_process(
    live: MlflowServer, tmp_path: Path
) -> None:
    state_dir = tmp_path / "tracking"
    down = f"http://127.0.0.1:{free_port()}"
    first = Tracker(down, "exp-handover", "r", state_dir, flush_interval_s=0.2, retry_max_s=0.5)
    for step in range(1, 31):
        first.log_metrics({"loss": loss(step)}, step=step)
    assert first.close(timeout_s=1) is False  # evicted while the server was down
    assert len(spool_points(state_dir)) == 30
    assert not (state_dir / PENDING_STATUS_FILE).exists()

    second = Tracker(live.uri, "exp-handover", "r", state_dir, flush_interval_s=0.2)
    # Replays of 21..30 with other values: dropped by the delivery (it delivers the older spool first).
    for step in range(21, 61):
        second.log_metrics({"loss": loss(step) + (1000 if step <= 30 else 0)}, step=step)
    assert second.finish("FINISHED") is True
    client = MlflowClient(live.uri)
    assert history(client, second.run_id, "loss") == [(s, loss(s)) for s in range(1, 61)]
    assert client.get_run(second.run_id).info.status == "FINISHED"
    assert spool_empty(state_dir)


@pytest.mark.slow
def test_finish_does_not_wait_for_a_hung_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A socket that accepts connections (kernel backlog) and never answers: every request
    # hangs until MLFLOW_HTTP_REQUEST_TIMEOUT.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    state_dir = tmp_path / "tracking"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        tracker = Tracker(uri, "exp-hung", "r", state_dir, flush_interval_s=0.2)
        for step in range(1, 11):
            tracker.log_metrics({"loss": loss(step)}, step=step)
        started = time.monotonic()
        assert tracker.finish("FINISHED", timeout_s=1) is False
        assert time.monotonic() - started < 1 + 1.5  # not the 3 s of the hung request
        assert [p["step"] for p in spool_points(state_dir)] == list(range(1, 11))
        assert json.loads((state_dir / PENDING_STATUS_FILE).read_text())["status"] == "FINISHED"
        # The delivery process was stopped: once its request would have given up, the state is still there.
        assert tracker._delivery.proc is None
        time.sleep(3.5)
    assert [p["step"] for p in spool_points(state_dir)] == list(range(1, 11))
    assert (state_dir / PENDING_STATUS_FILE).exists()
