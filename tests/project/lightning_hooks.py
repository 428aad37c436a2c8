"""examples/lightning_churn.py's training with the tests' hooks (real signals, sent by the process to itself):

  GWL_TEST_SIGTERM_AT=k      SIGTERM during step k (from the Trainer's on_train_batch_start)
  GWL_TEST_SIGKILL_AT=k      SIGKILL as step k begins (on_train_batch_start: steps up to k-1 done, their
                             checkpoints sealed where the checkpoint is synchronous)
  GWL_TEST_SIGKILL_IN_SAVE=k SIGKILL in the middle of step k's ``trainer.save_checkpoint``: half the file written,
                             the block not sealed
  GWL_TEST_PL=json           extras: {"logger": "mlflow" | "mlflow_default" | "wandb" | "csv", "csv_dir": path},
                             {"slurm_requeue": true},
                             {"model_checkpoint": {...ModelCheckpoint kwargs}}

Job config: conf/job/pl_t.yaml (written by tests/integration/test_integrations_lightning.py).
"""

from __future__ import annotations

import json
import os
import signal

import lightning as L
import torch

from examples.churn_data import materialise
from examples.lightning_churn import ChurnModule, LightningChurnParams, loader, test_auc
from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.integrations.lightning import fit_trainer, save_model


class _Signals(L.Callback):
    def __init__(self, sigterm_at: int, sigkill_at: int):
        self.sigterm_at, self.sigkill_at = sigterm_at, sigkill_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.sigkill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step + 1 == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _kill_in_the_save(trainer: L.Trainer, step: int) -> None:
    real = trainer.save_checkpoint

    def save_checkpoint(path, *args, **kwargs):
        if trainer.global_step == step:
            real(path, *args, **kwargs)
            with open(path, "r+b") as f:  # half the file on disk, as a kill in the middle of the write leaves it
                f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)

    trainer.save_checkpoint = save_checkpoint


def _trainer(config: LightningChurnParams, extras: dict) -> L.Trainer:
    kwargs = {}
    if extras.get("logger") == "mlflow":
        from lightning.pytorch.loggers import MLFlowLogger
        import mlflow
        kwargs["logger"] = MLFlowLogger(experiment_name="mine", tracking_uri=mlflow.get_tracking_uri())
    elif extras.get("logger") == "mlflow_default":  # no tracking_uri: ./mlruns, which MLflow refuses
        from lightning.pytorch.loggers import MLFlowLogger
        kwargs["logger"] = MLFlowLogger()
    elif extras.get("logger") == "csv":
        from lightning.pytorch.loggers import CSVLogger
        kwargs["logger"] = CSVLogger(extras["csv_dir"])
    elif extras.get("logger") == "wandb":
        from lightning.pytorch.loggers import WandbLogger
        kwargs["logger"] = WandbLogger(project="mine", offline=True)
    if extras.get("slurm_requeue"):
        from lightning.pytorch.plugins.environments import SLURMEnvironment
        kwargs["plugins"] = [SLURMEnvironment(auto_requeue=True)]
    callbacks = [_Signals(int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1")),
                          int(os.environ.get("GWL_TEST_SIGKILL_AT", "-1")))]
    if "model_checkpoint" in extras:
        from lightning.pytorch.callbacks import ModelCheckpoint
        callbacks.append(ModelCheckpoint(**extras["model_checkpoint"]))
    return L.Trainer(accelerator="cpu", devices=1, log_every_n_steps=1, enable_progress_bar=False,
                     enable_model_summary=False, accumulate_grad_batches=config.accumulate_grad_batches,
                     callbacks=callbacks, **kwargs)


@train(training_set=Input("crm.churn-train"), test_set=Input("crm.churn-test"),
       output=Output("crm.churn-lightning"), steps=600, eval_every=100, prepare=materialise)
def fit(training_set, test_set, output, run, config: LightningChurnParams):
    extras = json.loads(os.environ.get("GWL_TEST_PL", "{}"))
    torch.manual_seed(run.seed)
    module = ChurnModule(training_set.schema["features"][1][0], config.hidden, config.dropout, config.lr,
                         config.weight_decay)
    trainer = _trainer(config, extras)
    kill_at = int(os.environ.get("GWL_TEST_SIGKILL_IN_SAVE", "-1"))
    if kill_at > 0:
        _kill_in_the_save(trainer, kill_at)
    fit_trainer(trainer, module, run, keep=2,
                train_dataloaders=loader(training_set, config.batch_size, run.seed, shuffle=True))
    if run.evicted:
        return None
    save_model(module, output)
    return {"test_auc": test_auc(module, test_set)}
