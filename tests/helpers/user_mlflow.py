"""A project whose trainer calls MLflow's own API (tests/project_mlflow), a server, readers of its runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.mlflow_server import mlflow_server_fixture
from helpers.project import TESTS, Project, make_test_project


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    yield from mlflow_server_fixture(tmp_path_factory)


@pytest.fixture
def mlproject(tmp_path) -> Project:
    project = make_test_project(tmp_path / "project")
    shutil.copy(TESTS / "project_mlflow" / "mltrainer.py", project.root / "mltrainer.py")
    project.git("add", "mltrainer.py")
    project.git("commit", "-q", "-m", "a trainer that calls MLflow")
    return project


def all_runs(client: MlflowClient) -> list:
    return [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return sorted(out)


def stray_stores(root: Path) -> list[str]:
    """MLflow stores MLflow would make in the working directory by default."""
    return [p.name for p in root.iterdir() if p.name in ("mlflow.db", "mlruns", "mlartifacts")]


def check_long_fit_run(client: MlflowClient, project: Project) -> None:
    (run,) = all_runs(client)  # one run in all: none in "Default", none from the resumed start
    assert client.get_experiment(run.info.experiment_id).name == "u.model"
    assert run.info.status == "FINISHED"
    rid = run.info.run_id
    for key in ("custom", "custom_a", "custom_b", "custom_nostep", "loss"):
        steps = [m.step for m in client.get_metric_history(rid, key)]
        assert steps == list(range(1, 41)), (key, steps)  # one point per step, across the eviction
    history = {m.step: m.value for m in client.get_metric_history(rid, "custom_a")}
    assert history == {s: float(s) for s in range(1, 41)}
    loss = {m.step: m.value for m in client.get_metric_history(rid, "loss")}
    custom = {m.step: m.value for m in client.get_metric_history(rid, "custom")}
    assert custom == pytest.approx({s: 2 * v for s, v in loss.items()})
    # the first start's child at step 1, the resumed start's child at its first step (after the checkpoint)
    child = [m.step for m in client.get_metric_history(rid, "from_child")]
    assert child[0] == 1 and len(child) == 2 and child[1] > 20
    params, tags = run.data.params, run.data.tags
    assert (params["user.lr"], params["user.final"], params["user.rows"]) == ("0.05", "yes", "200")
    assert (tags["user.tag"], tags["user.done"]) == ("hello", "1")
    # the eviction (SIGTERM in step 25, checkpoint at 26) is history once the run finished
    assert tags.get("gwenlake.last_evicted_at_step") == "26" and "gwenlake.evicted_at_step" not in tags, tags
    arts = artifacts(client, rid)
    assert {"notes/weights.json", "notes/note.txt", "figures/plot.png"} <= set(arts), arts
    local = Path(client.download_artifacts(rid, "notes/note.txt", str(project.root / "dl")))
    assert local.read_text() == "a note\n"
    # mlflow.active_run() was the job's run at each start's first step
    assert (project.root / "active_runs").read_text().split() == [rid, rid]
    assert stray_stores(project.root) == []
