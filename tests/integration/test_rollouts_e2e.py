"""RL rollouts as MLflow traces: checked messages, one trace per episode linked to the job's run, exactly once."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking.rollouts import ROLLOUT_TAG, deliver_rollout, rollout_entry
from helpers.rollouts import CHAT


def test_a_rollout_delivered_twice_is_one_trace_with_its_spans(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e")
    run = client.create_run(exp)
    entry = rollout_entry(CHAT, reward=0.5, step=4, task_id="t1", metrics=None, rollout_id="ab" * 16)["rollout"]
    assert deliver_rollout(client, uri, exp, run.info.run_id, entry) is True
    assert deliver_rollout(client, uri, exp, run.info.run_id, entry) is False  # after a kill: not twice
    traces = client.search_traces(locations=[exp], run_id=run.info.run_id)
    assert len(traces) == 1
    t = traces[0]
    assert t.info.tags[ROLLOUT_TAG] == "ab" * 16 and t.info.tags["gwenlake.task_id"] == "t1"
    assert [s.name for s in t.data.spans] == ["rollout", "model turn 1", "tool calc", "model turn 2"]
    assert t.data.spans[0].outputs["reward"] == 0.5 and t.data.spans[2].outputs["content"] == "4"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from helpers.mlflow_server import mlflow_server_fixture

    yield from mlflow_server_fixture(tmp_path_factory)


@pytest.mark.slow
def test_rollouts_and_tagged_series_through_an_mlflow_server(server):
    """The same trace calls over MLflow's REST API (PostgreSQL-backed where it answers), and a tagged series
    name the server accepts."""
    from gwenlake_hpc.stores.tracking.metric_tags import run_tag, tagged_series

    client = MlflowClient(tracking_uri=server.uri)
    exp = client.create_experiment("rollouts-server")
    run = client.create_run(exp)
    entry = rollout_entry(CHAT, reward=1.0, step=9, task_id="srv", metrics={"turns": 2},
                          rollout_id="cd" * 16)["rollout"]
    assert deliver_rollout(client, server.uri, exp, run.info.run_id, entry) is True
    assert deliver_rollout(client, server.uri, exp, run.info.run_id, entry) is False
    traces = client.search_traces(locations=[exp], run_id=run.info.run_id)
    assert [t.info.tags[ROLLOUT_TAG] for t in traces] == ["cd" * 16]
    assert [s.name for s in traces[0].data.spans] == ["rollout", "model turn 1", "tool calc", "model turn 2"]
    series, step, naming = tagged_series("auc", {"split": "test", "class": "churn/a", "epoch": 3})
    client.log_metric(run.info.run_id, series, 0.9, step=step)
    client.set_tag(run.info.run_id, *run_tag(series, naming))
    got = client.get_run(run.info.run_id)
    assert got.data.metrics == {"auc/class:churn_a/split:test": 0.9}
    assert [m.step for m in client.get_metric_history(run.info.run_id, series)] == [3]


@pytest.mark.slow
def test_a_job_logs_its_rollouts_as_traces_of_its_run(observed_job):
    project, done = observed_job.project, observed_job.proc
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    run = client.get_run((run_dir / "tracking" / "run_id").read_text().strip())
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id)
    by_step = {int(t.info.tags["gwenlake.step"]): t for t in traces}
    assert sorted(by_step) == [10, 20, 30]
    t = by_step[20]
    assert t.info.tags[ROLLOUT_TAG] == f"{20:032x}" and t.info.tags["gwenlake.task_id"] == "task-20"
    assert [s.name for s in t.data.spans] == ["rollout", "model turn 1", "tool get_weather", "model turn 2"]
    assert t.data.spans[0].outputs["reward"] == 0.2 and t.data.spans[0].outputs["metrics"] == {"turns": 2.0}
