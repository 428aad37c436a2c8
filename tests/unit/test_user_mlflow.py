"""MLflow's own API called inside a training function reports into the job's run (issue 15).

The trainer (tests/project_mlflow/mltrainer.py) calls ``mlflow.log_metric(s)``, ``log_param(s)``, ``set_tag(s)``,
``log_dict``, ``log_artifact``, ``log_figure`` and ``mlflow.active_run()``; a forked child logs too. Each job is
interrupted by a real SIGTERM and resumed; then the MLflow store is read with a plain client.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.user_mlflow import all_runs, artifacts, check_long_fit_run, stray_stores


def test_long_fit_calling_mlflow_is_one_run_across_an_eviction(mlproject):
    done = mlproject.run("job.target=mltrainer.py:fit", env={"GWL_TEST_SIGTERM_AT": "25"})
    assert done.returncode == 75, done.stdout + done.stderr
    again = mlproject.run("job.target=mltrainer.py:fit", check=0)
    assert "model u.model version" in again.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
    check_long_fit_run(client, mlproject)


def test_short_fit_calling_mlflow_reports_into_its_run(mlproject, tmp_path):
    import signal

    from helpers.concurrency import wait_until

    reached, go = tmp_path / "reached", tmp_path / "go"
    proc = mlproject.popen("job.target=mltrainer.py:fit_short", env={"GWL_TEST_SHORT_WAIT": f"{reached}:{go}"})
    wait_until(reached.exists, timeout_s=300, what="the short fit's third point")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, out + err
    again = mlproject.run("job.target=mltrainer.py:fit_short", check=0)  # fits again from nothing
    client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
    (run,) = all_runs(client)
    assert client.get_experiment(run.info.experiment_id).name == "u.short"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "short_metric")] == \
        [(i + 1, float(i)) for i in range(5)]
    assert run.data.params["user.kind"] == "short"
    assert "short.json" in artifacts(client, run.info.run_id)
    assert stray_stores(mlproject.root) == []
    # plain mlflow.sklearn.autolog() (mltrainer._autolog_fits): three fits
    text = again.stdout + again.stderr
    refusals = [line for line in text.splitlines() if "Encountered unexpected error during sklearn autologging" in line]
    assert len(refusals) == 3 and all("mlflow.sklearn.autolog(log_models=False)" in r for r in refusals), text
    assert "log_input(s) inside a gwenlake_hpc training is ignored" not in text
    assert "Failed to log training dataset information" not in text  # MLflow's own line, replaced by ours once:
    assert text.count("MLflow's autolog could not record the training data") == 1, text
    assert "'Series' object has no attribute 'flatten'" in text and "y.to_numpy()" in text
    (dataset,) = client.get_run(run.info.run_id).inputs.dataset_inputs  # the DataFrame fit's
    assert dataset.dataset.source_type == "code" and json.loads(dataset.dataset.schema)["mlflow_colspec"]
    assert {t.key: t.value for t in dataset.tags} == {"mlflow.data.context": "train"}


@pytest.mark.parametrize("tracking", ["true", "false"])
def test_mlflow_imported_in_the_function_and_left_active_makes_no_store_in_the_working_directory(mlproject, tracking):
    """MLflow's exit hook ends a run left active: against its default store (./mlflow.db) unless the job ended
    it while the URI was still the job's."""
    mlproject.run("job.target=mltrainer.py:fit_inner", f"job.tracking={tracking}", check=0)
    assert stray_stores(mlproject.root) == []
    if tracking == "true":
        client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
        (run,) = all_runs(client)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "inner")] == [1, 2, 3, 4, 5]


def test_tracking_off_warns_once_and_writes_no_store(mlproject):
    done = mlproject.run("job.target=mltrainer.py:fit", "job.tracking=false", check=0)
    text = done.stdout + done.stderr
    assert text.count("MLflow calls in the training function go nowhere") == 1, text
    assert "tracking is off for this job" in text
    assert stray_stores(mlproject.root) == [] and not (mlproject.root / "runs" / "mlflow.db").exists()
    assert (mlproject.root / "active_runs").read_text().split() == ["gwenlake-job-run"]


def test_a_local_run_calling_mlflow_writes_no_store(mlproject, monkeypatch, caplog):
    import importlib.util

    monkeypatch.chdir(mlproject.root)
    spec = importlib.util.spec_from_file_location("mltrainer_local", mlproject.root / "mltrainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.fit.local(data_root=mlproject.root / "data", steps=12)
    assert result["loss"] > 0
    assert "fit.local() does not track: MLflow calls in the training function go nowhere" in caplog.text
    assert stray_stores(mlproject.root) == [] and not (mlproject.root / "runs").exists()
    import os

    assert not os.environ.get("MLFLOW_TRACKING_URI", "").startswith("gwenlake-job")  # restored afterwards


class RecordingTracker:
    """The job's Tracker as the store sees it: records what it is given (the delivery is tested above)."""

    def __init__(self, run_id):
        self.run_id, self.points, self.params, self.tags, self.files, self.inputs = run_id, [], {}, {}, [], []

    def wait_attached(self, timeout_s):
        return True

    def log_metrics(self, metrics, step, timestamp_ms=None):
        self.points += [(k, v, step) for k, v in metrics.items()]

    def log_params(self, params):
        self.params.update(params)

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_artifact(self, local_file, artifact_path=None):
        self.files.append((Path(local_file).read_text(), artifact_path))

    def log_inputs(self, inputs):
        self.inputs += inputs


def test_without_entry_points_the_store_is_registered_once_mlflow_is_imported(tmp_path, monkeypatch):
    """gwenlake_hpc imported from a source folder (no entry points): the schemes are registered in MLflow's
    registries; a step-less point takes the training's step; nested runs are refused; status changes ignored."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from gwenlake_hpc.stores.tracking import user_mlflow
    from gwenlake_hpc.stores.tracking.user_mlflow import fluent

    monkeypatch.setattr(fluent, "_plugins_installed", lambda: False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = tmp_path / "tracking"
    state.mkdir()
    (state / "run_id").write_text("abc123\n")
    tracker = RecordingTracker("abc123")
    step = {"now": 7}
    other = f"sqlite:///{tmp_path / 'other.db'}"
    mlflow.set_tracking_uri(other)  # the module's own choice: set aside while the function runs
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", other)  # undone after the test
    with user_mlflow.reporting(tracker, state, lambda: step["now"]):
        assert mlflow.active_run().info.run_id == "abc123"
        mlflow.log_metric("m", 1.5, step=3)
        mlflow.log_metric("nostep", 2.0)
        mlflow.log_param("p", 4)
        mlflow.set_tag("t", "x")
        (tmp_path / "f.txt").write_text("hi")
        mlflow.log_artifact(str(tmp_path / "f.txt"), "dir")
        with pytest.raises(MlflowException, match="a nested run is not available"):
            mlflow.start_run(nested=True)
        with pytest.raises(MlflowException, match="reading a metric's history"):
            mlflow.MlflowClient().get_metric_history("abc123", "m")
        from sklearn.linear_model import LinearRegression

        with pytest.raises(MlflowException, match=r"mlflow.sklearn.log_model\) are not stored.*save the model's "
                                                  "files in the function's Output folder"):
            mlflow.sklearn.log_model(LinearRegression(), name="m")
        import numpy as np

        tiny = mlflow.data.from_numpy(np.arange(6.0).reshape(3, 2), name="tiny")
        mlflow.log_input(tiny, context="train")
        with mlflow.start_run() as own:  # the user's own start_run replaces the run opened for active_run()
            assert own.info.run_id == "abc123"
            mlflow.log_metric("in_own", 3.0, step=8)
        mlflow.end_run(status="FAILED")  # ignored by the store; a later call continues the job's run
        mlflow.log_metric("after_end", 1.0, step=9)
        assert mlflow.active_run().info.run_id == "abc123"
    assert tracker.points == [("m", 1.5, 3), ("nostep", 2.0, 7), ("in_own", 3.0, 8), ("after_end", 1.0, 9)]
    assert tracker.params == {"p": "4"} and tracker.tags == {"t": "x"} and tracker.files == [("hi", "dir")]
    (given,) = tracker.inputs  # a dataset input, as MLflow's entity has it
    assert given["dataset"]["name"] == "tiny" and given["dataset"]["digest"] == tiny.digest
    assert given["dataset"]["source_type"] == "code"
    assert json.loads(given["dataset"]["profile"])["features_shape"] == [3, 2]
    assert given["tags"] == {"mlflow.data.context": "train"}
    assert mlflow.active_run() is None
    assert mlflow.start_run.__module__ == "mlflow.tracking.fluent"  # the wrapper is gone
    assert mlflow.get_tracking_uri() == other and not (tmp_path / "other.db").exists()
    # a function that raises with a run active: the run is ended on the way out, so MLflow's exit hook has
    # nothing to end against its default store (a ./mlflow.db in the working directory)
    with pytest.raises(RuntimeError, match="boom"):
        with user_mlflow.reporting(tracker, state, lambda: 0):
            mlflow.log_metric("before_boom", 1.0, step=10)
            raise RuntimeError("boom")
    assert mlflow.active_run() is None and tracker.points[-1] == ("before_boom", 1.0, 10)
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # set_tracking_uri exported it


def test_a_tracking_uri_set_in_the_environment_or_by_the_module_is_set_aside(mlproject, tmp_path):
    """A shell profile's MLFLOW_TRACKING_URI and an mlflow.set_tracking_uri() at import would send the calls to
    a second run elsewhere: while the function runs they are set aside, with a line saying so."""
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    done = mlproject.run("job.target=mltrainer.py:fit_inner", env={"MLFLOW_TRACKING_URI": elsewhere}, check=0)
    assert "is set aside while the training function runs" in done.stdout + done.stderr
    assert not (tmp_path / "elsewhere.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
    (run,) = all_runs(client)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "inner")] == [1, 2, 3, 4, 5]


