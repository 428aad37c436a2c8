"""fit.local(): the training in this process, no tracking, no commit; save_model() commits hand-made work."""

from __future__ import annotations

import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import pytest

from gwenlake_hpc import load_model, save_model
from gwenlake_hpc.base.errors import ConfigError


def trainer_of(project, name):
    spec = importlib.util.spec_from_file_location(name, project.root / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def local_dirs():
    return set(Path(tempfile.gettempdir()).glob("gwenlake-local-*"))


def test_a_smoke_run_returns_the_metrics_and_leaves_nothing(project):
    trainer = trainer_of(project, "trainer_local_smoke")
    before = local_dirs()
    result = trainer.fit.local(steps=5, data_root=project.root / "data")
    assert set(result) == {"final_loss"} and math.isfinite(result["final_loss"])
    assert local_dirs() == before  # the temporary run directory is gone
    assert not (project.root / "runs").exists()  # no run directory, no MLflow store
    assert "models/t.model" not in project.git("branch", "--list", "models/*")  # nothing committed
    again = trainer.fit.local(steps=5, data_root=project.root / "data")
    assert again == result  # same seed, same data: the same numbers


def test_config_settings_and_bindings_are_checked(project):
    trainer = trainer_of(project, "trainer_local_checks")
    data = project.root / "data" / "t" / "rows.h5"
    fast = trainer.fit.local({"lr": 0.5}, steps=3, data=data)  # an Input given as a file
    slow = trainer.fit.local(trainer.Params(lr=0.0001), steps=3, data=data)
    assert fast != slow
    with pytest.raises(ConfigError, match="job.params"):
        trainer.fit.local({"nope": 1}, steps=3, data=data)
    with pytest.raises(ConfigError, match="not a binding"):
        trainer.fit.local(steps=3, dataa=data)
    with pytest.raises(ConfigError, match="steps=0"):
        trainer.fit.local(steps=0, data=data)


def test_a_kept_run_directory_is_committed_with_save_model(project, tmp_path):
    trainer = trainer_of(project, "trainer_local_keep")
    run_dir = tmp_path / "try"
    result = trainer.fit.local(steps=20, run_dir=run_dir, data_root=project.root / "data")
    assert (run_dir / "output" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))[-1] \
        == "step-000000020"
    version = save_model(run_dir / "output", "t.model", message="tried locally", metrics=result, repo=project.root)
    m = load_model("t.model", version, repo=project.root)
    assert m.metrics == result and (m.path / "model.safetensors").read_bytes() == \
        (run_dir / "output" / "model.safetensors").read_bytes()
    assert "tried locally" in project.git("log", "-1", "--format=%B", version)
    with pytest.raises(ConfigError, match="not a folder holding"):
        save_model(tmp_path / "empty", "t.model", repo=project.root)
    with pytest.raises(ConfigError, match="not finite"):
        save_model(run_dir / "output", "t.model", metrics={"auc": float("nan")}, repo=project.root)
