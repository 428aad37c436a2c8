"""The integrations' test projects: conf/, examples/ and a hooks module of tests/project (the example's training
with the tests' signal hooks), committed in their own git repository; reading their MLflow runs and versions."""

from __future__ import annotations

import shutil
import subprocess

from mlflow import MlflowClient
from safetensors.torch import load_file

from .project import REPO, TESTS, Project, git


def make_framework_project(root, hooks: str | None = None, job: str | None = None, job_yaml: str = "") -> Project:
    """A project at ``root`` holding conf/, examples/, tests/project/``hooks`` and ``conf/job/<job>.yaml`` =
    ``job_yaml`` (the last two where given)."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    if hooks:
        shutil.copy(TESTS / "project" / hooks, root / hooks)
    if job:
        (root / "conf" / "job" / f"{job}.yaml").write_text(job_yaml)
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "code")
    return Project(root)


def version_line(proc, model: str) -> str:
    """The version SHA of the last line ``model <name> version <sha>`` a finished job prints."""
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"model {model} version "), proc.stdout + proc.stderr
    return last.split()[-1]


def checkpoints(project, model: str) -> list[str]:
    """The sealed checkpoints' folder names of the project's one run of ``model``."""
    (run_dir,) = (project.root / "runs" / model).iterdir()
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def weights(project, sha: str, rel: str) -> dict:
    """The safetensors file ``rel`` of commit ``sha`` of the project's model repository."""
    path = project.root / f"w-{sha[:8]}.safetensors"
    path.write_bytes(subprocess.run(["git", "cat-file", "blob", f"{sha}:{rel}"], cwd=project.root,
                                    capture_output=True, check=True).stdout)
    return load_file(str(path))


def the_run(project, experiment: str):
    """(client, the one MLflow run of ``experiment``) in the project's SQLite store; fails unless exactly one."""
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def history(project, experiment: str, key: str) -> dict[int, float]:
    """``{step: value}`` of metric ``key`` of the one run of ``experiment``; fails on two points at a step."""
    client, run = the_run(project, experiment)
    points = client.get_metric_history(run.info.run_id, key)
    assert len({m.step for m in points}) == len(points), sorted(m.step for m in points)
    return {m.step: m.value for m in points}
