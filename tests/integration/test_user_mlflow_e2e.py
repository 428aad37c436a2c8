"""MLflow's own API called inside a training function reports into the job's run (issue 15).

The trainer (tests/project_mlflow/mltrainer.py) calls ``mlflow.log_metric(s)``, ``log_param(s)``, ``set_tag(s)``,
``log_dict``, ``log_artifact``, ``log_figure`` and ``mlflow.active_run()``; a forked child logs too. Each job is
interrupted by a real SIGTERM and resumed; then the MLflow store is read with a plain client.
"""

from __future__ import annotations


import pytest
from mlflow import MlflowClient

from helpers.user_mlflow import check_long_fit_run


@pytest.mark.slow
def test_long_fit_calling_mlflow_reports_to_a_tracking_server(mlproject, mlflow_server):
    uri = mlflow_server.uri
    done = mlproject.run("job.target=mltrainer.py:fit", f"tracking.uri={uri}", env={"GWL_TEST_SIGTERM_AT": "25"})
    assert done.returncode == 75, done.stdout + done.stderr
    mlproject.run("job.target=mltrainer.py:fit", f"tracking.uri={uri}", check=0)
    check_long_fit_run(MlflowClient(tracking_uri=uri), mlproject)  # the only test on this server
    assert not (mlproject.root / "runs" / "mlflow.db").exists()


