"""The default SQLite store: its path from a URI, a broken store named with its path (the kills during its
creation, real MLflow, are in tests/integration/test_tracking_store_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gwenlake_hpc.stores.tracking import BrokenStoreError, ensure_sqlite_store, sqlite_path, sqlite_uri, sync


def test_sqlite_path_of_uris(tmp_path):
    assert sqlite_path(f"sqlite:///{tmp_path}/m.db") == tmp_path / "m.db"
    odd = tmp_path / "a?b#c%41 ï" / "mlflow.db"
    assert sqlite_path(sqlite_uri(odd)) == odd
    assert sqlite_path("sqlite:///rel/m.db") == Path("rel/m.db")
    assert sqlite_path("sqlite:///:memory:") is None and sqlite_path("http://h:5000") is None


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
