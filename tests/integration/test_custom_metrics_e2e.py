"""Custom metrics to StatsD: a real UDP socket receives and parses what log_custom_metric sends."""

from __future__ import annotations

import pytest
from helpers.custom_metrics import parse


@pytest.mark.slow
def test_a_job_sends_one_gauge_per_step_equal_to_the_tracked_loss(observed_job):
    """statsd.host/port in the job config; the training's values are the MLflow run's loss points."""
    from mlflow import MlflowClient

    project, proc = observed_job.project, observed_job.proc
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for d in observed_job.datagrams for line in parse(d)]
    assert {name for name, *_ in lines} == {"ci.custom_metrics.loss"}
    sent = {int(tags["step"]): value for _, value, _, tags in lines}
    assert sorted(sent) == list(range(1, 31)) and all(tags["split"] == "train" for *_, tags in lines)
    uri = f"sqlite:///{project.root / 'runs' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = (next((project.root / "runs" / "t.model").iterdir()) / "tracking" / "run_id").read_text().strip()
    tracked = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sent == tracked
