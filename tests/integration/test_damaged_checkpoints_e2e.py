"""Damaged manifests and pointers in whole jobs (issue 40 items 13b, 13d, the inputs tried by hand): a manifest
naming a file outside its checkpoint, a truncated manifest the pointer names, a pointer naming a step that does
not exist. Each start sets the damaged checkpoint (or pointer) aside and resumes from the previous intact one."""

from __future__ import annotations

import json
import time

import pytest

from gwenlake_hpc.stores.checkpoints.digest import file_digest
from helpers.jobs import run_dir_of

pytestmark = pytest.mark.slow


def _evicted(project):
    project.run("+job=t", env={"GWL_TEST_SIGTERM_AT": "25"}, check=75)
    ck = run_dir_of(project) / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*"))[-2:] == ["step-000000020", "step-000000026"]
    assert json.loads((ck / "LATEST.json").read_text())["name"] == "step-000000026"
    return ck


def test_a_manifest_naming_a_file_outside_its_checkpoint_sets_it_aside(project):
    ck = _evicted(project)
    outside = project.root / "runs" / "outside" / "s125" / "v"  # step-000000026/../../../../outside/s125/v
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"someone else's file")
    path = ck / "step-000000026" / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["../../../../outside/s125/v"] = {"size": outside.stat().st_size, "digest": file_digest(outside)}
    path.write_text(json.dumps(manifest))
    assert (ck / "step-000000026" / "../../../../outside/s125/v").resolve() == outside.resolve()
    resumed = project.run("+job=t", check=0)
    log = resumed.stdout + resumed.stderr
    assert "resuming from step 20" in log, log
    assert "MANIFEST.json names '../../../../outside/s125/v', not a plain relative name inside the checkpoint " \
           "folder" in log, log
    assert len(list(ck.glob(".damaged-step-000000026-*"))) == 1
    assert outside.read_bytes() == b"someone else's file"


def test_a_truncated_manifest_the_pointer_names_is_set_aside_at_once(project):
    ck = _evicted(project)
    path = ck / "step-000000026" / "MANIFEST.json"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    t0 = time.monotonic()
    resumed = project.run("+job=t", check=0)  # checkpoint.visible_wait_s: its default, 90 s
    log = resumed.stdout + resumed.stderr
    assert time.monotonic() - t0 < 80, log  # not waited for as a stale cache would be
    assert f"checkpoint {ck / 'step-000000026'} (named by {ck / 'LATEST.json'}) is damaged: its MANIFEST.json " \
           "is not valid JSON" in log, log
    assert "set aside as .damaged-step-000000026-" in log and "stale" not in log, log
    assert "resuming from step 20" in log, log
    assert len(list(ck.glob(".damaged-step-000000026-*"))) == 1


def test_a_pointer_naming_a_step_that_does_not_exist_is_set_aside_after_the_wait(project):
    ck = _evicted(project)
    ptr = json.loads((ck / "LATEST.json").read_text())
    (ck / "LATEST.json").write_text(json.dumps({**ptr, "step": 40, "name": "step-000000040"}))
    resumed = project.run("+job=t", "checkpoint.visible_wait_s=3", check=0)
    log = resumed.stdout + resumed.stderr
    assert f"{ck / 'LATEST.json'} names checkpoint step-000000040 (step 40), which is not on the shared " \
           "filesystem after 3 s (checkpoint.visible_wait_s); set aside as .damaged-LATEST.json-" in log, log
    assert "stale" not in log and "resuming from step 26" in log, log
    assert len(list(ck.glob(".damaged-LATEST.json-*"))) == 1
