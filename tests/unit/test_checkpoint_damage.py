"""Damaged manifests and pointers (issue 40 item 13b, 13d): a manifest's file names never lead out of the
checkpoint folder, and a manifest or pointer that is damaged is set aside at once, not waited for as a stale
cache would be. The inputs are the ones tried by hand."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest

from gwenlake_hpc.stores.checkpoints import MANIFEST, CheckpointStore
from gwenlake_hpc.stores.checkpoints.digest import file_digest
from gwenlake_hpc.stores.checkpoints.resume import resume_from

#: Paths opened by this process since the hook was installed (an audit hook cannot be removed: one for the module).
OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event in ("open", "os.open", "os.lstat", "os.stat") and args:  # open() of a Path: its args[0] is the Path
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)


def _seal(store, step, payload=b"x"):
    pending = store.begin(step)
    pending.path("weights.bin").write_bytes(payload)
    return pending.commit({"step": step})


@pytest.fixture
def run(tmp_path):
    """A run directory under ``<tmp>/runs/m/k`` with checkpoints of steps 100 and 125 (the pointer names 125),
    and a file outside it, ``<tmp>/runs/outside/s125/v``."""
    store = CheckpointStore(tmp_path / "runs" / "m" / "k" / "checkpoints", "k")
    _seal(store, 100, b"hundred")
    newest = _seal(store, 125, b"newest")
    outside = tmp_path / "runs" / "outside" / "s125" / "v"
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"a file of someone else's, outside the run")
    return store, newest, outside


def _add_entry(ck, name, target):
    manifest = json.loads((ck.path / MANIFEST).read_text())
    manifest["files"][name] = {"size": target.stat().st_size, "digest": file_digest(target)}
    (ck.path / MANIFEST).write_text(json.dumps(manifest))


def _aside(store, prefix):
    return sorted(p.name for p in store.root.iterdir() if p.name.startswith(prefix))


@pytest.mark.parametrize("name", ["../../../../outside/s125/v", "ABSOLUTE", "link/v"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_damaged_and_that_file_never_opened(run, name, caplog):
    store, newest, outside = run
    if name == "ABSOLUTE":
        name = str(outside)
    if name == "link/v":
        (newest.path / "link").symlink_to(outside.parent, target_is_directory=True)
    assert (newest.path / name).resolve() == outside.resolve()  # the entry reaches the outside file
    _add_entry(newest, name, outside)  # matching size and digest: only its name is wrong
    OPENED.clear()
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.checkpoints"):
        chosen = resume_from(store, "auto", verify=True)  # what the Run does as it starts
    assert chosen is not None and chosen.step == 100  # the previous intact checkpoint
    assert not [p for p in OPENED if "outside" in p], OPENED  # never opened, as strace showed it was
    OPENED.clear()
    assert store.verify(chosen) is None  # a check that the hook sees such opens: the intact one is hashed
    assert any(p.endswith("step-000000100/weights.bin") for p in OPENED), OPENED
    assert _aside(store, ".damaged-step-000000125-") and not newest.path.exists()
    said = caplog.text
    assert "step-000000125 is damaged" in said
    assert ("is a symbolic link" if name == "link/v" else f"names {name!r}, not a plain relative name") in said
    assert outside.read_bytes() == b"a file of someone else's, outside the run"


def test_the_same_names_in_the_store_never_pass_verify(run):
    store, newest, outside = run
    for name in ("../x", "/etc/passwd", "a/../../x", "./x", "a//b", ""):
        manifest = dict(newest.manifest, files={**newest.manifest["files"], name: {"size": 1, "digest": "0"}})
        problem = store.verify(type(newest)(newest.path, newest.step, manifest), full=True)
        assert problem is not None and "not a" in problem, (name, problem)


@pytest.mark.parametrize("damage, said", [
    ("truncated", "its MANIFEST.json is not valid JSON"),
    ("step-as-text", "its MANIFEST.json names step '125', its folder step 125"),
    ("no-files", "its MANIFEST.json has no list of files"),
    ("no-digest", "its MANIFEST.json gives 'weights.bin' no digest"),
    ("a-folder", "its MANIFEST.json is not a regular file"),  # the adversarial pass's input: waited 90 s
])
def test_a_damaged_manifest_the_pointer_names_is_set_aside_at_once_not_waited_for(run, damage, said, caplog):
    store, newest, _ = run
    path = newest.path / MANIFEST
    raw = path.read_bytes()
    manifest = json.loads(raw)
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "step-as-text":
        path.write_text(json.dumps({**manifest, "step": "125"}))
    elif damage == "no-files":
        path.write_text(json.dumps({k: v for k, v in manifest.items() if k != "files"}))
    elif damage == "a-folder":
        path.unlink()
        path.mkdir()
    else:
        manifest["files"]["weights.bin"].pop("digest")
        path.write_text(json.dumps(manifest))
    assert store.pointer()["name"] == "step-000000125"
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.checkpoints"):
        # a submission's check (and a rank other than 0): says so, writes nothing
        assert [c.step for c in store.complete(wait_s=90)] == [100]
        assert newest.path.exists() and store.pointer() is not None
        # the start (rank 0 holding the run): sets it aside
        chosen = resume_from(store, "auto", verify=False, wait_s=90, repair=True)
    assert time.monotonic() - t0 < 10  # not the 90 s of checkpoint.visible_wait_s
    assert chosen.step == 100
    assert _aside(store, ".damaged-step-000000125-") and not newest.path.exists()
    assert store.pointer() is None  # it named what was set aside
    assert f"checkpoint {newest.path} (named by {store.root / 'LATEST.json'}) is damaged: {said}" in caplog.text
    assert "stale" not in caplog.text
    assert store.latest().step == 100
    again = _seal(store, 125, b"redone")  # the resumed run seals step 125 again
    assert store.latest() == again


def test_a_pointer_naming_a_step_the_server_does_not_have_is_set_aside_after_the_wait(run, caplog):
    store, _, _ = run
    pointer = store.root / "LATEST.json"
    ptr = json.loads(pointer.read_text())
    pointer.write_text(json.dumps({**ptr, "step": 150, "name": "step-000000150"}))  # no such folder
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.checkpoints"):
        assert [c.step for c in store.complete(wait_s=1)] == [100, 125]  # read-only: logged
        assert pointer.exists()
        chosen = resume_from(store, "auto", verify=False, wait_s=1, repair=True)
    assert 1 <= time.monotonic() - t0 < 10  # the wait for a lagging cache, once per call, then the verdict
    assert chosen.step == 125
    assert not pointer.exists() and len(_aside(store, ".damaged-LATEST.json-")) == 1
    assert (f"{pointer} names checkpoint step-000000150 (step 150), which is not on the shared filesystem after "
            "1 s (checkpoint.visible_wait_s)") in caplog.text
    assert "stale" not in caplog.text
    assert [c.step for c in store.complete(wait_s=90)] == [100, 125]  # no pointer now: no wait at all
    sealed = _seal(store, 150)  # the next seal writes a new pointer
    assert store.pointer()["name"] == sealed.path.name


def test_a_pointer_the_listing_does_not_show_yet_is_still_followed(run):
    """The reason for the wait stays: a checkpoint the listing misses but that opens by its path is resumed."""
    store, newest, _ = run
    listed = [c for c in store.complete() if c.step < 125]
    from gwenlake_hpc.stores.checkpoints import pointer

    assert pointer.follow(store, listed, 1.0, True).path == newest.path
    assert store.pointer()["name"] == newest.path.name


def test_a_pointer_naming_a_link_or_a_folder_without_manifest_sets_that_folder_aside(run, tmp_path, caplog):
    store, newest, outside = run
    ptr = json.loads((store.root / "LATEST.json").read_text())
    # a step folder that is a symbolic link to a copy of a real checkpoint elsewhere: damaged at once
    elsewhere = tmp_path / "elsewhere"
    newest.path.rename(elsewhere)
    newest.path.symlink_to(elsewhere, target_is_directory=True)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.checkpoints"):
        assert resume_from(store, "auto", verify=True, wait_s=90).step == 100
    assert time.monotonic() - t0 < 10
    assert f"is damaged: its folder is a symbolic link (to {elsewhere})" in caplog.text
    assert not newest.path.is_symlink() and (elsewhere / MANIFEST).exists()  # the link set aside, not its target
    # a folder without a manifest: waited for (its manifest could be a cached absence), then set aside
    (store.root / "step-000000125").mkdir()
    (store.root / "LATEST.json").write_text(json.dumps(ptr))
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.checkpoints"):
        assert [c.step for c in store.complete(wait_s=1, repair=True)] == [100]
    assert "is damaged: it has no MANIFEST.json after 1 s (checkpoint.visible_wait_s)" in caplog.text
    assert len(_aside(store, ".damaged-step-000000125-")) == 2 and store.pointer() is None
