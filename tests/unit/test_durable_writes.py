"""The durable write (gwenlake_hpc/base/fsutil.py) at each place that replaces a file others read: a write that
fails midway, or at the fsync or the rename, leaves the old file as it was and no temporary file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gwenlake_hpc.base import fsutil
from gwenlake_hpc.base.errors import GwenlakeError
from gwenlake_hpc.data import Catalog
from gwenlake_hpc.launch import requeue
from gwenlake_hpc.stores.checkpoints import tensorfile
from gwenlake_hpc.stores.checkpoints.tensorfile import HostBuffer, Snapshot, read_tensors, write_tensors
from gwenlake_hpc.stores.versioning import commit_model, export_version, lfs


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _fail_on_call(monkeypatch, module, name: str, n: int, exc: BaseException) -> list:
    """Make ``module.name`` raise ``exc`` at its ``n``-th call (1-based); returns the list of calls seen."""
    real = getattr(module, name)
    calls: list = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# --------------------------------------------------------------------------- safetensors files


@pytest.fixture
def old_file(tmp_path):
    path = tmp_path / "ck" / "model.safetensors"
    write_tensors(path, {"w": torch.zeros(4)})
    return path


def _assert_old(path: Path) -> None:
    assert _entries(path.parent) == [path.name]  # no temporary file left beside it
    tensors, _ = read_tensors(path)
    assert torch.equal(tensors["w"], torch.zeros(4))


def test_write_tensors_failing_midway_keeps_the_old_file_and_names_it(old_file, monkeypatch):
    # The header goes out first, then each tensor: the disk fills up on the second os.write.
    calls = _fail_on_call(monkeypatch, tensorfile.os, "write", 2, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left") as err:
        write_tensors(old_file, {"w": torch.ones(4), "b": torch.ones(3, dtype=torch.float64)})
    assert len(calls) == 2
    assert err.value.filename == str(old_file)
    monkeypatch.undo()
    _assert_old(old_file)


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_write_tensors_failing_at_the_fsync_or_the_rename_keeps_the_old_file(old_file, monkeypatch, step):
    _fail_on_call(monkeypatch, fsutil.os, step, 1, OSError(errno.EIO, f"{step} failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        write_tensors(old_file, {"w": torch.ones(4)})
    monkeypatch.undo()
    _assert_old(old_file)


def test_a_snapshot_failing_midway_keeps_the_old_file(old_file, monkeypatch):
    monkeypatch.setattr(tensorfile, "CHUNK_BYTES", 4096)  # the snapshot goes out in several writes
    snap = Snapshot({"w": torch.ones(1 << 12)}, None, HostBuffer())
    _fail_on_call(monkeypatch, tensorfile.os, "write", 2, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        snap.write(old_file)
    monkeypatch.undo()
    _assert_old(old_file)
    snap.write(old_file)  # the same snapshot can still be written afterwards
    assert torch.equal(read_tensors(old_file)[0]["w"], torch.ones(1 << 12))


def test_write_tensors_makes_one_fsync_of_the_file_and_one_of_its_folder(old_file, monkeypatch):
    calls = _fail_on_call(monkeypatch, fsutil.os, "fsync", 0, OSError())  # counts only
    write_tensors(old_file, {"w": torch.ones(4)})
    assert len(calls) == 2
    monkeypatch.undo()
    assert torch.equal(read_tensors(old_file)[0]["w"], torch.ones(4))


# --------------------------------------------------------------------------- datasets


@pytest.fixture
def catalog(tmp_path):
    return Catalog(tmp_path / "data")


def _assert_old_dataset(catalog: Catalog, name: str, revision: str, rows: int) -> None:
    group, _, short = name.partition(".")
    assert _entries(catalog.data_root / group) == [f"{short}.h5"]  # no temporary file left
    with catalog.open(name) as ds:
        assert ds.revision == revision and ds.rows == rows


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_write_dataset_failing_at_publication_keeps_the_old_version(catalog, monkeypatch, step):
    old = catalog.write("g.pub", {"a": np.arange(5)})
    _fail_on_call(monkeypatch, fsutil.os, step, 1, OSError(errno.EIO, f"{step} failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        catalog.write("g.pub", {"a": np.arange(9)})
    monkeypatch.undo()
    _assert_old_dataset(catalog, "g.pub", old, 5)


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_dataset_writer_failing_at_publication_keeps_the_old_version(catalog, monkeypatch, step):
    old = catalog.write("g.stream", {"a": np.arange(3)})
    w = catalog.writer("g.stream")
    w.append({"a": np.arange(100)})
    w.append({"a": np.arange(100, 200)})
    _fail_on_call(monkeypatch, fsutil.os, step, 1, OSError(errno.EIO, f"{step} failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        w.close()
    monkeypatch.undo()
    assert w.revision is None
    _assert_old_dataset(catalog, "g.stream", old, 3)


# --------------------------------------------------------------------------- git-lfs smudge

_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
            b"oid sha256:" + b"0" * 64 + b"\nsize 12\n")


def _fake_smudge(monkeypatch, returncode: int, content: bytes) -> None:
    """git-lfs stand-in: writes ``content`` to the smudge's output file and exits with ``returncode``."""
    def stream_git(cwd, env, args, stdin, stdout, timeout_s=3600):
        assert args[:2] == ["lfs", "smudge"] and stdin == _POINTER
        stdout.write(content)
        stdout.flush()
        return subprocess.CompletedProcess(["git", *args], returncode, b"", b"object not found")

    monkeypatch.setattr(lfs.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(lfs, "stream_git", stream_git)


def test_a_failed_smudge_keeps_the_pointer_and_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(_POINTER)
    _fake_smudge(monkeypatch, 2, b"half the wei")
    with pytest.raises(GwenlakeError, match="smudge of model.safetensors failed"):
        lfs.smudge_pointers(tmp_path, {}, tmp_path)
    assert _entries(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == _POINTER


def test_a_smudged_file_is_synced_before_it_replaces_the_pointer(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(_POINTER)
    _fake_smudge(monkeypatch, 0, b"real weights")
    calls = _fail_on_call(monkeypatch, fsutil.os, "fsync", 1, OSError(errno.EIO, "fsync failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        lfs.smudge_pointers(tmp_path, {}, tmp_path)
    assert len(calls) == 1
    assert _entries(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == _POINTER
    monkeypatch.undo()
    _fake_smudge(monkeypatch, 0, b"real weights")
    assert lfs.smudge_pointers(tmp_path, {}, tmp_path) == 1
    assert (tmp_path / "model.safetensors").read_bytes() == b"real weights"
    assert _entries(tmp_path) == ["model.safetensors"]


# --------------------------------------------------------------------------- exported versions


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_an_export_that_cannot_sync_its_files_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    models = tmp_path / "models"
    models.mkdir()
    _git(models, "init", "-q", "-b", "main")
    _git(models, "config", "user.name", "Test")
    _git(models, "config", "user.email", "test@example.com")
    src = tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "sub" / "config.json").write_bytes(b"{}")
    sha = commit_model(models, "crm.churn", src, message="v1")
    exports = tmp_path / "exports"
    # Callers reuse an existing export forever: its files are synced before its name appears.
    _fail_on_call(monkeypatch, os, "fsync", 1, OSError(errno.EIO, "fsync failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        export_version(models, "crm.churn", sha, exports / "v1")
    assert _entries(exports) == []  # neither the export nor its staging folder
    monkeypatch.undo()
    dest = export_version(models, "crm.churn", sha, exports / "v1")
    assert (dest / "sub" / "config.json").read_bytes() == b"{}"
    assert _entries(exports) == ["v1"]


# --------------------------------------------------------------------------- the teardown's record


def test_the_teardown_record_is_synced_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    path = requeue.record_path(tmp_path, "42")
    requeue._write_record(path, {"starts": [1]})
    calls = _fail_on_call(monkeypatch, requeue.os, "fsync", 1, OSError(errno.EIO, "fsync failed (simulated)"))
    with pytest.raises(OSError, match="simulated"):
        requeue._write_record(path, {"starts": [1, 2]})
    assert len(calls) == 1
    monkeypatch.undo()
    assert _entries(path.parent) == [path.name]
    assert requeue.read_record(tmp_path, "42") == {"starts": [1]}
    calls = _fail_on_call(monkeypatch, requeue.os, "fsync", 0, OSError())  # counts only
    requeue._write_record(path, {"starts": [1, 2]})
    assert len(calls) == 2  # the record, then its folder
    assert json.loads(path.read_text()) == {"starts": [1, 2]}
