"""The job plan reads its inputs' revisions and keeps no file open; the job opens them when it executes and
refuses a dataset replaced in between (its revision is part of the run key)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gwenlake_hpc.data import Catalog
from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.job.plan import PlanCache, dataset_facts, open_inputs


def write(catalog: Catalog, value: float) -> str:
    return catalog.write("g.rows", {"x": np.full((8, 2), value, dtype=np.float32)})


def test_facts_are_read_closed_and_shared_by_a_sweeps_tasks(tmp_path):
    catalog = Catalog(tmp_path)
    revision = write(catalog, 1.0)
    facts = dataset_facts(catalog, "g.rows")
    assert facts == {"name": "g.rows", "revision": revision, "rows": 8, "path": str(catalog.path("g.rows"))}
    cache = PlanCache()
    assert cache.dataset_facts(catalog, "g.rows") == facts
    new_revision = write(catalog, 2.0)  # replaced (a new inode): read again, not served from the cache
    assert new_revision != revision and cache.dataset_facts(catalog, "g.rows")["revision"] == new_revision


def test_inputs_are_opened_at_the_planned_revision_or_refused(tmp_path):
    catalog = Catalog(tmp_path)
    write(catalog, 1.0)
    plan = SimpleNamespace(dataset_facts={"data": dataset_facts(catalog, "g.rows")})
    opened = open_inputs(plan)
    assert opened["data"].revision == plan.dataset_facts["data"]["revision"] and opened["data"].rows == 8
    opened["data"].close()
    write(catalog, 2.0)
    with pytest.raises(ConfigError, match="dataset g.rows changed while the job started"):
        open_inputs(plan)


def test_the_launchers_nodes_and_tasks_per_node_do_not_change_the_run_key(project, monkeypatch):
    """A job resubmitted on fewer nodes (or tasks a node) resumes the same run: same key, same run directory."""
    from hydra import compose, initialize_config_dir

    from gwenlake_hpc.job.config import register
    from gwenlake_hpc.job.plan import plan

    monkeypatch.chdir(project.root)  # the target trainer.py and data/ are the project's
    register()
    job = ["+job=t", "job.target=trainer.py:fit_fsdp"]
    layouts = [["launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=1"],
               ["launcher=slurm", "launcher.nodes=1", "launcher.tasks_per_node=1"],
               ["launcher=slurm", "launcher.nodes=1", "launcher.tasks_per_node=4"],
               []]  # the local launcher
    with initialize_config_dir(config_dir=str(project.root / "conf"), version_base="1.3"):
        plans = [plan(compose("config", overrides=job + layout)) for layout in layouts]
        other = plan(compose("config", overrides=job + ["job.params.lr=0.02"] + layouts[0]))
    assert [p.cfg.launcher.get("nodes") for p in plans] == [2, 1, 1, None]  # the layouts did differ
    assert len({p.key for p in plans}) == 1 and len({p.run_dir for p in plans}) == 1, [p.key for p in plans]
    assert plans[0].key.startswith("fit_fsdp-")
    assert other.key != plans[0].key  # a hyperparameter does change it: the key is not constant


def _decorated(eval_every):
    """A stand-in for a decorated function: what :func:`_effective` reads of it."""
    return SimpleNamespace(defaults={"steps": 10, "eval_every": eval_every, "seed": 0, "tracking": False},
                           target="m:f", run_name="f", is_short=False)


@pytest.mark.parametrize("given, expected", [("auto", "auto"), (500, 500)])
def test_the_decorator_s_eval_every_reaches_the_job_auto_included(given, expected):
    """``@train(eval_every="auto")`` is what ``job.eval_every=auto`` is; the config's value wins over it."""
    from gwenlake_hpc.job.config import JobConfig
    from gwenlake_hpc.job.plan import _effective

    tf = _decorated(given)
    assert _effective(JobConfig(target="m:f"), tf).eval_every == expected
    assert _effective(JobConfig(target="m:f", eval_every=7), tf).eval_every == 7


def test_a_decorator_eval_every_that_is_neither_a_number_nor_auto_is_refused_naming_the_setting():
    from gwenlake_hpc.job.config import JobConfig
    from gwenlake_hpc.job.plan import _effective

    tf = _decorated("often")
    with pytest.raises(ConfigError, match="job.eval_every.*auto"):
        _effective(JobConfig(target="m:f"), tf)
