"""A real `mlflow server` (PostgreSQL-backed when PostgreSQL runs here, else SQLite) stopped during a job."""

from __future__ import annotations

import time
import uuid

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking.delivery.spool import points_of, read_all
from helpers.mlflow_server import MlflowServer, drop_postgres_database, postgres_available, postgres_backend, sqlite_backend

# Mostly waiting (servers down, retries, timeouts): run beside the cluster's tests (scripts/test.sh).
pytestmark = pytest.mark.waits


@pytest.fixture
def server(tmp_path):
    dbname = None
    if postgres_available():
        dbname = f"gwl_test_{uuid.uuid4().hex[:8]}"
        backend = postgres_backend(dbname)
    else:
        backend = sqlite_backend(tmp_path)
    srv = MlflowServer(backend, workdir=tmp_path / "mlflow").start()
    yield srv
    srv.stop(kill=True)
    if dbname:
        drop_postgres_database(dbname)


def wait_for(path, timeout=120):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def wait_for_true(pred, timeout=60):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def the_run(server):
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name("t.model")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


@pytest.mark.slow
def test_server_down_mid_run_all_points_arrive(project, server):
    f = project.root
    pause = f"50:{f}/reached1:{f}/go1;200:{f}/reached2:{f}/go2"
    proc = project.popen("+job=t", "job.steps=300", f"tracking.uri={server.uri}", "tracking.flush_interval_s=0.2",
                         env={"GWL_TEST_PAUSE": pause})
    wait_for(f / "reached1")
    server.stop(kill=True)  # outage from step 50 to step 200
    (f / "go1").touch()
    wait_for(f / "reached2")
    state = next((f / "runs" / "t.model").glob("*/tracking"))
    # Points waited on disk during the outage (written at least at each checkpoint, every 50 steps).
    wait_for_true(lambda: {100, 150} <= {s for _, _, s, _ in points_of(read_all(state))})
    server.start()
    (f / "go2").touch()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert "not answering" in err + out and "server back" in err + out
    version = out.strip().splitlines()[-1].split()[-1]

    client, run = the_run(server)
    assert run.info.status == "FINISHED"
    assert run.data.tags["gwenlake.version"] == version
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 301))
    assert run.data.params["params.batch_size"] == "16"


@pytest.mark.slow
def test_server_down_at_end_then_tracking_sync(project, server):
    f = project.root
    proc = project.popen("+job=t", "job.steps=120", f"tracking.uri={server.uri}", "tracking.flush_interval_s=0.2",
                         "tracking.finish_timeout_s=3", env={"GWL_TEST_PAUSE": f"100:{f}/reached:{f}/go"})
    wait_for(f / "reached")
    wait_for_true(lambda: any((f / "runs" / "t.model").glob("*/tracking/run_id")))  # the run exists
    server.stop(kill=True)
    (f / "go").touch()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err  # the training and its commit do not depend on tracking
    assert out.strip().splitlines()[-1].startswith("model t.model version ")
    assert "tracking sync" in err + out
    run_dir = next((f / "runs" / "t.model").iterdir())

    server.start()
    client, run = the_run(server)
    assert run.info.status == "RUNNING"  # never FINISHED before every point arrived
    synced = project.run("tracking", "sync", str(run_dir), check=0)
    assert "remaining 0" in synced.stdout.replace(", 0 remaining", " remaining 0")
    client, run = the_run(server)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 121))


@pytest.mark.slow
def test_server_down_for_the_whole_run_then_sync_registers_the_version(project, server):
    """No MLflow run is ever attached during the training: the version is committed with its run pending, listed
    in pending_registrations.json with the command that completes it, and `tracking sync` registers it."""
    server.stop(kill=True)
    done = project.run("+job=t", "job.steps=30", f"tracking.uri={server.uri}", "tracking.finish_timeout_s=3",
                       check=0, timeout=600)
    log = done.stdout + done.stderr
    version = done.stdout.strip().splitlines()[-1].split()[-1]
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    assert "is committed but not registered in the MLflow Model Registry" in log, log
    assert f"python -m gwenlake_hpc tracking sync {run_dir}" in log
    lineage = __import__("json").loads(project.git("show", f"{version}:t/model/lineage.json"))
    assert lineage["tracking"]["run_id"] is None and lineage["tracking"]["state_dir"] == str(run_dir / "tracking")
    pending = __import__("json").loads((run_dir / "tracking" / "pending_registrations.json").read_text())
    assert [e["version"] for e in pending] == [version]

    server.start()
    synced = project.run("tracking", "sync", str(run_dir), check=0, timeout=600)
    assert f"registered version {version}" in synced.stdout, synced.stdout + synced.stderr
    assert not (run_dir / "tracking" / "pending_registrations.json").exists()
    client, run = the_run(server)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 31))
    mv = client.get_model_version_by_alias("t.model", "candidate")
    assert mv.tags["gwenlake.version"] == version and mv.run_id == run.info.run_id


@pytest.mark.slow
@pytest.mark.parametrize("next_start", ["rerun", "extend"])
def test_server_down_for_the_whole_run_then_the_next_start_registers_the_version(project, server, next_start):
    """The version left pending is registered by the next start of the training, without `tracking sync`: a
    rerun of the finished job (in the command), or a run extended with more steps (in its delivery process)."""
    server.stop(kill=True)
    done = project.run("+job=t", "job.steps=30", f"tracking.uri={server.uri}", "tracking.finish_timeout_s=3",
                       check=0, timeout=600)
    first = done.stdout.strip().splitlines()[-1].split()[-1]
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    assert (run_dir / "tracking" / "pending_registrations.json").is_file()

    server.start()
    steps = 30 if next_start == "rerun" else 60
    again = project.run("+job=t", f"job.steps={steps}", f"tracking.uri={server.uri}", check=0, timeout=600)
    log = again.stdout + again.stderr
    assert not (run_dir / "tracking" / "pending_registrations.json").exists(), log
    client, run = the_run(server)
    registered = {mv.tags["gwenlake.version"]: mv for mv in client.search_model_versions("name='t.model'")}
    last = again.stdout.strip().splitlines()[-1].split()[-1]
    assert set(registered) == ({first} if next_start == "rerun" else {first, last}), log
    assert all(mv.run_id == run.info.run_id for mv in registered.values())
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, steps + 1))


@pytest.mark.slow
def test_a_rerun_of_a_finished_job_delivers_what_its_end_left(project):
    """The end of a run could not deliver (its delivery process was killed, MLflow was slow): the spool and the
    FINISHED status wait in the run directory. Rerunning the same command delivers them, like tracking sync."""
    import json

    from gwenlake_hpc.stores.tracking.delivery.spool import SpoolWriter, encode

    done = project.run("+job=t", "job.steps=20", check=0)
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    state = run_dir / "tracking"
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    run_id = (state / "run_id").read_text().strip()
    client.update_run(run_id, status="RUNNING")  # as the end left it
    writer = SpoolWriter(state)
    writer.append(encode([("late", float(s), s, 1_700_000_000_000) for s in range(1, 6)]))
    writer.close()
    (state / "pending_status").write_text(json.dumps({"status": "FINISHED", "end_time": 1_700_000_000_000}))

    again = project.run("+job=t", "job.steps=20", check=0)
    assert again.stdout.strip().splitlines()[-1] == done.stdout.strip().splitlines()[-1]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "late")) == [1, 2, 3, 4, 5]
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 21))
    assert not (state / "pending_status").exists() and not list((state / "spool").glob("*.jsonl"))
