"""The default SQLite store is created whole: concurrent first users and kills during creation (real MLflow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking import ensure_sqlite_store, sqlite_uri
from helpers.tracking_store import CREATE


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("store_exists", [False, True])
def test_a_killed_creators_temporary_store_and_its_journal_are_removed(tmp_path, store_exists):
    from gwenlake_hpc.stores.tracking import sqlite as sqlite_mod

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    if store_exists:
        ensure_sqlite_store(uri)
        sqlite_mod._READY.clear()  # another process: it checks the store again
    left = [tmp_path / ".mlflow.db.0123456789ab.tmp", tmp_path / ".mlflow.db.0123456789ab.tmp-journal"]
    for f in left:
        f.write_bytes(b"partial")
    ensure_sqlite_store(uri)
    assert [f for f in left if f.exists()] == []
    assert MlflowClient(uri).search_experiments()  # and the store works


@pytest.mark.slow
def test_kill_during_creation_leaves_no_store_or_a_whole_one(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    killed_mid = 0
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CREATE, uri, f"k{attempt}"], env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not list(tmp_path.glob(".mlflow.db.*.tmp")):
            time.sleep(0.005)
        if proc.poll() is None and not (tmp_path / "mlflow.db").exists():
            killed_mid += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert not (tmp_path / "mlflow.db").exists() or MlflowClient(uri).search_experiments()
    print(f"{killed_mid} kill(s) landed while the store was being migrated")
    done = subprocess.run([sys.executable, "-c", CREATE, uri, "after"], env=env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-800:]
    assert "after" in [e.name for e in MlflowClient(uri).search_experiments()]
    assert not list(tmp_path.glob(".mlflow.db.*.tmp*"))  # a killed creator's temporary file (and journal) cleaned


@pytest.mark.slow
def test_runs_root_with_special_characters_keeps_the_store_inside(project):
    root = "runs a?b#c%41 ï"
    done = project.run("+job=t", "job.steps=20", f"paths.runs_root='{root}'", check=0)
    assert "model t.model version" in done.stdout
    store = project.root / root / "mlflow.db"
    assert store.is_file()
    assert list(project.root.rglob("*.db")) == [store]
    # MLflow makes the store's parent folder from the URI without decoding it: an empty folder with the
    # escapes in its name may appear beside it (never anything in it).
    others = [p for p in project.root.iterdir() if p.name.startswith("runs") and p.name != root]
    assert all(p.name == "runs a%3Fb%23c%2541 ï" and not list(p.iterdir()) for p in others), others
    client = MlflowClient(sqlite_uri(store))
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")) == list(range(1, 21))


@pytest.mark.slow
def test_20_concurrent_jobs_on_one_new_store_give_20_runs_and_20_registered_versions(project):
    """20 trainings start at once on a runs_root with no store yet (20 concurrent first users of the store):
    one store made whole, 20 FINISHED runs with every point once, 20 versions registered, each from its own run."""
    procs = [project.popen("+job=t", "job.steps=10", f"job.params.hidden={4 + i}") for i in range(20)]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0] * 20, [e[-600:] for (_, e), p in zip(outs, procs) if p.returncode]
    versions = {o.strip().splitlines()[-1].split()[-1] for o, _ in outs}
    assert len(versions) == 20
    client = MlflowClient(sqlite_uri(project.root / "runs" / "mlflow.db"))
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert len(runs) == 20 and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss")) == list(range(1, 11))
    registered = client.search_model_versions("name='t.model'")
    assert {mv.tags["gwenlake.version"] for mv in registered} == versions and len(registered) == 20
    assert sorted(mv.run_id for mv in registered) == sorted(r.info.run_id for r in runs)
    assert list(project.root.rglob("*.db")) == [project.root / "runs" / "mlflow.db"]
