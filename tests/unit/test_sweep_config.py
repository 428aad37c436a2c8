"""Sweep tasks derived from the first task's config: the same config Hydra composes, or Hydra composes it."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from gwenlake_hpc.job.config import register
from hydra_plugins.gwenlake_launcher.gwenlake_launcher import derive_task_config


def plain(cfg):
    out = OmegaConf.to_container(cfg, resolve=False)
    out.pop("hydra", None)
    return out


def test_value_changes_are_derived_and_equal_to_hydras_composition(project):
    register()
    with initialize_config_dir(config_dir=str(project.root / "conf"), version_base="1.3"):
        base_ov = ["+job=t", "launcher=slurm", "job.params.lr=0.01", "job.steps=20"]
        base = compose("config", overrides=base_ov, return_hydra_config=True)
        for ov in (["+job=t", "launcher=slurm", "job.params.lr=0.02", "job.steps=30"],
                   ["+job=t", "launcher=slurm", "job.params.lr=0.01", "job.steps=null"],
                   ["+job=t", "launcher=slurm", "job.params.lr='1e-3'", "job.steps=20"],
                   ["+job=t", "launcher=slurm", "job.params.lr=1e-3", "job.steps=+7"],
                   ["+job=t", "launcher=slurm", "job.params.lr=inf", "job.steps=20"],
                   ["+job=t", "launcher=slurm", "job.params.lr=abc-d", "job.steps=20"],
                   ["+job=t", "launcher=slurm", "job.params.lr=true", "job.steps=20"],
                   ["+job=t", "launcher=slurm", "job.params.lr=[1,2]", "job.steps=20"]):
            derived = derive_task_config(base, base_ov, ov)
            assert derived is not None, ov
            assert plain(derived) == plain(compose("config", overrides=ov, return_hydra_config=True)), ov
            assert "hydra" not in derived  # the job never reads it
        assert base.job.steps == 20 and base.job.params.lr == 0.01  # the base is not changed
        # Hydra composes these: a config group, another set of keys, an added key, a value the schema refuses.
        for ov in (["+job=t", "launcher=local", "job.params.lr=0.02", "job.steps=20"],
                   ["+job=t", "launcher=slurm", "job.params.lr=0.02"],
                   ["+job=t", "launcher=slurm", "job.params.lr=0.02", "job.steps=20", "+job.params.x=1"],
                   ["+job=t", "launcher=slurm", "job.params.lr=0.01", "job.steps=many"]):
            assert derive_task_config(base, base_ov, ov) is None, ov
