"""The node-local first level of checkpoints (issue 27, item 3): the copy to the shared level, the copier, the
resume rule over both levels, the levels' record."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from gwenlake_hpc.base.errors import CheckpointError, CheckpointExistsError, ConfigError
from gwenlake_hpc.stores.checkpoints import CheckpointStore
from gwenlake_hpc.stores.checkpoints import levels
from gwenlake_hpc.stores.checkpoints.levels import SharedCopier, copy_to_shared, local_root, local_store
from gwenlake_hpc.stores.checkpoints.resume import resume_from


def _seal(store: CheckpointStore, step: int, payload: bytes):
    pending = store.begin(step)
    pending.path("weights.bin").write_bytes(payload)
    pending.path("sub/extra.txt").write_text(f"extra {step}")
    return pending.commit({"step": step})


@pytest.fixture
def two(tmp_path):
    shared = CheckpointStore(tmp_path / "run" / "checkpoints", "key")
    local = local_store(local_root(tmp_path / "node", tmp_path / "run", "key"), tmp_path / "run", "key")
    return local, shared


def test_local_root_is_keyed_to_the_run_and_refuses_a_relative_path(tmp_path):
    a = local_root("/scratch", tmp_path / "run-a", "key")
    assert a.parent == Path("/scratch/gwenlake-checkpoints") and a.name.startswith("run-")
    assert a != local_root("/scratch", tmp_path / "run-b", "key") != local_root("/scratch", tmp_path / "run-a", "k2")
    with pytest.raises(ConfigError, match="checkpoint.local_dir=scratch: must be an absolute path"):
        local_root("scratch", tmp_path / "run-a", "key")


def test_a_copy_has_the_same_manifest_and_files_and_moves_the_pointer(two):
    local, shared = two
    ck = _seal(local, 10, b"w" * 100_000)
    copied = copy_to_shared(ck, shared)
    assert copied.path == shared.root / "step-000000010"
    assert (copied.path / "MANIFEST.json").read_bytes() == (ck.path / "MANIFEST.json").read_bytes()
    assert (copied.path / "weights.bin").read_bytes() == b"w" * 100_000
    assert (copied.path / "sub" / "extra.txt").read_text() == "extra 10"
    assert shared.problem_of(copied.path) is None
    assert shared.pointer()["step"] == 10
    assert not list(shared.root.glob(".partial-*"))
    assert copy_to_shared(ck, shared).path == copied.path  # the same checkpoint again: nothing to do


def test_a_damaged_local_copy_is_never_published(two):
    local, shared = two
    ck = _seal(local, 10, b"w" * 1000)
    raw = bytearray((ck.path / "weights.bin").read_bytes())
    raw[500] ^= 0xFF  # same size, another digest
    (ck.path / "weights.bin").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="weights.bin does not match its manifest"):
        copy_to_shared(ck, shared)
    assert shared.complete() == [] and not list(shared.root.glob(".partial-*")) and shared.pointer() is None


def test_another_checkpoint_of_that_step_on_the_shared_level_is_kept(two):
    local, shared = two
    theirs = _seal(shared, 10, b"theirs")
    ck = _seal(local, 10, b"ours")
    with pytest.raises(CheckpointExistsError, match="already holds another checkpoint of step 10"):
        copy_to_shared(ck, shared)
    assert (theirs.path / "weights.bin").read_bytes() == b"theirs"


def test_the_copier_copies_the_newest_and_applies_retention_on_both_levels(two, monkeypatch):
    local, shared = two
    gate, entered = threading.Event(), threading.Event()
    real = levels.copy_to_shared

    def slow(ck, store):
        entered.set()
        gate.wait(30)
        return real(ck, store)

    monkeypatch.setattr(levels, "copy_to_shared", slow)
    copier = SharedCopier(local, shared, None)
    copier.submit(_seal(local, 10, b"10"), keep=2)
    assert entered.wait(30)
    for step in (20, 30, 40):  # sealed locally while step 10 is being copied: only the newest waits
        copier.submit(_seal(local, step, str(step).encode()), keep=2)
    assert copier.pending and not copier.wait(0.2)
    gate.set()
    assert copier.wait(60)
    assert [c.step for c in shared.complete()] == [10, 40]  # 20 and 30 were never copied: 40 replaced them
    assert [c.step for c in local.complete()] == [30, 40]  # keep=2 below the copied step 40
    assert copier.shared_step == 40 and copier.copied.step == 40
    record = levels.levels_record(shared.root)
    assert record["local_step"] == 40 and record["shared_step"] == 40 and record["copying"] is None
    assert record["host"] == socket.gethostname()


def test_a_failed_copy_is_raised_once_to_the_training_thread(two, monkeypatch):
    local, shared = two
    ck = _seal(local, 10, b"x" * 10)

    def full(ck, store):
        raise OSError(28, "No space left on device", str(store.root))

    monkeypatch.setattr(levels, "copy_to_shared", full)
    copier = SharedCopier(local, shared, 5)
    copier.submit(ck, None)
    assert copier.wait(60)
    with pytest.raises(CheckpointError, match="copy of a checkpoint to the shared level .* failed: .*No space left.* "
                                              "newest checkpoint on it is step 5"):
        copier.raise_if_failed()
    copier.raise_if_failed()  # raised once: the background writer keeps it from then on


def test_a_local_copy_found_damaged_while_copied_is_set_aside_not_a_failure(two, caplog):
    local, shared = two
    copier = SharedCopier(local, shared, None)
    copier.submit(_seal(local, 5, b"five"), None)
    assert copier.wait(60)
    ck = _seal(local, 10, b"x" * 10)
    (ck.path / "weights.bin").write_bytes(b"y" * 10)  # rotted on the node since its seal
    copier.submit(ck, None)
    assert copier.wait(60)
    copier.raise_if_failed()  # the run goes on: its next checkpoint is copied
    assert [c.step for c in local.complete()] == [5] and list(local.root.glob(".damaged-step-000000010-*"))
    assert [c.step for c in shared.complete()] == [5]
    assert "set aside" in caplog.text and "not copied to the shared level" in caplog.text
    # the re-check's input: the record (what status shows) named the set-aside step as local and in flight
    record = levels.levels_record(shared.root)
    assert record["local_step"] == 5 and record["shared_step"] == 5 and record["copying"] is None


def test_a_deleted_and_remade_run_directory_has_another_local_folder(tmp_path):
    assert local_root("/n", tmp_path / "run", "key", "uid1") != local_root("/n", tmp_path / "run", "key", "uid2")


def test_resume_prefers_a_newer_intact_local_checkpoint_else_the_shared_one(two):
    local, shared = two
    _seal(shared, 10, b"s10")
    assert resume_from(shared, "auto", verify=True, local=local).path.parent == shared.root
    _seal(local, 10, b"l10")
    assert resume_from(shared, "auto", verify=True, local=local).path.parent == shared.root  # a tie: shared
    l20 = _seal(local, 20, b"l20")
    assert resume_from(shared, "auto", verify=True, local=local).path == l20.path
    assert resume_from(shared, "auto", verify=False, local=local).path == l20.path
    # damaged local: set aside, the previous local one is not newer than the shared level: shared step 10
    (l20.path / "sub" / "extra.txt").write_text("torn")
    ck = resume_from(shared, "auto", verify=True, local=local)
    assert ck.step == 10 and ck.path.parent == shared.root
    assert list(local.root.glob(".damaged-step-000000020-*"))
    with pytest.raises(ConfigError, match=f"job.resume=never but {shared.root} already holds"):
        resume_from(shared, "never", verify=False, local=local)


def test_resume_never_refuses_a_local_level_with_checkpoints(tmp_path):
    shared = CheckpointStore(tmp_path / "run" / "checkpoints", "key")
    local = local_store(local_root(tmp_path / "node", tmp_path / "run", "key"), tmp_path / "run", "key")
    _seal(local, 10, b"l10")
    with pytest.raises(ConfigError, match=f"job.resume=never but {local.root} already holds"):
        resume_from(shared, "never", verify=False, local=local)


def test_a_local_level_written_by_another_host_is_emptied(tmp_path):
    root = local_root(tmp_path / "node", tmp_path / "run", "key")
    store = local_store(root, tmp_path / "run", "key")
    _seal(store, 10, b"x")
    (root / "LEVEL.json").write_text(json.dumps({"host": "elsewhere", "run_dir": "x", "run_key": "key"}))
    again = local_store(root, tmp_path / "run", "key")
    assert again.complete() == []
    assert json.loads((root / "LEVEL.json").read_text())["host"] == socket.gethostname()


def test_an_unwritable_local_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="checkpoint.local_dir: cannot use"):
        local_store(local_root(blocker, tmp_path / "run", "key"), tmp_path / "run", "key")


def test_checkpoint_config_validates_and_resolves_the_local_dir(monkeypatch):
    from gwenlake_hpc.job.config import CheckpointConfig

    assert CheckpointConfig().local_level({}) is None
    assert str(CheckpointConfig().local_level({"SLURM_TMPDIR": "/local/job1"})) == "/local/job1"
    assert CheckpointConfig(local_dir="off").local_level({"SLURM_TMPDIR": "/local/job1"}) is None
    assert str(CheckpointConfig(local_dir="/dev/shm/ck").local_level({"SLURM_TMPDIR": "/x"})) == "/dev/shm/ck"
    with pytest.raises(ConfigError, match="checkpoint.local_dir='rel/dir': must be an absolute path"):
        CheckpointConfig(local_dir="rel/dir")
    with pytest.raises(ConfigError, match="checkpoint.shared_wait_s=-1"):
        CheckpointConfig(shared_wait_s=-1)


def test_a_run_directory_a_stale_cache_still_shows_is_made_once_the_cache_expires(tmp_path, monkeypatch):
    """A folder deleted from another node stays in this node's cache for a while: mkdir(exist_ok=True) believes
    it, and opening the lock file in it fails (seen on sshfs, cache_timeout=30). The start retries; past the
    bound it is exit 2's error with what to do, not a traceback."""
    from gwenlake_hpc.job import run_lock

    run_dir = tmp_path / "runs" / "m" / "run"
    real_mkdir, stale = Path.mkdir, {"left": 2}

    def cached_mkdir(self, *args, **kwargs):
        if self == run_dir and stale["left"] > 0:  # the cache says it exists: nothing is made
            stale["left"] -= 1
            return None
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", cached_mkdir)
    monkeypatch.setattr(run_lock.time, "sleep", lambda s: None)
    fh = run_lock._open_lock(run_dir)
    fh.close()
    assert (run_dir / ".lock").exists() and stale["left"] == 0
    run_dir = run_dir.parent / "other"  # a cache that does not expire within the bound
    stale["left"] = 10**9
    monkeypatch.setattr(run_lock, "STALE_DIR_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match="still shows a folder deleted elsewhere; run the job again in a minute"):
        run_lock._open_lock(run_dir)


def _level(base: Path, run_dir: Path, key: str, uid: str, local_steps=(), shared_steps=()) -> Path:
    root = local_root(base, run_dir, key, uid)
    store = local_store(root, run_dir, key)
    levels.release(root)  # as a process that ended
    for step in local_steps:
        _seal(store, step, b"l")
    shared = CheckpointStore(run_dir / "checkpoints", key)
    for step in shared_steps:
        _seal(shared, step, b"s")
    return root


def test_a_start_sweeps_what_other_runs_left_on_the_node_and_nothing_in_use(tmp_path):
    """The re-check's input: folders left on a node by a run directory deleted or made anew, or by a run finished
    with checkpoint.local_dir=off, stayed for good (on /dev/shm: memory)."""
    import subprocess
    import sys

    from gwenlake_hpc.job.node_local import sweep_local_levels

    base, runs = tmp_path / "node", tmp_path / "runs"
    for name, uid in (("remade", "new"), ("done", "u3"), ("ahead", "u4"), ("held", "u5"), ("mine", "u6")):
        (runs / name).mkdir(parents=True)
        (runs / name / "run.json").write_text(json.dumps({"uid": uid, "starts": []}))
    gone = _level(base, runs / "gone", "k", "u1", local_steps=(10,))
    remade = _level(base, runs / "remade", "k", "old", local_steps=(10,))
    done = _level(base, runs / "done", "k", "u3", local_steps=(10,), shared_steps=(10, 20))
    ahead = _level(base, runs / "ahead", "k", "u4", local_steps=(30,), shared_steps=(20,))
    held = _level(base, runs / "held", "k", "other-incarnation", local_steps=(10,))
    mine = _level(base, runs / "mine", "k", "u6", local_steps=(10,))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(held / '.in-use')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
        "time.sleep(120)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        sweep_local_levels(mine)
    finally:
        holder.kill()
        holder.wait()
    assert not gone.exists() and not remade.exists() and not done.exists()
    assert ahead.exists() and held.exists() and mine.exists()
    assert levels.sweep(held)  # free now: removable
