"""Customer churn (the IBM Telco data of examples/churn.py) trained by a Lightning ``Trainer``.

    python -m gwenlake_hpc +job=lightning_churn

The Trainer's loop is the job's loop through ``gwenlake_hpc.integrations.lightning.fit_trainer``: an eviction
ends it after a sealed checkpoint (exit 75), the next start resumes from it, ``self.log`` goes to the job's MLflow
run and the module's weights are the version. Returns the held-out ROC AUC as ``test_auc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.integrations.lightning import fit_trainer, save_model

from .churn import ChurnParams, make_model
from .churn_data import materialise


@dataclass
class LightningChurnParams(ChurnParams):
    """Hyperparameters (``job.params`` in conf/job/lightning_churn.yaml): churn.py's, and the Trainer's."""

    accumulate_grad_batches: int = 1


class ChurnModule(L.LightningModule):
    """churn.py's MLP as a LightningModule: features float32 [batch, n_features] -> churn logit [batch]."""

    def __init__(self, n_features: int, hidden: int, dropout: float, lr: float, weight_decay: float):
        super().__init__()
        self.save_hyperparameters()
        self.model = make_model(n_features, ChurnParams(hidden=hidden, dropout=dropout))
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)

    def training_step(self, batch, batch_idx):
        features, churn = batch
        loss = self.loss_fn(self(features), churn)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class EpochShuffle(torch.utils.data.Sampler):
    """A permutation of ``range(n)`` drawn from ``seed + epoch`` alone (Lightning calls ``set_epoch``), so a
    resumed run shuffles each epoch as the uninterrupted run did, whatever it read before; Lightning splits it
    across ranks (``DistributedSamplerWrapper``) where there are several."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


def loader(dataset, batch_size: int, seed: int, shuffle: bool) -> StatefulDataLoader:
    """The whole dataset in memory (7,043 customers at most) as (features float32 [b, 40], churn float32 [b]).

    A ``StatefulDataLoader`` (torchdata; a DataLoader with ``state_dict``): Lightning saves its position in the
    checkpoint, so a resumed run goes on with the batch after the checkpoint's (a plain DataLoader would start
    its epoch again: Lightning's warning "your dataloader is not resumable"); :class:`EpochShuffle` makes each
    epoch's order a function of the seed and the epoch."""
    cols = dataset.read(["features", "churn"])
    tensors = torch.utils.data.TensorDataset(torch.as_tensor(cols["features"]),
                                             torch.as_tensor(cols["churn"], dtype=torch.float32))
    return StatefulDataLoader(tensors, batch_size=batch_size,
                              sampler=EpochShuffle(len(tensors), seed) if shuffle else None)


@torch.no_grad()
def test_auc(module: ChurnModule, dataset) -> float:
    """ROC AUC of ``module`` over the whole dataset."""
    module.eval()
    scores, labels = [], []
    for features, churn in loader(dataset, 2048, 0, shuffle=False):
        scores.append(torch.sigmoid(module(features)).numpy())
        labels.append(churn.numpy())
    return float(roc_auc_score(np.concatenate(labels), np.concatenate(scores)))


@train(training_set=Input("crm.churn-train"), test_set=Input("crm.churn-test"),
       output=Output("crm.churn-lightning"), steps=600, eval_every=100, prepare=materialise)
def fit(training_set, test_set, output, run, config: LightningChurnParams):
    torch.manual_seed(run.seed)
    module = ChurnModule(training_set.schema["features"][1][0], config.hidden, config.dropout, config.lr,
                         config.weight_decay)
    trainer = L.Trainer(accelerator="auto", devices=1, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, accumulate_grad_batches=config.accumulate_grad_batches)
    fit_trainer(trainer, module, run, keep=2,
                train_dataloaders=loader(training_set, config.batch_size, run.seed, shuffle=True))
    if run.evicted:
        return None
    save_model(module, output)
    return {"test_auc": test_auc(module, test_set)}
