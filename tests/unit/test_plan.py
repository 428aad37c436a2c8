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
