"""Non-finite values: a NaN loss stops the run, never bare NaN in JSON, no candidate for NaN metrics, NaN data reported."""

from __future__ import annotations

import json
import math

import pytest


@pytest.mark.slow
def test_nan_loss_in_a_job_exits_1_keeps_the_checkpoint_and_commits_nothing(project):
    from helpers.jobs import mlflow_runs, run_dir_of

    failed = project.run("+job=t", env={"GWL_TEST_NAN_AT": "25"})
    log = failed.stdout + failed.stderr
    assert failed.returncode == 1, log
    assert "metric 'loss' is nan at step 25" in log and "step-000000020" in log
    assert "model t.model version" not in failed.stdout
    assert sorted(p.name for p in (run_dir_of(project) / "checkpoints").glob("step-*")) == \
        ["step-000000010", "step-000000020"]
    _, runs = mlflow_runs(project)
    assert [r.info.status for r in runs] == ["FAILED"]


@pytest.mark.slow
def test_warned_nan_model_is_committed_with_valid_json_and_no_candidate(project):
    done = project.run("+job=t", "job.on_nonfinite=warn", env={"GWL_TEST_NAN_AT": "25"}, check=0)
    sha = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1]
    metrics = json.loads(project.git("show", f"{sha}:t/model/metrics.json"))
    assert metrics == {"final_loss": "nan"}
    json.loads(project.git("show", f"{sha}:t/model/lineage.json"))
    assert "has non-finite metrics (final_loss=nan): the alias candidate is not moved" in done.stdout + done.stderr
    listing = project.run("models", "list", "t.model", check=0).stdout
    assert "candidate" not in listing
    assert math.isnan(float(metrics["final_loss"]))


