"""Collectives of 2 FSDP2 ranks (gloo) that a rank leaves (issue 40, items 3 and 4).

Named checkpoints of a sharded model: ``gwenlake_hpc.checkpoint(model, path=..., metadata=...)`` is a
collective: one full file written by rank 0, every rank returns; a refusal on one rank is raised on every rank at
once (exit 2), never a collective left waiting. A rank that dies during a collective save (the sharded seal, the
consolidated final model, the job's final barrier): the survivor names it, its pid and host, in one line, and no
rank exits 0. A rank blocked before its loop (sleeping at import) ends at once on SIGTERM, as torchrun sends it.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers.project import make_test_project
from helpers.ranks import launch, model_of, start_ranks, version_in

pytestmark = pytest.mark.slow

FSDP = ("+job=t", "job.target=trainer.py:fit_fsdp", "job.steps=20")


def _text(results):
    return "\n=====\n".join(so[-3000:] + se[-6000:] for _, so, se in results)


def test_a_named_checkpoint_of_an_fsdp2_model_is_one_full_file_and_every_rank_finishes(tmp_path):
    """The reported input: ``gwenlake_hpc.checkpoint(model, path="exp-one", metadata={...})`` on 2 ranks. It hung
    for the collective timeout (rank 0 gathered alone), or paired with rank 1's next save_state."""
    project = make_test_project(tmp_path / "project")
    results = launch(project, *FSDP, env={"GWL_TEST_NAMED": "exp-one", "GWENLAKE_DIST_TIMEOUT_S": "300"},
                     timeout=600)
    text = _text(results)
    assert [rc for rc, _, _ in results] == [0, 0], text
    named = project.root / "runs" / "t.model" / "named" / "exp-one"
    info = json.loads((named / "checkpoint.json").read_text())
    assert info["step"] == 20 and info["metadata"] == {"lr": 0.01, "seed": 0}, info
    # the named file is the full model, equal to the version committed right after it (same weights)
    saved, committed = load_file(str(named / "model.safetensors")), model_of(project, version_in(results[0][1]))
    assert saved.keys() == committed.keys() and {k: v.shape for k, v in saved.items()} == \
        {"0.weight": torch.Size([8, 4]), "0.bias": torch.Size([8]), "2.weight": torch.Size([1, 8]),
         "2.bias": torch.Size([1])}
    assert all(torch.equal(saved[k], committed[k]) for k in saved)
    assert not [p.name for p in named.parent.iterdir() if p.name.startswith(".tmp")]


def test_a_named_checkpoint_refused_on_rank_1_exits_2_on_every_rank_with_the_rule(tmp_path):
    """Rank 1's metadata is not JSON (NaN): every rank exits 2 at once with the rule and the rank named; nothing
    is written, no gloo traceback, no collective timeout (60 s here, the test would see it)."""
    project = make_test_project(tmp_path / "project")
    results = launch(project, *FSDP, env={"GWL_TEST_NAMED": "exp-one", "GWL_TEST_NAMED_BAD_RANK": "1"},
                     timeout=600)
    text = _text(results)
    assert [rc for rc, _, _ in results] == [2, 2], text
    for _, so, se in results:
        assert "checkpoint metadata: give JSON values" in so + se and "refused on rank 1" in so + se, text
        assert "Traceback" not in so + se, text
    assert not (project.root / "runs" / "t.model" / "named" / "exp-one").exists()


def _ranks(project, *args, env):
    """Start 2 ranks; returns [(rc, stdout, stderr)] and rank 1's pid."""
    procs = start_ranks(project, *args, env={"GWENLAKE_DIST_TIMEOUT_S": "300", **env})
    pid = procs[1].pid
    out = []
    for p in procs:
        so, se = p.communicate(timeout=600)
        out.append((p.returncode, so, se))
    return out, pid


@pytest.mark.parametrize("phase,where", [("6:mid_write:100", r"at step (6|7|8)"), ("0:final", "at step 20")],
                         ids=["sharded-seal", "final-model"])
def test_a_rank_killed_in_a_collective_save_is_named_in_one_line_by_the_survivor(tmp_path, phase, where):
    """The reported inputs: rank 1 SIGKILLed while its shard of a checkpoint is written (background), and while
    rank 0 gathers the full model into the Output. Rank 0 printed chained gloo tracebacks and no message of ours."""
    project = make_test_project(tmp_path / "project")
    results, pid = _ranks(project, *FSDP, "job.eval_every=2", env={"GWL_TEST_SIGKILL": phase})
    (rc0, so0, se0), (rc1, _, _) = results
    assert (rc0, rc1) == (1, -signal.SIGKILL), _text(results)
    # the background write of step 6 fails there; the loop finds out at its next collective (step 6, 7 or 8)
    line = rf"rank 1 \(pid {pid} on {re.escape(socket.gethostname())}\) is gone: a collective failed {where}; " \
        "every rank stops"
    assert re.search(line, so0 + se0), _text(results)
    assert "Traceback" not in so0 + se0, _text(results)


def test_a_rank_killed_before_the_final_barrier_makes_no_rank_exit_0(tmp_path):
    """Rank 1 dies after the final model is written, as rank 0 commits: rank 0 exited 0 while the job failed.
    Now it exits 1, names rank 1, and the version it committed stays (a rerun prints it)."""
    project = make_test_project(tmp_path / "project")
    results, pid = _ranks(project, *FSDP, env={"GWL_TEST_SIGKILL": "0:end"})
    (rc0, so0, se0), (rc1, _, _) = results
    assert (rc0, rc1) == (1, -signal.SIGKILL), _text(results)
    assert f"rank 1 (pid {pid} on {socket.gethostname()}) is gone: a collective failed at the job's end" in so0 + se0
    version = version_in(so0)
    again = launch(project, *FSDP, timeout=600)
    assert [rc for rc, _, _ in again] == [0, 0] and version_in(again[0][1]) == version, _text(again)


def test_a_rank_sleeping_at_import_ends_at_once_on_sigterm(tmp_path):
    """The reported input: rank 1 blocked in its user module's import (a stalled file system); torchrun's SIGTERM to
    both ranks ended neither (rank 1 needed SIGKILL 30 s later). Now rank 1 ends with exit 75 and one line, and
    rank 0 (waiting for it in a collective, 300 s timeout) ends right after it, naming it."""
    project = make_test_project(tmp_path / "project")
    marker = tmp_path / "sleeping"
    procs = start_ranks(project, *FSDP, env={"GWL_TEST_SLEEP_AT_IMPORT": str(marker),
                                             "GWL_TEST_SLEEP_AT_IMPORT_RANK": "1", "GWENLAKE_DIST_TIMEOUT_S": "300"})
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "rank 1 never reached its import"
        time.sleep(0.2)
    time.sleep(1.0)  # rank 0 is waiting in its collective by now, rank 1 in its sleep
    for p in procs:
        p.send_signal(signal.SIGTERM)
    results = []
    for p in procs:  # well under the 300 s of the collective's timeout and torchrun's 30 s grace is not needed
        so, se = p.communicate(timeout=120)
        results.append((p.returncode, so, se))
    text = _text(results)
    (rc0, so0, se0), (rc1, so1, se1) = results
    assert rc1 == 75 and "stop requested (SIGTERM) during the start-up" in so1 + se1, text
    assert "Traceback" not in so1 + se1, text
    assert rc0 != 0 and "Traceback" not in so0 + se0, text


@pytest.mark.parametrize("hook,said", [
    # rank 1 goes on to the final save_state of the sharded model, rank 0 is in gwenlake_hpc.checkpoint
    ({"GWL_TEST_NAMED_RANK": "0"}, ["gwenlake_hpc.checkpoint('exp-one') is a collective: rank(s) 1 did not call it",
                                    "rank 0 is in gwenlake_hpc.checkpoint, not in this save_state"]),
    ({"GWL_TEST_NAMED_PER_RANK": "1"}, ["the ranks gave different names (rank 0: 'exp-one-0', rank 1: 'exp-one-1')"]),
], ids=["rank-0-only", "names-differ"])
def test_a_named_checkpoint_misused_across_ranks_exits_2_at_once_naming_the_misuse(tmp_path, hook, said):
    """The adversarial pass's inputs: called under `if run.is_main:` (rank 0's call met rank 1's end: both waited
    for the collective timeout, then blamed a dead rank), and with another name on each rank (rank 1's ignored)."""
    project = make_test_project(tmp_path / "project")
    t0 = time.monotonic()
    results = launch(project, *FSDP, env={"GWL_TEST_NAMED": "exp-one", "GWENLAKE_DIST_TIMEOUT_S": "300", **hook},
                     timeout=600)
    text = _text(results)
    assert time.monotonic() - t0 < 240, text  # not the 300 s of a collective's timeout
    assert [rc for rc, _, _ in results] == [2, 2], text
    for needle in said:
        assert needle in text, text
    assert "Traceback" not in text and "is gone" not in text, text
    assert not list((project.root / "runs" / "t.model" / "named").glob("exp-one*"))


def test_a_named_checkpoint_of_an_fsdp2_state_dict_is_the_full_model(tmp_path):
    """The adversarial pass's input: ``gwenlake_hpc.checkpoint(model.state_dict(), ...)`` of a fully_shard model
    (a mapping of DTensors) raised a TypeError on both ranks; it is gathered like the module itself."""
    project = make_test_project(tmp_path / "project")
    results = launch(project, *FSDP, env={"GWL_TEST_NAMED": "exp-one", "GWL_TEST_NAMED_STATE_DICT": "1",
                                          "GWENLAKE_DIST_TIMEOUT_S": "300"}, timeout=600)
    assert [rc for rc, _, _ in results] == [0, 0], _text(results)
    saved = load_file(str(project.root / "runs" / "t.model" / "named" / "exp-one" / "model.safetensors"))
    committed = model_of(project, version_in(results[0][1]))
    assert saved.keys() == committed.keys() and all(torch.equal(saved[k], committed[k]) for k in saved)


def test_a_stop_on_one_rank_before_its_loop_ends_both_ranks_at_once(tmp_path):
    """The adversarial pass's input: rank 1 stopped (SIGTERM) before its loop while rank 0 was in its loop's
    collectives; rank 1 waited at the final barrier and rank 0 in its collective until the timeout (600 s)."""
    project = make_test_project(tmp_path / "project")
    t0 = time.monotonic()
    results = launch(project, *FSDP, env={"GWL_TEST_SIGTERM_BEFORE_LOOP_RANK": "1",
                                          "GWENLAKE_DIST_TIMEOUT_S": "300"}, timeout=600)
    text = _text(results)
    assert time.monotonic() - t0 < 240, text
    (rc0, so0, se0), (rc1, so1, se1) = results
    assert rc1 == 75 and "stop requested (SIGTERM) before the training loop began" in so1 + se1, text
    assert rc0 == 1 and "rank 1 (pid" in so0 + se0 and "is gone" in so0 + se0, text
    assert "Traceback" not in text, text
