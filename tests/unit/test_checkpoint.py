"""CheckpointStore: atomic commit, verification, retention that deletes only what is provably ours."""

import json
import os

import pytest

from gwenlake_hpc.stores.checkpoints import MANIFEST, CheckpointStore
from gwenlake_hpc.base.errors import ConfigError


def _write(store, step, payload=b"x"):
    p = store.begin(step)
    p.path("weights.bin").write_bytes(payload)
    p.path("sub/extra.txt").write_text("e")
    return p.commit({"step": step})


def test_commit_makes_complete_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "key-a")
    ck = _write(store, 10, b"abc")
    assert ck.path.name == "step-000000010"
    manifest = json.loads((ck.path / MANIFEST).read_text())
    assert manifest["step"] == 10 and manifest["run_key"] == "key-a"
    assert set(manifest["files"]) == {"weights.bin", "sub/extra.txt", "gwenlake-run-state.json"}
    assert store.latest().step == 10
    assert ck.run_state() == {"step": 10}
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".partial")]


def test_partial_and_damaged_are_never_latest(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "key-a")
    _write(store, 10)
    pending = store.begin(20)  # a writer killed before commit
    pending.path("weights.bin").write_bytes(b"half")
    assert store.latest().step == 10
    damaged = _write(store, 30, b"good")
    (damaged.path / "weights.bin").write_bytes(b"evil")
    assert store.latest().step == 10  # sha256 mismatch: skipped, set aside for inspection
    assert not damaged.path.exists()
    assert [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".damaged-step-000000030")]
    assert store.clean_partials() == [pending.dir]
    assert not pending.dir.exists()


def test_other_runs_and_unknown_dirs_are_never_read_or_deleted(tmp_path):
    root = tmp_path / "ck"
    other = CheckpointStore(root, "key-b")
    _write(other, 5)
    (root / "step-000000001").mkdir()  # no manifest: not provably a checkpoint
    (root / "notes").mkdir()
    store = CheckpointStore(root, "key-a")
    for s in (10, 20, 30, 40):
        _write(store, s)
    removed = store.retain(2)
    assert [p.name for p in removed] == ["step-000000010", "step-000000020"]
    names = sorted(p.name for p in root.iterdir())
    assert names == ["LATEST.json", "notes", "step-000000001", "step-000000005", "step-000000030", "step-000000040"]
    assert store.pointer()["name"] == "step-000000040" and other.pointer() is None  # the last seal's run key
    assert store.latest().step == 40
    assert other.latest().step == 5


def test_existing_step_is_not_overwritten(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "k")
    first = _write(store, 10, b"first")
    with pytest.raises(Exception, match="already exists"):
        _write(store, 10, b"second")
    assert (first.path / "weights.bin").read_bytes() == b"first"


def test_bad_names_and_keep(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "k")
    p = store.begin(1)
    for bad in ("../escape", "/abs", MANIFEST):
        with pytest.raises(ConfigError):
            p.path(bad)
    with pytest.raises(ConfigError, match="keep"):
        store.retain(0)
    assert os.listdir(p.dir) == [".gwenlake-partial"]


def test_damaged_newest_is_set_aside_and_its_step_can_be_rewritten(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "k")
    _write(store, 500)
    bad = _write(store, 1000)
    (bad.path / "weights.bin").write_bytes(b"flipped")
    assert store.latest().step == 500  # resume from 500...
    aside = [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".damaged-step-000001000")]
    assert len(aside) == 1  # ...the damaged one kept for inspection, out of the way
    again = _write(store, 1000, b"redone")  # the resumed run writes step 1000 again
    assert store.latest().step == 1000 and (again.path / "weights.bin").read_bytes() == b"redone"


def test_a_foreign_folder_in_the_way_of_a_new_checkpoint_is_set_aside_with_a_warning(tmp_path, caplog):
    store = CheckpointStore(tmp_path / "ck", "k")
    foreign = tmp_path / "ck" / "step-000000200"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone else's")  # no manifest: not written by a run
    with caplog.at_level("WARNING", logger="gwenlake_hpc.checkpoints"):
        ck = _write(store, 200)
    (aside,) = [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".damaged-step-000000200-")]
    assert (aside / "notes.txt").read_text() == "someone else's" and ck.path == foreign
    (record,) = [r for r in caplog.records if r.name == "gwenlake_hpc.checkpoints"]
    assert record.levelname == "WARNING" and "no readable manifest of this run" in record.getMessage()
    assert str(foreign) in record.getMessage() and str(aside) in record.getMessage()


def test_retention_never_deletes_what_was_just_written(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "k")
    _write(store, 1000)
    _write(store, 1500)  # newer than what a resumed run writes next (an abandoned history)
    just = _write(store, 1200)
    store.retain(1, newest=just.step)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "step-000001200" in names and "step-000001000" not in names
