"""A Lightning training of 2 gloo ranks under ``ModelParallelStrategy`` (FSDP2 in ``configure_model``) with what
most Lightning code uses: a plain ``DataLoader(shuffle=True)``, a validation every 5 steps and the user's own
``ModelCheckpoint(monitor="val_loss", save_top_k=2, dirpath=...)`` (issue 41's reported inputs).

Hooks: GWL_TEST_SIGTERM_AT=k: every rank sends itself SIGTERM during step k (from on_train_batch_start);
GWL_TEST_PL_BEST=dir: the ModelCheckpoint's dirpath (default: none, no ModelCheckpoint);
GWL_TEST_PL_STRATEGY=single: one process, no strategy (the plain RandomSampler path);
GWL_TEST_PL_WORKERS=n: the loaders' num_workers.

Job config: conf/job/plmp.yaml (written by tests/integration/test_integrations_lightning_strategies.py).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.integrations.lightning import fit_trainer, save_model


@dataclass
class Params:
    batch_size: int = 8
    lr: float = 0.05
    hidden: int = 16


class Tiny(L.LightningModule):
    """x float32 [b, 4] -> y float32 [b]; dropout (the RNG is restored at a resume); FSDP2 over the data-parallel
    mesh where the strategy gives one."""

    def __init__(self, hidden: int, lr: float):
        super().__init__()
        self.lr = lr
        self.model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))

    def configure_model(self):
        mesh = getattr(self, "device_mesh", None)
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def forward(self, x):
        return self.model(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _Sigterm(L.Callback):
    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@train(data=Input("t.rows"), output=Output("t.model"), steps=40, eval_every=10)
def fit(data, output, run, config: Params):
    torch.manual_seed(1234)
    cols = data.read(["x", "y"])
    rows = TensorDataset(torch.as_tensor(cols["x"]), torch.as_tensor(cols["y"]))
    workers = int(os.environ.get("GWL_TEST_PL_WORKERS", "0"))
    train_loader = DataLoader(rows, batch_size=config.batch_size, shuffle=True, num_workers=workers)
    val_loader = DataLoader(TensorDataset(rows.tensors[0][:64], rows.tensors[1][:64]), batch_size=32)
    callbacks = [_Sigterm(int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1")))]
    if os.environ.get("GWL_TEST_PL_BEST"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(monitor="val_loss", save_top_k=2, mode="min",
                                         dirpath=os.environ["GWL_TEST_PL_BEST"], filename="{step}-{val_loss:.5f}"))
    if os.environ.get("GWL_TEST_PL_STRATEGY") == "single":
        kwargs = {"devices": 1}
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        kwargs = {"devices": run.world_size, "strategy": ModelParallelStrategy()}
    trainer = L.Trainer(accelerator="cpu", log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=5, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, callbacks=callbacks, **kwargs)
    module = Tiny(config.hidden, config.lr)
    fit_trainer(trainer, module, run, keep=2, train_dataloaders=train_loader, val_dataloaders=val_loader)
    if run.evicted:
        return None
    save_model(module, output)
    return {"final_loss": float(trainer.callback_metrics["loss"])}
