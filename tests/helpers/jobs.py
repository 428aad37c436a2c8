"""Reading what a finished job left: its version (the last line it prints), its run directory, its weights in
the model repository, its runs in the SQLite MLflow store."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mlflow import MlflowClient
from safetensors.torch import load_file

VERSION_PREFIX = "model t.model version "


def version_of(proc) -> str:
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(VERSION_PREFIX), proc.stdout + proc.stderr
    sha = last[len(VERSION_PREFIX):]
    assert len(sha) == 40
    return sha


def run_dir_of(project, runs="runs") -> Path:
    dirs = list((project.root / runs / "t.model").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def weights_at(project, sha):
    raw = subprocess.run(["git", "cat-file", "blob", f"{sha}:t/model/model.safetensors"],
                                       cwd=project.root, capture_output=True, check=True).stdout
    path = project.root / f"w-{sha[:8]}.safetensors"
    path.write_bytes(raw)
    return load_file(str(path))


def mlflow_runs(project, runs="runs"):
    client = MlflowClient(f"sqlite:///{project.root / runs / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t.model")
    return client, client.search_runs([exp.experiment_id])


def assert_one_point_per_step(client, run_id, key, steps):
    history = client.get_metric_history(run_id, key)
    assert sorted(m.step for m in history) == list(steps)
