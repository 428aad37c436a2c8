"""Customer churn as a short fit: gradient-boosted trees (scikit-learn's HistGradientBoosting) on the same IBM
Telco split as examples/churn.py, the data in memory as DataFrames, no loop.

    python -m gwenlake_hpc +job=churn_short

Versions of the same model, ``crm.churn``, as the MLP: ``models promote`` compares the two through the release
gate. The classifier is saved with joblib (a pickle: load versions from your own repository only).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import joblib
import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from gwenlake_hpc.transforms import Input, Output, train

from .churn_data import materialise


@dataclass
class ShortParams:
    """Hyperparameters (``job.params`` in conf/job/churn_short.yaml)."""

    max_iter: int = 300
    learning_rate: float = 0.03
    max_leaf_nodes: int = 15
    l2_regularization: float = 1.0
    random_state: int = 0


def _features(frame) -> np.ndarray:
    """float32 [rows, 40]: the ``features_<i>`` columns of a DataFrame, in order."""
    cols = sorted((c for c in frame.columns if c.startswith("features_")), key=lambda c: int(c.split("_")[1]))
    return frame[cols].to_numpy(np.float32)


@functools.lru_cache(maxsize=8)
def _load(model_dir: str) -> HistGradientBoostingClassifier:
    return joblib.load(Path(model_dir) / "model.joblib")


def predict(model_dir, batch) -> np.ndarray:
    """Churn probabilities of a batch: ``batch["features"]`` float32 [n, 40] -> float64 [n]."""
    return _load(str(model_dir)).predict_proba(np.asarray(batch["features"], dtype=np.float32))[:, 1]


@train(training_set=Input("crm.churn-train"), test_set=Input("crm.churn-test"),
       output=Output("crm.churn", predict="examples.churn_short:predict", inputs=["features"]),
       prepare=materialise)
def fit(training_set, test_set, output, config: ShortParams):
    clf = HistGradientBoostingClassifier(max_iter=config.max_iter, learning_rate=config.learning_rate,
                                         max_leaf_nodes=config.max_leaf_nodes,
                                         l2_regularization=config.l2_regularization,
                                         random_state=config.random_state)
    clf.fit(_features(training_set), training_set["churn"].to_numpy())
    auc = roc_auc_score(test_set["churn"].to_numpy(), clf.predict_proba(_features(test_set))[:, 1])
    joblib.dump(clf, output.file("model.joblib"))
    output.file("model.json").write_text(json.dumps({
        "architecture": "hist_gradient_boosting", "n_features": int(_features(test_set).shape[1]),
        "params": vars(config), "inputs": {"features": "float32 [batch, 40]"},
        "output": "churn probability float64 [batch]"}, indent=2))
    return {"test_auc": float(auc)}
