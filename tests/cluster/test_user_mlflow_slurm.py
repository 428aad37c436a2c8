"""MLflow's own API called inside a training function reports into the job's run (issue 15).

The trainer (tests/project_mlflow/mltrainer.py) calls ``mlflow.log_metric(s)``, ``log_param(s)``, ``set_tag(s)``,
``log_dict``, ``log_artifact``, ``log_figure`` and ``mlflow.active_run()``; a forked child logs too. Each job is
interrupted by a real SIGTERM and resumed; then the MLflow store is read with a plain client.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.user_mlflow import all_runs, artifacts, stray_stores


@pytest.mark.slurm
def test_a_training_calling_mlflow_on_the_slurm_cluster_reports_into_its_run(mlproject):
    from helpers.slurm_cluster import require_cluster

    from gwenlake_hpc.launch.status import wait

    require_cluster()
    done = mlproject.run("job.target=mltrainer.py:fit", "launcher=slurm", "launcher.timeout_min=5", check=0)
    job = re.search(r"submitted job (\d+)", done.stdout).group(1)
    run_dir = Path(re.search(r"run directory (\S+)", done.stdout).group(1))
    assert wait(job, run_dir, timeout_s=600, poll_s=1.0).state == "COMPLETED"
    client = MlflowClient(tracking_uri=f"sqlite:///{mlproject.root / 'runs' / 'mlflow.db'}")
    (run,) = all_runs(client)
    rid = run.info.run_id
    assert [m.step for m in client.get_metric_history(rid, "custom")] == list(range(1, 41))
    assert [m.step for m in client.get_metric_history(rid, "from_child")] == [1]
    assert run.data.params["user.final"] == "yes" and run.data.tags["user.done"] == "1"
    assert {"notes/weights.json", "notes/note.txt", "figures/plot.png"} <= set(artifacts(client, rid))
    assert (mlproject.root / "active_runs").read_text().split() == [rid]
    assert stray_stores(mlproject.root) == []
