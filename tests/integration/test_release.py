"""The release gate and `models promote / rollback / list / show`, driven through the command line, with a real
MLflow server mirroring the aliases; and the issue's "done when" on the churn example."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from mlflow import MlflowClient
from sklearn.metrics import roc_auc_score

from helpers.mlflow_server import mlflow_server_fixture
from helpers.project import make_churn_project
from gwenlake_hpc.data import Catalog
from gwenlake_hpc.stores.registry import alias_history, current_aliases, load_model
from helpers.release_project import make_scorer_project, train


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from mlflow_server_fixture(tmp_path_factory)


@pytest.mark.slow
def test_promote_passes_refuses_worse_and_schema_change_then_rollback(tmp_path, server):
    p = make_scorer_project(tmp_path / "project")
    uri = f"tracking.uri={server.uri}"
    worse, _ = train(p, "scorer:fit", uri, "+job.params.noise=1.5")
    better, _ = train(p, "scorer:fit", uri, "+job.params.noise=0.0")
    wide, _ = train(p, "scorer:fit_wide", uri)
    client = MlflowClient(server.uri, registry_uri=server.uri)

    def mv_of(sha):
        return next(v.version for v in client.search_model_versions("name='t.scorer'")
                    if v.tags["gwenlake.version"] == sha)

    def promote(sha, *extra):
        return p.run("models", "promote", "t.scorer", "--version", sha[:10], "--alias", "champion",
                     "--tracking-uri", server.uri, *extra)

    test = Catalog(p.root / "data").open("t.cls-test").read(["x", "label"])
    auc = {sha: roc_auc_score(test["label"], test["x"].astype(np.float64) @ np.load(
        load_model("t.scorer", sha, repo=p.root).path / "w.npy")) for sha in (worse, better)}
    print(f"test AUC better {auc[better]:.4f}, worse {auc[worse]:.4f}")
    assert auc[better] > auc[worse] + 0.01

    first = promote(worse, "--reason", "first release")
    print(first.stdout)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "PASS  metric   no incumbent; roc_auc " + f"{auc[worse]:.4f}" in first.stdout
    assert "PASS  latency" in first.stdout and "promoted: alias champion" in first.stdout

    second = promote(better)
    print(second.stdout)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"PASS  metric   roc_auc {auc[better]:.4f} vs incumbent {auc[worse]:.4f}" in second.stdout
    assert current_aliases("t.scorer", p.root)["champion"] == better
    assert client.get_model_version_by_alias("t.scorer", "champion").version == mv_of(better)

    refused = promote(worse)
    print(refused.stdout)
    assert refused.returncode == 1
    assert f"FAIL  metric   roc_auc {auc[worse]:.4f} vs incumbent {auc[better]:.4f}" in refused.stdout
    assert "FAIL  slices" in refused.stdout and "REGRESSED" in refused.stdout
    assert f"alias champion stays at {better}" in refused.stdout
    assert current_aliases("t.scorer", p.root)["champion"] == better

    schema = promote(wide)
    print(schema.stdout)
    assert schema.returncode == 1
    assert "FAIL  schema   inputs {xw: <f4 [5]} differ from the incumbent's {x: <f4 [4]}" in schema.stdout
    assert current_aliases("t.scorer", p.root)["champion"] == better

    back = p.run("models", "rollback", "t.scorer", "--alias", "champion", "--tracking-uri", server.uri,
                 "--reason", "incident 42", check=0)
    assert f"{better} -> {worse} (rolled back)" in back.stdout
    assert current_aliases("t.scorer", p.root)["champion"] == worse
    assert client.get_model_version_by_alias("t.scorer", "champion").version == mv_of(worse)
    last = alias_history("t.scorer", p.root)[-1]
    assert (last["alias"], last["action"], last["previous"], last["version"], last["reason"]) == \
        ("champion", "rollback", better, worse, "incident 42")
    again = p.run("models", "rollback", "t.scorer", "--alias", "champion")
    assert again.returncode == 2 and "no previous version" in again.stderr

    listed = p.run("models", "list", "t.scorer", "--history", check=0).stdout
    print(listed)
    assert re.search(rf"{worse}  \S+  \[champion\]", listed)
    assert re.search(rf"{wide}  \S+  \[candidate\]", listed)
    assert "champion: " + better[:12] + " -> " + worse[:12] + "  rollback by " in listed


@pytest.mark.slow
def test_gate_refuses_unloadable_versions_and_reports_config_errors(tmp_path):
    p = make_scorer_project(tmp_path / "project")
    (tmp_path / "hand").mkdir()
    np.save(tmp_path / "hand" / "w.npy", np.ones(4, dtype=np.float32))
    out = p.run("models", "commit", str(tmp_path / "hand"), "t.scorer", check=0).stdout
    hand = out.split()[-1]
    res = p.run("models", "promote", "t.scorer", "--version", hand)
    assert res.returncode == 1
    assert "FAIL  files    not loadable: missing files ['metrics.json', 'lineage.json']" in res.stdout
    assert "champion" not in current_aliases("t.scorer", p.root)

    good, _ = train(p, "scorer:fit", "job.tracking=false")
    slow = tmp_path / "slow.yaml"
    slow.write_text((p.root / "conf" / "release" / "scorer.yaml").read_text()
                    .replace("latency_budget_ms: 500", "latency_budget_ms: 0.000001"))
    res = p.run("models", "promote", "t.scorer", "--version", good, "--config", str(slow))
    assert res.returncode == 1 and re.search(r"FAIL  latency  median [0-9.]+ ms for 64 rows, budget 1e-06 ms",
                                             res.stdout), res.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: t.scorer\nmetric: roc_auc\ntest_dataset: t.cls-test\nlabel: label\nmargn: 0.1\n")
    res = p.run("models", "promote", "t.scorer", "--version", good, "--config", str(bad))
    assert res.returncode == 2 and "margn" in res.stderr, res.stderr
    bad.write_text("model: t.scorer\nmetric: f1\ntest_dataset: t.cls-test\nlabel: label\n")
    res = p.run("models", "promote", "t.scorer", "--version", good, "--config", str(bad))
    assert res.returncode == 2 and "metric='f1'" in res.stderr and "roc_auc" in res.stderr
    (p.root / "conf" / "release" / "scorer.yaml").unlink()
    res = p.run("models", "promote", "t.scorer", "--version", good)
    assert res.returncode == 2 and "no release config for t.scorer" in res.stderr
    res = p.run("models", "promote", "t.scorer", "--version", "zzz", "--config", str(slow))
    assert res.returncode == 2 and "give a commit SHA" in res.stderr


@pytest.mark.slow
def test_done_when_churn_trained_twice_listed_loaded_promoted_refused_rolled_back(tmp_path):
    p = make_churn_project(tmp_path / "churn")

    def version_of(proc):
        return proc.stdout.strip().splitlines()[-1].split()[-1]

    worse = version_of(p.run("+job=churn", "job.steps=20", "job.params.lr=0.0003", check=0, timeout=600))
    better = version_of(p.run("+job=churn", check=0, timeout=600))
    m = {v: json.loads(p.git("show", f"{v}:crm/churn/metrics.json"))["test_auc"] for v in (worse, better)}
    print(f"churn test_auc: 20 steps {m[worse]:.4f}, 3000 steps {m[better]:.4f}")
    assert m[better] > m[worse] + 0.002

    listed = p.run("models", "list", "crm.churn", check=0).stdout
    assert f"{better}  " in listed and f"{worse}  " in listed and f"test_auc={m[better]:.4f}" in listed
    shown = p.run("models", "show", "crm.churn", worse[:12], check=0).stdout
    assert f"version {worse}" in shown and "model.safetensors" in shown

    steps = []
    for sha, code in ((worse, 0), (better, 0), (worse, 1)):
        res = p.run("models", "promote", "crm.churn", "--version", sha, "--alias", "champion")
        steps.append(res.stdout)
        print(res.stdout)
        assert res.returncode == code, res.stdout + res.stderr
    # the gate scores both versions itself: its AUCs equal the ones the trainings computed
    assert f"PASS  metric   roc_auc {m[better]:.4f} vs incumbent {m[worse]:.4f}" in steps[1]
    assert f"FAIL  metric   roc_auc {m[worse]:.4f} vs incumbent {m[better]:.4f}" in steps[2]
    champion = p.run("models", "show", "crm.churn", "--alias", "champion", check=0)
    assert f"version {better}" in champion.stdout and f"alias champion of crm.churn resolved to version {better}" \
        in champion.stdout + champion.stderr

    back = p.run("models", "rollback", "crm.churn", "--alias", "champion", check=0)
    assert f"{better} -> {worse} (rolled back)" in back.stdout
    listed = p.run("models", "list", "crm.churn", "--history", check=0).stdout
    print(listed)
    assert re.search(rf"{worse}  \S+  \[champion\]", listed)


@pytest.mark.slow
def test_promote_from_a_run_its_own_version_or_its_best_checkpoint_through_the_gate(tmp_path, monkeypatch, capsys):
    from gwenlake_hpc.stores.checkpoints import CheckpointStore

    p = make_scorer_project(tmp_path / "project")
    own, _ = train(p, "scorer:fit_ckpt")
    run_dir = next((p.root / "runs" / "t.scorer").iterdir())
    key, run_id = run_dir.name, (run_dir / "tracking" / "run_id").read_text().strip()

    first = p.run("models", "promote", "t.scorer", "--from-run", key, "--alias", "champion")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"run {key}: its own version {own}" in first.stdout and current_aliases("t.scorer", p.root)["champion"] == own

    recorded = {ck.step: ck.metrics["train_auc"] for ck in CheckpointStore(run_dir / "checkpoints", key).complete()}
    worst = min(recorded, key=lambda s: (recorded[s], s))
    picked = p.run("models", "promote", "t.scorer", "--from-run", run_id, "--criterion", "min:train_auc",
                   "--alias", "staging")
    assert picked.returncode == 0, picked.stdout + picked.stderr
    assert f"checkpoint step {worst} has the min train_auc" in picked.stdout
    version = re.search(r"as t.scorer version ([0-9a-f]{40})", picked.stdout).group(1)
    assert version != own and current_aliases("t.scorer", p.root)["staging"] == version
    m = load_model("t.scorer", version, repo=p.root)
    assert m.metrics == {"train_auc": recorded[worst]}
    assert m.lineage["from_checkpoint"]["step"] == worst and m.lineage["run_key"] == key
    assert m.lineage["serving"]["predict"] == "scorer:predict"  # carried over: the gate could score it
    assert np.array_equal(np.load(m.path / "w.npy"), np.load(run_dir / "checkpoints" / f"step-{worst:09d}" / "w.npy"))
    assert not (m.path / "MANIFEST.json").exists() and not (m.path / "gwenlake-run-state.json").exists()

    again = p.run("models", "promote", "t.scorer", "--from-run", key, "--criterion", "min:train_auc",
                  "--alias", "staging", check=0)
    assert f"is version {version} already" in again.stdout and "already holds alias staging" in again.stdout
    from gwenlake_hpc.stores.versioning import list_versions

    assert len(list_versions(p.root, "t.scorer")) == 2  # no second commit of that checkpoint

    # Bad input, in this process (the command line's own function): exit 2, the reason, nothing committed.
    from gwenlake_hpc.cli.dispatch import run_subcommand

    monkeypatch.chdir(p.root)
    for args, needle in ((["--from-run", key, "--criterion", "max:nope"], "recorded: train_auc"),
                         (["--from-run", "nope"], "no run of t.scorer"),
                         (["--version", own, "--criterion", "max:train_auc"], "give --from-run"),
                         (["--from-run", key, "--criterion", "best"], "use max:METRIC or min:METRIC"),
                         (["--from-run", key, "--criterion", "min:train_auc", "--alias", "a b"], "alias 'a b'")):
        code = run_subcommand(["models", "promote", "t.scorer", *args] + ([] if "--alias" in args else ["--alias", "x"]))
        assert code == 2 and needle in capsys.readouterr().err, args
    assert len(list_versions(p.root, "t.scorer")) == 2
