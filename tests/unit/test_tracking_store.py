"""The default SQLite store is created whole: concurrent first users and kills during creation (real MLflow)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking import BrokenStoreError, ensure_sqlite_store, sqlite_path, sqlite_uri, sync


def test_sqlite_path_of_uris(tmp_path):
    assert sqlite_path(f"sqlite:///{tmp_path}/m.db") == tmp_path / "m.db"
    odd = tmp_path / "a?b#c%41 ï" / "mlflow.db"
    assert sqlite_path(sqlite_uri(odd)) == odd
    assert sqlite_path("sqlite:///rel/m.db") == Path("rel/m.db")
    assert sqlite_path("sqlite:///:memory:") is None and sqlite_path("http://h:5000") is None


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


def test_broken_store_is_reported_with_its_path(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"SQLite format 3\0" + b"\0" * 100)  # the header of a database, then nothing usable
    with pytest.raises(BrokenStoreError, match="mv .*mlflow.db.*mlflow.db.broken") as err:
        ensure_sqlite_store(f"sqlite:///{db}")
    assert err.value.exit_code == 2 and str(db) in str(err.value)
    state = tmp_path / "run" / "tracking"
    state.mkdir(parents=True)
    (state / "tracking.json").write_text('{"uri": "sqlite:///%s", "experiment": "e", "run_name": "r"}' % db)
    with pytest.raises(BrokenStoreError):
        sync(state, timeout_s=1)


