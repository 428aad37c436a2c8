"""Named checkpoints of a sharded model (issue 40, item 3): ``gwenlake_hpc.checkpoint(model, path=...,
metadata=...)`` on 2 FSDP2 ranks (gloo) is a collective: one full file written by rank 0, every rank returns; a
refusal on one rank is raised on every rank at once (exit 2), never a collective left waiting."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers.project import make_test_project
from helpers.ranks import launch, model_of, version_in

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
