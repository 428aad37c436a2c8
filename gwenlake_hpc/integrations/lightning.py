"""A Lightning ``Trainer`` inside an ordinary ``@train`` function: eviction, resume, one MLflow run.

    from gwenlake_hpc.integrations.lightning import fit_trainer, save_model

    @train(output=Output("crm.churn-lightning"), steps=600, eval_every=100)
    def fit(output, run, config):
        module = ChurnModule(...)
        trainer = lightning.Trainer(log_every_n_steps=1, enable_progress_bar=False)
        fit_trainer(trainer, module, run, train_dataloaders=loader, keep=2)
        if run.evicted:
            return None
        save_model(module, output)              # the version: committed and registered by the job

Responsibilities (:func:`fit_trainer` and its :class:`GwenlakeCallback`):

- the length: ``job.steps`` is the Trainer's ``max_steps`` (``job.epochs`` its ``max_epochs``); the Run's step is
  ``trainer.global_step`` (optimizer steps: with gradient accumulation a step ends every ``accumulate_grad_batches``
  batches), checked at every step;
- checkpoints: at the Run's ``at_eval`` steps (``job.eval_every``, the last step) and at a stop
  ``trainer.save_checkpoint`` writes ``lightning.ckpt`` (weights, optimizers, schedulers, loop progress, callbacks'
  states; a folder of every rank's shards under a distributed checkpoint, :mod:`.lightning_ckpt`) into a
  ``run.checkpoint()`` block: sealed, verified while loading, kept by ``keep=``, safe against a kill at any moment;
  ``ckpt_path`` is the Run's ``resume_path`` (the newest sealed one; a damaged one is set aside). A step Lightning
  validates after by its schedule is checkpointed after that validation;
- eviction: a stop request during optimizer step N ends the training after step N, its checkpoint sealed
  (``trainer.should_stop``), without a validation the schedule did not ask for; the job exits 75;
- data: a plain map-style ``DataLoader`` resumes in its order, the trained batches skipped unread
  (:mod:`.lightning_data`);
- the user's ``ModelCheckpoint`` is kept, its files mirrored as named checkpoints (:mod:`.lightning_ckpt`);
- signals: Lightning's own handlers (SIGTERM, which ends ``fit`` with ``SIGTERMException``, and the SLURM
  requeue signal of ``SLURMEnvironment(auto_requeue=True)``, which saves inside the handler and calls ``scontrol
  requeue``) are not installed: the job owns the signals and decides the requeue, as for any training; a warning
  says so where the Trainer was given ``SLURMEnvironment(auto_requeue=True)``;
- logging: ``self.log`` of the LightningModule goes to ``run.log`` at ``trainer.global_step`` (the job's MLflow
  run, one point per step across restarts, ``log_every_n_steps`` apart). Lightning's default logger and an
  ``MLFlowLogger`` are replaced by :class:`GwenlakeLogger` (the latter would start a run of its own at each
  requeue); other file loggers are kept.

Settings refused with exit 2 before training (:class:`~gwenlake_hpc.base.errors.ConfigError`, naming the setting
and the fix): the loggers of other trackers (``WandbLogger``, ``CometLogger``, ``NeptuneLogger``: a run of their
own at each requeue) and a plain ``DataLoader`` over an ``IterableDataset`` (no position to resume from).
"""

from __future__ import annotations

import copy
import logging
import os
import traceback
from argparse import Namespace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger
from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.fabric.utilities.data import _set_sampler_epoch

from ..base.errors import ConfigError, recognise_config_errors
from . import lightning_data
from .lightning_ckpt import adopt_model_checkpoint, record_folder, verify_folder
from .loop import DrivenLoop

log = logging.getLogger("gwenlake_hpc.integrations")

__all__ = ["GwenlakeCallback", "GwenlakeLogger", "fit_trainer", "save_model", "CHECKPOINT_FILE"]

#: The file ``trainer.save_checkpoint`` writes in each of the run's checkpoints.
CHECKPOINT_FILE = "lightning.ckpt"
#: Loggers of trackers that would start a run of their own at each requeue.
_OTHER_TRACKERS = ("WandbLogger", "CometLogger", "NeptuneLogger")


class GwenlakeLogger(Logger):
    """Lightning's logger into the job's run: ``log_metrics`` is ``run.log(metrics, step=trainer.global_step)``
    (the optimizer steps done; Lightning's own ``step`` argument counts from 0); ``log_hyperparams`` logs
    nothing (the job's parameters are the Hydra config's, logged once)."""

    def __init__(self, run: Any):
        super().__init__()
        self.run = run
        self.trainer: pl.Trainer | None = None

    @property
    def name(self) -> str:
        return "gwenlake_hpc"

    @property
    def version(self) -> str:
        return str(self.run.run_key)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {k: float(v) for k, v in metrics.items() if k != "epoch"}
        if "epoch" in metrics:
            values["epoch"] = float(metrics["epoch"])
        at = self.trainer.global_step if self.trainer is not None else (step or 0) + 1
        if values:
            self.run.log(values, step=int(at))


class GwenlakeCallback(Callback):
    """Drives the Run's loop from the Trainer's hooks (see the module's docstring).

    Args:
        run: the job's Run.
        keep: complete checkpoints kept (``run.checkpoint(keep=)``); None keeps all.
    """

    # The hooks Lightning calls at every batch that this callback has no use for. Lightning's dispatcher
    # (``lightning.pytorch.trainer.call._call_callback_hooks``) calls a callback's hook only where it is callable:
    # None spares each of them a profiler context, a formatted name and a call (~2 us a hook, five a step, on
    # steps of ~1 ms).
    on_train_batch_start = on_before_backward = on_after_backward = None  # type: ignore[assignment]
    on_before_optimizer_step = on_before_zero_grad = None  # type: ignore[assignment]

    def __init__(self, run: Any, keep: int | None = None):
        self.run, self.keep = run, keep
        self.loop: DrivenLoop | None = None
        self._last_step = -1
        self._loader_states: list[Any] = []  # the train loaders' states of the checkpoint resumed from
        self._fresh_epoch = False  # resumed from an epoch's last batch: the next epoch's iterator is made anew
        self._trainer: pl.Trainer | None = None
        self._plain: list[lightning_data.ResumableBatches | None] = []  # the plain train loaders' batch samplers
        self._plain_states: list[Any] = []  # their states in the checkpoint resumed from
        self._after_val = False  # this step's checkpoint and boundary wait for the validation it schedules

    def state_dict(self) -> dict[str, Any]:
        """The plain train loaders' passes (:mod:`.lightning_data`), saved in Lightning's checkpoint."""
        trainer = self._trainer
        if trainer is None or not any(self._plain):
            return {}
        fit_loop = trainer.fit_loop
        epoch, done = self._epoch_of(trainer), int(fit_loop.epoch_loop.batch_progress.current.ready)
        return {"plain_loaders": [w.state(epoch, done) if w is not None else None for w in self._plain]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._plain_states = list(state_dict.get("plain_loaders") or [])

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        fit_state = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {}
        # a copy: loading a state may change it in place, and Lightning loads these before _reload_loaders
        self._loader_states = copy.deepcopy(list(fit_state.get("combined_loader") or []))

    @staticmethod
    def _epoch_of(trainer: pl.Trainer) -> int:
        return int(trainer.fit_loop.epoch_progress.current.processed)  # the value Lightning gives set_epoch

    def _reload_loaders(self, trainer: pl.Trainer) -> None:
        """Load the resumed checkpoint's loader states again, after the samplers' ``set_epoch``, and make the
        Trainer's iterator anew. Lightning's ``FitLoop.setup_data`` loads them and builds the iterator (a
        ``StatefulDataLoader`` fast-forwards its sampler there) before ``on_advance_start`` calls ``set_epoch``:
        a run resumed after its first epoch would go on in epoch 0's order (found by the adversarial pass of
        issue 26: other weights than the uninterrupted run)."""
        states, self._loader_states = self._loader_states, []
        plain_states, self._plain_states = self._plain_states, []
        fit_loop = trainer.fit_loop
        if fit_loop._combined_loader is None or fit_loop._data_fetcher is None:
            return
        self._plain = lightning_data.install(fit_loop._combined_loader.flattened)
        epoch = self._epoch_of(trainer)
        if not any(self._plain) and (not states or epoch == 0):
            return  # epoch 0 (not past its last batch): the order Lightning restored is the right one
        # A checkpoint of an epoch's last batch: the resumed start begins the next epoch (Lightning counts it so),
        # from its first batch, not from the spent iterator the state describes (which would skip that epoch).
        resumed = self.run.resumed
        epoch_done = resumed and bool(fit_loop.epoch_loop.batch_progress.is_last_batch)
        reloaded = False
        for loader, state in zip(fit_loop._combined_loader.flattened, states):
            if state and callable(getattr(loader, "load_state_dict", None)) and epoch > 0:
                _set_sampler_epoch(loader, epoch)
                loader.load_state_dict({} if epoch_done else state)  # {}: a fresh iterator at the next iter()
                reloaded = True
        for loader, wrapper, state in zip(fit_loop._combined_loader.flattened, self._plain,
                                          plain_states or [None] * len(self._plain)):
            if wrapper is None:
                continue
            if resumed and not state:
                raise ConfigError(f"{self.run.resume_path} holds no position of the plain train DataLoader (written "
                                  "by an older gwenlake_hpc, or with another loader): it cannot resume in order; "
                                  "start a new run (job.resume=never) or resume with the loader that wrote it")
            _set_sampler_epoch(loader, epoch)
            if epoch_done:
                wrapper.restore_generator(state)
            elif resumed:
                if int(state["epoch"]) != epoch:
                    raise RuntimeError(f"the plain train DataLoader's position is of epoch {state['epoch']}, the "
                                       f"Trainer's epoch {epoch}")
                wrapper.resume_with(state)
                if getattr(loader, "num_workers", 0):
                    log.info("a plain DataLoader resumed mid-epoch: its order and position are restored; random "
                             "draws of the dataset inside its workers are not (a StatefulDataLoader restores them)")
            reloaded = True
        if reloaded and not epoch_done:
            # made before the Run restores the RNG: the iterator's own draws (its workers' base seed) are not the
            # training's; the batch sampler sets the epoch's recorded RNG states for its order
            iter(fit_loop._data_fetcher)
        self._fresh_epoch = reloaded and epoch_done

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self.run.start_step:
            raise RuntimeError(f"the Lightning Trainer starts at step {trainer.global_step} and the Run at "
                               f"{self.run.start_step}: pass ckpt_path=run.resume_path / {CHECKPOINT_FILE!r} "
                               "(fit_trainer does)")
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self.loop = DrivenLoop(self.run, int(total), "the Lightning Trainer")
        self._last_step = trainer.global_step
        self._trainer = trainer
        self._reload_loaders(trainer)
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        run_validation = val_loop.run

        def run_then_end_step() -> Any:
            out = run_validation()
            if self._after_val:
                self._after_val = False
                self._end_step(trainer, after_val=True)
            return out

        val_loop.run = run_then_end_step  # the instance's: after every callback's on_validation_end
        if not self.loop.advance():  # the Run restores the RNG here (the state at the checkpoint's step)
            trainer.should_stop = True
        if self._fresh_epoch:
            # a new epoch's iterator draws its base seed from the global RNG, as the uninterrupted run's did after
            # that step: made after the restore
            self._fresh_epoch = False
            iter(trainer.fit_loop._data_fetcher)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # a chain of properties in Lightning: read once a batch
        if step == self._last_step:
            return  # a batch of gradient accumulation: no optimizer step yet
        self._last_step = step
        if step != self.run.step:
            self.loop.check_step(step)
        if self._validation_scheduled(trainer):
            # the checkpoint after the validation Lightning runs at this step: it holds what the validation changed
            # (a ModelCheckpoint's best_k_models), and a resume does not run that validation again
            self._after_val = True
            return
        self._end_step(trainer, after_val=False)

    @staticmethod
    def _validation_scheduled(trainer: pl.Trainer) -> bool:
        """Whether Lightning validates after this training batch by its schedule (``val_check_interval``, the
        epoch's end), leaving out its validation at a stop (``trainer.should_stop``), which the job's ending
        must not add."""
        epoch_loop, stop = trainer.fit_loop.epoch_loop, trainer.should_stop
        trainer.should_stop = False
        try:
            return bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        finally:
            trainer.should_stop = stop

    def _end_step(self, trainer: pl.Trainer, after_val: bool) -> None:
        """The step's boundary: its checkpoint (the Run's ``at_eval``, or a stop agreed now: the training ends
        after this step, not one more), then the Run's next step or the end of the training."""
        run, loop = self.run, self.loop
        if run.at_eval or loop.stop_requested():
            if not after_val:
                self._log_step(trainer)
            with run.checkpoint(keep=self.keep) as ck:
                path = ck.path(CHECKPOINT_FILE)
                trainer.save_checkpoint(path)
                record_folder(ck, path, trainer.global_rank)
        if not loop.advance():
            trainer.should_stop = True
            if not after_val:
                trainer.fit_loop.epoch_loop._skip_next_val = True  # no validation the schedule did not ask for

    @staticmethod
    def _log_step(trainer: pl.Trainer) -> None:
        """Log this step's ``self.log`` values now, into the job's run, before the step's checkpoint: Lightning
        logs them only after this hook, so a kill after the seal would lose the point of the step resumed from
        (the Run makes the spool durable before it seals). Lightning's own log of the step right after is the
        same step, which the tracker drops (one point per step); the user's other loggers get it from Lightning
        alone, once."""
        conn = trainer._logger_connector
        if trainer.fit_loop._should_accumulate() or not conn.should_update_logs:
            return  # Lightning logs nothing at this step either
        metrics = convert_tensors_to_scalars(conn.metrics["log"])
        if metrics:
            metrics.setdefault("epoch", trainer.current_epoch)
            for logger in trainer.loggers:
                if isinstance(logger, GwenlakeLogger):
                    logger.log_metrics(metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.loop is not None:
            self.loop.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.loop is not None and not self.loop.ended:
            self.loop.ended = True  # the job ends the Run (the checkpoint in flight is sealed there)


def _own_checkpointing(cb: ModelCheckpoint) -> bool:
    """A ModelCheckpoint configured by the user (not the one Lightning adds by default)."""
    return bool(cb.dirpath or cb.monitor or cb.save_last or cb._every_n_train_steps
                or cb._train_time_interval or (cb._every_n_epochs not in (0, 1)))


def _is_default_logger(trainer: pl.Trainer, logger: Logger) -> bool:
    """The logger Lightning adds when none is given: a TensorBoard or CSV logger named ``lightning_logs`` in the
    Trainer's ``default_root_dir``. One the user made with a folder of their own is theirs, and kept."""
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or logger.name != "lightning_logs":
        return False
    return os.path.abspath(str(logger.save_dir or "")) == os.path.abspath(str(trainer.default_root_dir))


def _prepare(trainer: pl.Trainer, run: Any, keep: int | None) -> GwenlakeCallback:
    """Refuse or replace what would work against the run's store, tracking or signals; add the callback and the
    logger (see the module's docstring).

    Raises:
        ConfigError: the setting, why, and what to do.
    """
    for cb in list(trainer.callbacks):
        if isinstance(cb, ModelCheckpoint):
            if _own_checkpointing(cb):
                adopt_model_checkpoint(cb, run)  # the user's: kept, its saves named checkpoints as well
                continue
            trainer.callbacks.remove(cb)  # Lightning's default one: the run's store holds the checkpoints
    loggers = []
    for logger in trainer.loggers:
        kind = type(logger).__name__
        if kind in _OTHER_TRACKERS:
            raise ConfigError(f"lightning.Trainer(logger={kind}(...)): it would start a run of its own at each "
                              "requeue; leave logger unset or pass an MLFlowLogger (both go to the job's MLflow run)")
        if isinstance(logger, MLFlowLogger):
            log.info("the Trainer's MLFlowLogger is replaced by the job's MLflow run (one run across restarts)")
        elif _is_default_logger(trainer, logger):
            pass  # Lightning's default logger
        else:
            loggers.append(logger)
    own = GwenlakeLogger(run)
    own.trainer = trainer
    trainer.loggers = [own, *loggers]
    env = trainer._accelerator_connector.cluster_environment
    if getattr(env, "auto_requeue", False) and trainer._accelerator_connector._cluster_environment_flag is env:
        log.warning("lightning.Trainer(plugins=[SLURMEnvironment(auto_requeue=True)]): Lightning's requeue and its "
                    "signal handlers are off; gwenlake_hpc owns the signals and requeues the job (launcher=slurm)")
    # Lightning's handlers would end fit() with SIGTERMException on SIGTERM and requeue from inside a handler
    trainer._signal_connector.register_signal_handlers = lambda: None
    callback = GwenlakeCallback(run, keep)
    trainer.callbacks.append(callback)
    return callback


def _logger_refusal(exc: BaseException) -> ConfigError | None:
    """A logger failing in its constructor: one of another tracker (``WandbLogger`` where wandb is not installed
    raises ModuleNotFoundError from ``lightning/pytorch/loggers/``), the same refusal as :func:`_prepare`'s; or an
    ``MLFlowLogger`` that cannot open its store (``MLFlowLogger()`` falls back to ``./mlruns``, which MLflow
    refuses). Exit 2 with the fix instead of a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = [f.filename.replace(os.sep, "/") for f in frames]
    if any(w.endswith("/lightning/pytorch/loggers/mlflow.py") for w in where):
        # MLFlowLogger() takes its tracking_uri from MLFLOW_TRACKING_URI as Lightning was imported, else ./mlruns
        return ConfigError(f"lightning.Trainer(logger=MLFlowLogger(...)): the logger could not open its tracking "
                           f"store ({type(exc).__name__}: {str(exc)[:200]}); leave logger unset, or build it as "
                           "MLFlowLogger(tracking_uri=mlflow.get_tracking_uri()): self.log goes to the job's MLflow "
                           "run either way")
    if not frames or not isinstance(exc, ImportError):
        return None
    if not any("/lightning/pytorch/loggers/" in w for w in where):
        return None
    return ConfigError(f"lightning.Trainer(logger=...): its logger could not start ({exc}); leave logger unset or "
                       "pass an MLFlowLogger: the module's self.log goes to the job's MLflow run either way, and "
                       "another tracker would start a run of its own at each requeue")


recognise_config_errors(_logger_refusal)


def fit_trainer(trainer: pl.Trainer, module: pl.LightningModule, run: Any, *, keep: int | None = None,
                **fit_kwargs: Any) -> None:
    """Fit ``module`` with ``trainer`` as this job's loop, from the run's newest checkpoint.

    Sets the Trainer's ``max_steps`` (``job.steps``; ``max_epochs`` unbounded) or ``max_epochs`` (``job.epochs``),
    replaces its default checkpointing, logger and signal handlers (see the module's docstring), and calls
    ``trainer.fit(module, ckpt_path=run.resume_path / "lightning.ckpt", **fit_kwargs)``.

    Args:
        trainer: the ``lightning.Trainer``, built by the training function (``max_steps``/``max_epochs`` are the
            job's).
        module: the LightningModule.
        run: the job's Run.
        keep: complete checkpoints kept (default all).
        fit_kwargs: ``train_dataloaders``, ``val_dataloaders``, ``datamodule``: passed to ``trainer.fit``.

    Returns:
        None. After an eviction ``run.evicted`` is true: return None from the training function (the job exits 75
        and the next start resumes).

    Raises:
        ConfigError: a Trainer setting that cannot work here (see the module's docstring), or ``ckpt_path`` in
            ``fit_kwargs`` (the run's checkpoints are the resume point).
    """
    if "ckpt_path" in fit_kwargs:
        raise ConfigError("fit_trainer(ckpt_path=...): the run resumes from its own newest sealed checkpoint "
                          "(job.resume); leave ckpt_path out")
    _prepare(trainer, run, keep)
    loop = trainer.fit_loop
    if run.total_steps is not None:
        loop.epoch_loop.max_steps, loop.max_epochs = int(run.total_steps), -1
    elif run.epochs is not None:
        loop.epoch_loop.max_steps, loop.max_epochs = -1, int(run.epochs)
    if fit_kwargs.get("train_dataloaders") is not None:
        lightning_data.refuse_unresumable_in(fit_kwargs["train_dataloaders"], "fit_trainer(train_dataloaders=...)")
    ckpt = None
    if run.resumed:
        ckpt = Path(run.resume_path) / CHECKPOINT_FILE
        if not ckpt.is_file() and not ckpt.is_dir():
            raise ConfigError(f"{run.resume_path} holds no {CHECKPOINT_FILE}: it was not written by fit_trainer; "
                              "start a new run (job.resume=never) or resume it with the training that wrote it")
        if ckpt.is_dir():  # a distributed checkpoint (ModelParallelStrategy, FSDPStrategy sharded): its shards
            verify_folder(run, ckpt)
    trainer.fit(module, ckpt_path=str(ckpt) if ckpt else None, **fit_kwargs)


def save_model(module: Any, output: Any) -> Path:
    """Save the trained module's weights (``state_dict``, safetensors) as ``model.safetensors`` in the ``Output``,
    which the job commits and registers as the model's version; its ``hparams`` (``save_hyperparameters``) as
    ``hparams.json`` where it has any.

    Returns:
        The weights' file. ``gwenlake_hpc.load_state(load_model(name).path / "model.safetensors", model=m)``
        loads them into a module built alike.
    """
    import json

    from ..stores.checkpoints.state import save_state

    path = Path(output.file("model.safetensors"))
    save_state(path, model=module)
    hparams = dict(getattr(module, "hparams", {}) or {})
    if hparams:
        output.file("hparams.json").write_text(json.dumps(hparams, indent=2, sort_keys=True, default=str))
    return path
