"""MLflow's own API called inside a training function reports into the job's run (issue 15), in process: a
local run, and the store without the package's entry points (the whole jobs are in
tests/integration/test_user_mlflow_e2e.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers.user_mlflow import stray_stores


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


def test_entry_points_naming_a_module_that_moved_are_stale_and_said_so(monkeypatch, caplog):
    """The adversarial pass's case: a venv installed before the tracking modules moved names
    `gwenlake_hpc.tracking.mlflow_plugin:JobStore`; MLflow refused the job's URI with a traceback. Now the entry
    point counts as missing (the store is registered by hand) and one warning says to reinstall."""
    import importlib.metadata as md

    from gwenlake_hpc.stores.tracking.user_mlflow import fluent, sink

    def fake(group=None, **_):
        eps = md.EntryPoints([md.EntryPoint("gwenlake-job", "gwenlake_hpc.tracking.mlflow_plugin:JobStore",
                                            "mlflow.tracking_store")])
        return eps if group == "mlflow.tracking_store" else md.EntryPoints([])

    monkeypatch.setattr(md, "entry_points", fake)
    monkeypatch.setattr(sink, "_warned", set())
    with caplog.at_level("WARNING", logger="gwenlake_hpc.tracking"):
        assert fluent._plugins_installed() is False
    assert "gwenlake_hpc.tracking.mlflow_plugin:JobStore, a module that no longer exists" in caplog.text
    assert "pip install -e" in caplog.text
    monkeypatch.undo()
    assert fluent._plugins_installed() is True  # this checkout's own install
