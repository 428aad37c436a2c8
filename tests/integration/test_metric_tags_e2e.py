"""Tagged metrics in a real job, read back from the MLflow store: one series per tag combination, the tags
recorded on the run, step/epoch as the x-axis, an unknown tag name warned about once."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.slow  # real jobs and MLflow stores: the integration tier


def test_tagged_metrics_are_series_mlflow_accepts_with_their_tags_on_the_run(observed_job):
    project, proc = observed_job.project, observed_job.proc
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    run = client.get_run((run_dir / "tracking" / "run_id").read_text().strip())
    assert {"mse/class:all/split:val", "acc/threshold:0.5", "odd/colour:red"} <= set(run.data.metrics)
    mse = client.get_metric_history(run.info.run_id, "mse/class:all/split:val")
    assert [m.step for m in mse] == [10, 20, 30]  # gwenlake_hpc.log_metrics: the run's step
    acc = client.get_metric_history(run.info.run_id, "acc/threshold:0.5")
    assert [(m.step, m.value) for m in acc] == [(1, 0.51), (2, 0.52), (3, 0.53)]  # the epoch tag is the x-axis
    assert json.loads(run.data.tags["gwenlake.metric_tags.mse/class:all/split:val"]) == {"class": "all",
                                                                                       "split": "val"}
    assert json.loads(run.data.tags["gwenlake.metric_tags.acc/threshold:0.5"]) == {"threshold": "0.5"}
    assert out.count("metric tag 'colour' is not one of") == 1
    assert "dropping" not in out and "invalid" not in out.lower()
    assert run.info.status == "FINISHED"
