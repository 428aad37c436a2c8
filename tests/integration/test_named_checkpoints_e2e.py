"""Named checkpoints: a store per model shared by its runs, a `latest` entry, `checkpoints list`."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_a_named_checkpoint_of_one_run_is_seen_by_the_next_and_listed(project):
    first = project.run("+job=t", "job.steps=20", "job.tracking=false", env={"GWL_TEST_NAMED": "experiment-one"},
                        check=0)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "last named checkpoint: None" in first.stdout
    folder = project.root / "runs" / "t.model" / "named" / "experiment-one"
    info = json.loads((folder / "checkpoint.json").read_text())
    run_key = next(p.name for p in (project.root / "runs" / "t.model").iterdir() if p.name != "named")
    assert info["run_key"] == run_key and info["step"] == 20 and info["metadata"] == {"lr": 0.01, "seed": 0}
    assert (folder / "notes.txt").read_text() == f"run {run_key}\n"
    second = project.run("+job=t", "job.steps=20", "job.seed=1", "job.tracking=false",
                         env={"GWL_TEST_NAMED": "experiment-two"}, check=0)
    assert f"last named checkpoint: {folder}" in second.stdout  # another run of the model sees it
    listed = project.run("checkpoints", "list", "t.model", check=0)
    lines = listed.stdout.splitlines()
    assert listed.returncode == 0 and len(lines) == 3, listed.stdout + listed.stderr
    assert lines[1].split()[:3] == ["experiment-one", run_key, "20"]
    assert lines[2].startswith("* experiment-two") and '{"lr": 0.01, "seed": 1}' in lines[2]
    bad = project.run("checkpoints", "list", "../etc")
    assert bad.returncode == 2 and "not a valid name" in bad.stderr


