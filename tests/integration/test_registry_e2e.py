"""Registration in a real MLflow Model Registry (PostgreSQL-backed `mlflow server` when available), aliases,
load_model by SHA and alias, Model(alias=...) bindings, lineage.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from helpers.concurrency import run_concurrently
from helpers.mlflow_server import mlflow_server_fixture
from gwenlake_hpc.data import Catalog
from gwenlake_hpc.base.errors import ConfigError, GwenlakeError
from gwenlake_hpc.stores.registry import alias_history, current_aliases, load_model, move_alias, rollback_target
from gwenlake_hpc.stores.versioning import list_versions
from helpers.release_project import make_scorer_project, train

pytestmark = pytest.mark.slow  # real jobs and MLflow stores: the integration tier


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from mlflow_server_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    return make_scorer_project(tmp_path_factory.mktemp("reg") / "project")


def test_training_registers_a_model_version_with_run_artifacts_and_candidate_alias(scorer, server):
    sha, err = train(scorer, "scorer:fit", f"tracking.uri={server.uri}", "+job.params.noise=0.3",
                     env={"SLURM_JOB_ID": "4242"})
    client = MlflowClient(server.uri, registry_uri=server.uri)
    versions = client.search_model_versions("name='t.scorer'")
    mv = next(v for v in versions if v.tags.get("gwenlake.version") == sha)
    lineage = json.loads(scorer.git("show", f"{sha}:t/scorer/lineage.json"))
    run_id = lineage["tracking"]["run_id"]
    # MLflow's convention: the source is the folder of this version's own files (a run extended later logs its
    # next version beside it, under model/<its sha>), so the source alone gives back exactly this version
    assert mv.source == f"runs:/{run_id}/model/{sha}" and mv.run_id == run_id
    import mlflow.artifacts

    fetched = Path(mlflow.artifacts.download_artifacts(mv.source, dst_path=str(scorer.root / "runs" / "src"),
                                                       tracking_uri=server.uri))
    assert sorted(p.name for p in fetched.iterdir()) == ["lineage.json", "metrics.json", "w.npy"]
    committed = json.loads(scorer.git("show", f"{sha}:t/scorer/metrics.json"))
    assert json.loads((fetched / "metrics.json").read_text()) == committed
    revision = Catalog(scorer.root / "data").open("t.cls-train").revision
    assert mv.tags["gwenlake.dataset.data"] == f"t.cls-train@{revision}"
    assert mv.tags["gwenlake.code_commit"] == scorer.git("rev-parse", "main")
    assert sorted(a.path for a in client.list_artifacts(run_id, f"model/{sha}")) == [
        f"model/{sha}/lineage.json", f"model/{sha}/metrics.json", f"model/{sha}/w.npy"]
    local = client.download_artifacts(run_id, f"model/{sha}/w.npy", str(scorer.root / "runs"))
    np.testing.assert_array_equal(np.load(local), np.load(load_model("t.scorer", sha, repo=scorer.root).path / "w.npy"))
    assert client.get_model_version_by_alias("t.scorer", "candidate").version == mv.version
    assert current_aliases("t.scorer", scorer.root) == {"candidate": sha}

    # lineage answers: datasets and revisions, code, config, tracking run, SLURM ids, packages, serving
    assert lineage["datasets"]["data"]["revision"] == revision
    assert lineage["config"]["params"] == {"noise": 0.3, "noise_seed": 0}
    assert lineage["job_config"]["target"] == "scorer:fit"
    assert lineage["slurm_jobs"] == ["4242"] and lineage["starts"][0]["SLURM_JOB_ID"] == "4242"
    assert {"python", "numpy", "mlflow", "gwenlake_hpc"} <= set(lineage["packages"])
    assert lineage["serving"] == {"predict": "scorer:predict", "dataset": f"t.cls-train@{revision}",
                                  "input_schema": {"x": {"dtype": "<f4", "shape": [4]}}}


def test_load_by_sha_and_by_alias_and_predict(scorer):
    sha, _ = train(scorer, "scorer:fit", "job.tracking=false", "+job.params.noise=0.5")  # no tracking at all
    assert current_aliases("t.scorer", scorer.root)["candidate"] == sha  # aliases work from git alone
    by_sha = load_model("t.scorer", sha[:12], repo=scorer.root)
    by_alias = load_model("t.scorer", alias="candidate", repo=scorer.root)
    assert by_sha.version == by_alias.version == sha and by_sha.path == by_alias.path
    w = np.load(by_sha.path / "w.npy")
    x = Catalog(scorer.root / "data").open("t.cls-test").read(["x"])["x"][:10]
    np.testing.assert_allclose(by_alias.predict({"x": x}), x.astype(np.float64) @ w)
    assert by_sha.metrics["train_auc"] > 0.5 and by_sha.lineage["tracking"] is None
    assert scorer.git("status", "--porcelain") == ""  # the work tree is untouched
    with pytest.raises(ConfigError, match="input column 'x' is <f8"):
        by_sha.predict({"x": x.astype(np.float64)})
    with pytest.raises(ConfigError, match="no alias 'nope'.*candidate"):
        load_model("t.scorer", alias="nope", repo=scorer.root)


def test_model_alias_binding_resolves_and_logs(scorer):
    versions = [v["version"] for v in list_versions(scorer.root, "t.scorer")]
    move_alias("t.scorer", "champion", versions[-1], repo=scorer.root, action="set", reason="test")
    sha, err = train(scorer, "scorer:tune", "job.tracking=false")
    assert f"Model('t.scorer', alias='champion') resolved to version {versions[-1]}" in err
    assert scorer.git("show", f"{sha}:t/tuned/from.txt") == versions[-1]
    lineage = json.loads(scorer.git("show", f"{sha}:t/tuned/lineage.json"))
    assert lineage["init_models"] == {"init": f"t.scorer@{versions[-1]}"}


def test_concurrent_alias_moves_all_recorded_and_rollback_walks_back(scorer):
    versions = [v["version"] for v in list_versions(scorer.root, "t.scorer")]
    before = len(alias_history("t.scorer", scorer.root))
    n = 10
    run_concurrently(n, lambda i: move_alias("t.scorer", f"a{i}", versions[i % len(versions)], repo=scorer.root))
    assert len(alias_history("t.scorer", scorer.root)) == before + n
    assert {f"a{i}" for i in range(n)} <= set(current_aliases("t.scorer", scorer.root))

    move_alias("t.scorer", "x", versions[0], repo=scorer.root, action="promote")
    move_alias("t.scorer", "x", versions[1], repo=scorer.root, action="promote")
    assert rollback_target("t.scorer", "x", scorer.root) == (versions[1], versions[0])
    move_alias("t.scorer", "x", versions[0], repo=scorer.root, action="rollback")
    # a move conditional on the alias's value (a promote gated against that incumbent) refuses a stale one
    before = len(alias_history("t.scorer", scorer.root))
    with pytest.raises(GwenlakeError, match="moved to"):
        move_alias("t.scorer", "x", versions[1], repo=scorer.root, action="promote", expected=versions[1])
    assert len(alias_history("t.scorer", scorer.root)) == before
    move_alias("t.scorer", "x", versions[1], repo=scorer.root, action="promote", expected=versions[0])
    move_alias("t.scorer", "x", versions[0], repo=scorer.root, action="rollback", expected=versions[1])
    with pytest.raises(ConfigError, match="no previous version"):
        rollback_target("t.scorer", "x", scorer.root)
    with pytest.raises(ConfigError, match="not a commit of the model repository"):
        move_alias("t.scorer", "x", "abcdef12", repo=scorer.root)
    with pytest.raises(ConfigError, match="not a version of t.scorer"):
        move_alias("t.scorer", "x", scorer.git("rev-parse", "main"), repo=scorer.root)
