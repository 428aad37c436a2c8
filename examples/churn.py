"""Customer churn: a small PyTorch MLP on the IBM Telco data.

    python -m gwenlake_hpc +job=churn

Checkpoints model and optimizer state at each evaluation; returns the held-out ROC AUC as ``test_auc``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from gwenlake_hpc import Input, Output, default_device, load_state, save_state, train

from .churn_data import materialise


@dataclass
class ChurnParams:
    """Hyperparameters (``job.params`` in conf/job/churn.yaml)."""

    batch_size: int = 128
    hidden: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-4
    dropout: float = 0.1


def make_model(n_features: int, p: ChurnParams) -> nn.Module:
    """MLP: features [batch, n_features] float32 -> churn logit [batch]."""
    return nn.Sequential(nn.Linear(n_features, p.hidden), nn.ReLU(), nn.Dropout(p.dropout),
                         nn.Linear(p.hidden, 1), nn.Flatten(0))


@torch.no_grad()
def evaluate(model: nn.Module, dataset, device: torch.device) -> float:
    """ROC AUC of ``model`` over a whole dataset, streamed in order."""
    model.eval()
    scores, labels = [], []
    for batch in dataset.batches(2048, shuffle=False, columns=["features", "churn"]):
        scores.append(torch.sigmoid(model(batch["features"].to(device))).cpu().numpy())
        labels.append(batch["churn"].numpy())
    return float(roc_auc_score(np.concatenate(labels), np.concatenate(scores)))


@functools.lru_cache(maxsize=8)
def _load(model_dir: str) -> nn.Module:
    spec = json.loads((Path(model_dir) / "model.json").read_text())
    model = make_model(spec["n_features"], ChurnParams(hidden=spec["hidden"], dropout=spec["dropout"]))
    load_state(Path(model_dir) / "model.safetensors", model=model)
    return model.eval()


@torch.no_grad()
def predict(model_dir, batch) -> np.ndarray:
    """Churn probabilities of a batch: ``batch["features"]`` float32 [n, 40] -> float32 [n].

    The predict entry point of crm.churn versions (``gwenlake_hpc.load_model``, the release gate): runs on the
    CPU, the model of ``model_dir`` loaded once per process.
    """
    return torch.sigmoid(_load(str(model_dir))(torch.as_tensor(batch["features"]))).numpy()


@train(training_set=Input("crm.churn-train"), test_set=Input("crm.churn-test"),
       output=Output("crm.churn", predict="examples.churn:predict", inputs=["features"]),
       steps=3000, eval_every=500, prepare=materialise)
def fit(training_set, test_set, output, run, config: ChurnParams):
    device = default_device()
    n_features = training_set.schema["features"][1][0]
    model = make_model(n_features, config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    loss_fn = nn.BCEWithLogitsLoss()
    model_spec = json.dumps({
        "architecture": "mlp", "n_features": n_features, "hidden": config.hidden, "dropout": config.dropout,
        "feature_names": json.loads(training_set.attrs.get("feature_names", "[]")),
        "inputs": {"features": "float32 [batch, %d]" % n_features}, "output": "churn logit float32 [batch]",
    }, indent=2)

    for step, batch in run.steps(training_set.batches(config.batch_size, columns=["features", "churn"])):
        model.train()
        loss = loss_fn(model(batch["features"].to(device)), batch["churn"].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        if run.at_eval:
            with run.checkpoint(keep=3) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
                # The files a version holds, too: any checkpoint can be promoted (`models promote --from-run`).
                save_state(ck.path("model.safetensors"), model=model)
                ck.path("model.json").write_text(model_spec)
                if not run.stopping:  # skip a costly eval when evicted
                    ck.metrics = {"test_auc": evaluate(model, test_set, device)}

    if run.evicted:
        return None
    auc = evaluate(model, test_set, device)
    save_state(output.file("model.safetensors"), model=model)
    output.file("model.json").write_text(model_spec)
    return {"test_auc": auc}
