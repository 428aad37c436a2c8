"""The main job on the real Telco data: held-out ROC AUC against a logistic-regression baseline."""

from __future__ import annotations

import json

import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from helpers.project import make_churn_project
from gwenlake_hpc.data import Catalog


@pytest.mark.slow
def test_churn_job_matches_logistic_regression(tmp_path):
    project = make_churn_project(tmp_path / "churn")
    proc = project.run("+job=churn", check=0, timeout=900)
    version = proc.stdout.strip().splitlines()[-1].split()[-1]
    metrics = json.loads(project.git("show", f"{version}:crm/churn/metrics.json"))

    catalog = Catalog(project.root / "data")
    train, test = catalog.open("crm.churn-train"), catalog.open("crm.churn-test")
    assert (train.rows, test.rows) == (5634, 1409)  # 7,043 customers, 20 % held out, stratified
    tr, te = train.read(["features", "churn"]), test.read(["features", "churn"])
    baseline = LogisticRegression(max_iter=2000).fit(tr["features"], tr["churn"])
    base_auc = roc_auc_score(te["churn"], baseline.predict_proba(te["features"])[:, 1])
    print(f"MLP test_auc {metrics['test_auc']:.4f}, logistic regression {base_auc:.4f}")
    assert 0.80 < base_auc < 0.90
    assert metrics["test_auc"] >= 0.82
    assert metrics["test_auc"] >= base_auc - 0.01

    lineage = json.loads(project.git("show", f"{version}:crm/churn/lineage.json"))
    assert lineage["datasets"]["training_set"]["revision"] == train.revision
    assert lineage["config"]["params"]["hidden"] == 32
    files = project.git("ls-tree", "-r", "--name-only", version, "crm/churn").splitlines()
    assert set(files) == {"crm/churn/model.safetensors", "crm/churn/model.json", "crm/churn/metrics.json",
                          "crm/churn/lineage.json"}
