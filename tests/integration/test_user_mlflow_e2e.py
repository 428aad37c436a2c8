"""MLflow's own API called inside a training function reports into the job's run (issue 15).

The trainer (tests/project_mlflow/mltrainer.py) calls ``mlflow.log_metric(s)``, ``log_param(s)``, ``set_tag(s)``,
``log_dict``, ``log_artifact``, ``log_figure`` and ``mlflow.active_run()``; a forked child logs too. Each job is
interrupted by a real SIGTERM and resumed; then the MLflow store is read with a plain client.
"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from helpers.user_mlflow import all_runs, artifacts, check_long_fit_run, stray_stores


@pytest.mark.slow
def test_long_fit_calling_mlflow_reports_to_a_tracking_server(mlproject, mlflow_server):
    uri = mlflow_server.uri
    done = mlproject.run("job.target=mltrainer.py:fit", f"tracking.uri={uri}", env={"GWL_TEST_SIGTERM_AT": "25"})
    assert done.returncode == 75, done.stdout + done.stderr
    mlproject.run("job.target=mltrainer.py:fit", f"tracking.uri={uri}", check=0)
    check_long_fit_run(MlflowClient(tracking_uri=uri), mlproject)  # the only test on this server
    assert not (mlproject.root / "runs" / "mlflow.db").exists()


@pytest.mark.slow
def test_long_fit_calling_mlflow_is_one_run_across_an_eviction(mlproject):
    done = mlproject.run("job.target=mltrainer.py:fit", env={"GWL_TEST_SIGTERM_AT": "25"})
    assert done.returncode == 75, done.stdout + done.stderr
    again = mlproject.run("job.target=mltrainer.py:fit", check=0)
    assert "model u.model version" in again.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
    check_long_fit_run(client, mlproject)


@pytest.mark.slow
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
@pytest.mark.slow
def test_mlflow_imported_in_the_function_and_left_active_makes_no_store_in_the_working_directory(mlproject, tracking):
    """MLflow's exit hook ends a run left active: against its default store (./mlflow.db) unless the job ended
    it while the URI was still the job's."""
    mlproject.run("job.target=mltrainer.py:fit_inner", f"job.tracking={tracking}", check=0)
    assert stray_stores(mlproject.root) == []
    if tracking == "true":
        client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
        (run,) = all_runs(client)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "inner")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_tracking_off_warns_once_and_writes_no_store(mlproject):
    done = mlproject.run("job.target=mltrainer.py:fit", "job.tracking=false", check=0)
    text = done.stdout + done.stderr
    assert text.count("MLflow calls in the training function go nowhere") == 1, text
    assert "tracking is off for this job" in text
    assert stray_stores(mlproject.root) == [] and not (mlproject.root / "runs" / "mlflow.db").exists()
    assert (mlproject.root / "active_runs").read_text().split() == ["gwenlake-job-run"]


@pytest.mark.slow
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
