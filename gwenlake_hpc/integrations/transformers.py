"""The Hugging Face ``Trainer`` inside an ordinary ``@train`` function: eviction, resume, one MLflow run.

    from gwenlake_hpc.integrations.transformers import run_trainer, save_model

    @train(output=Output("lm.tiny"), steps=200, eval_every=50)
    def fit(output, run, config):
        trainer = Trainer(model=model, args=TrainingArguments(logging_steps=1, ...), train_dataset=...)
        run_trainer(trainer, run, keep=2)       # resumes, checkpoints into the run's store, stops when evicted
        if run.evicted:
            return None
        save_model(trainer, output)             # the version: committed and registered by the job

Responsibilities (:func:`run_trainer` and its :class:`GwenlakeCallback`):

- the length: ``job.steps`` (or ``job.epochs``) is the Trainer's ``max_steps`` (``num_train_epochs``); the Run's
  step is the Trainer's ``global_step``, checked at every step;
- checkpoints: at the Run's ``at_eval`` steps (``job.eval_every``, the last step), at the step a stop request
  arrived in, and at the Trainer's own saves (``save_strategy``/``save_steps``; an ``"epoch"`` save after the
  epoch's evaluation), the Trainer's checkpoint folder (weights, optimizer, scheduler, RNG of each rank,
  ``trainer_state.json``, an FSDP state's DCP folders ``pytorch_model_fsdp_0/``...) is written into a scratch
  folder of the run directory and moved, files and folders as they are, into a ``run.checkpoint()`` block: the
  seal records every file, a resume verifies them, ``keep=`` of them are kept, a kill at any moment leaves
  nothing half-sealed; ``resume_from_checkpoint`` is the Run's ``resume_path`` (the newest sealed one; a damaged
  one is set aside for the one before by the Run); the Trainer restores the data position itself
  (``skip_first_batches``);
- what the folder lacks (:mod:`.transformers_state`): a Trainer subclass's own counters (TRL's ``num_tokens``)
  and callbacks with ``state_dict()``; ``ExportableState`` callbacks come back through HF's
  ``restore_callback_states_from_checkpoint`` (set here);
- the best checkpoints (``metric_for_best_model``, ``greater_is_better``): each new best is copied into a named
  checkpoint of the model, ``<run key>.best-<step>`` with its metric, which ``best_model_checkpoint`` points at,
  so ``load_best_model_at_end`` loads it after any eviction; ``save_strategy="best"`` saves at each evaluation
  (the run's own checkpoints cannot wait for a new best);
- eviction: a stop request (agreed by every rank at the end of each step) ends the training at the boundary of
  the step in progress, after that step's checkpoint (``control.should_save``, then
  ``control.should_training_stop``); the job exits 75 (under torchrun: ``python -m gwenlake_hpc.launch.torchrun``);
- logging: what the Trainer logs (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``; each
  ``logging_steps``) goes to ``run.log`` at its ``global_step``: the job's MLflow run, one point per step
  across restarts. HF's ``MLflowCallback`` (``report_to="mlflow"``) is replaced by this, since it would log the
  arguments again at each restart, into a run of its own where ``MLFLOW_RUN_ID`` is unset.

Settings refused with exit 2 before training (:class:`~gwenlake_hpc.base.errors.ConfigError`, naming the setting
and the fix): ``report_to`` other than ``"mlflow"``/``"none"`` (a second tracker would start a run of its own
at each requeue), ``save_strategy="best"`` without evaluations, ``save_only_model`` (a resume needs the optimizer
and RNG), ``push_to_hub`` (a version is its git commit), ``save_total_limit`` different from ``keep``, and what
``TrainingArguments``' own checks refuse (its message). ``output_dir`` is replaced by ``<run dir>/hf_trainer``
(a scratch folder: the checkpoints' home is the run's store).
"""

from __future__ import annotations

import logging
import os
import shutil
import traceback
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..base.errors import ConfigError, recognise_config_errors
from ..base.fsutil import umask
from . import transformers_state as extra
from .loop import DrivenLoop

log = logging.getLogger("gwenlake_hpc.integrations")

__all__ = ["GwenlakeCallback", "run_trainer", "save_model", "SCRATCH"]

#: The Trainer's ``output_dir`` under the run directory: where a checkpoint is written before it is moved.
SCRATCH = "hf_trainer"
#: Keys of the Trainer's last log (a summary of this start, not of a step): not sent to ``run.log``.
_SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


class GwenlakeCallback(TrainerCallback):
    """Drives the Run's loop from the Trainer's callbacks (see the module's docstring).

    Args:
        run: the job's Run.
        keep: complete checkpoints kept (``run.checkpoint(keep=)``); None keeps all.
        trainer: the Trainer (its subclass's counters and its callbacks' states go into each checkpoint); None:
            the Trainer's own files only.
    """

    def __init__(self, run: Any, keep: int | None = None, trainer: Any = None):
        self.run, self.keep, self.trainer = run, keep, trainer
        self.built = extra.built_values(trainer) if trainer is not None else {}
        self.loop: DrivenLoop | None = None
        self._saved_step = -1
        self._save_requested = False
        self._epoch_saves = False  # save_strategy="epoch": a step that ends an epoch saves (read once, at the start)

    # -- the step boundary -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step != self.run.start_step:
            raise RuntimeError(f"the Trainer starts at step {state.global_step} and the Run at {self.run.start_step}: "
                               "pass resume_from_checkpoint=run.resume_path (run_trainer does)")
        self._epoch_saves = _save_strategy(args) == "epoch"
        self.loop = DrivenLoop(self.run, state.max_steps, "the Hugging Face Trainer")
        if not self.loop.advance():
            control.should_training_stop = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # called at every optimizer step: the common case (no checkpoint) is a comparison and one turn of the loop
        run, loop = self.run, self.loop
        if state.global_step != run.step:
            loop.check_step(state.global_step)
        # a stop asked during this step makes it the last: its checkpoint, then the end (not one step more)
        stop = loop.stop_requested()
        if self._epoch_saves and _epoch_ends(state):
            # the epoch's own save comes after on_epoch_end and its evaluation (the best metric): this step's
            self._save_requested = True
        elif run.at_eval or stop or control.should_save:
            control.should_save = self._save_requested = True  # on_save then seals it and ends the step
        elif not loop.advance():
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not self._save_requested:
            # a second save of a step (save_strategy="epoch" at an epoch's end): the step's checkpoint is sealed
            if state.global_step != self._saved_step:
                log.warning("the Trainer saved step %d outside a step's end: not kept", state.global_step)
            shutil.rmtree(folder, ignore_errors=True)
            return control
        self._save_requested = False
        self._store(folder, args, state)
        self._saved_step = state.global_step
        self._end_step(control)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not _SUMMARY_KEYS.isdisjoint(logs):
            return control
        values = {k: float(v) for k, v in logs.items()
                  if type(v) is float or (isinstance(v, (int, float)) and not isinstance(v, bool))}
        if values:
            self.run.log(values, step=state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.loop is not None:
            self.loop.close()
        return control

    # -- helpers -----------------------------------------------------------------------------------------------
    def _end_step(self, control) -> None:
        if not self.loop.advance():
            control.should_training_stop = True

    def _store(self, folder: Path, args: Any, state: Any) -> None:
        """Move the Trainer's checkpoint folder into a sealed checkpoint of the current step (every rank enters the
        block; rank 0 moves every file and folder the Trainer wrote, after every rank wrote its own: its RNG
        file, an FSDP state's shards). The seal records each file, nested ones included, and a resume verifies
        them. A new best (``metric_for_best_model``) is copied into a named checkpoint first."""
        run = self.run
        run.dist.barrier()
        if run.is_main and not folder.is_dir():
            raise RuntimeError(f"the Trainer's checkpoint {folder} is missing: is output_dir shared by all "
                               "ranks (run_trainer sets it)?")
        if self.trainer is not None and run.is_main:
            extra.write_extra(self.trainer, self.built, folder)
        if extra.is_new_best(args, state):
            extra.keep_best(run, args, state, folder)
        with run.checkpoint(keep=self.keep) as ck:
            if run.is_main:
                mode = 0o666 & ~umask()  # safetensors writes 0600: teammates on the shared filesystem read runs
                for path in folder.rglob("*"):
                    if path.is_file():
                        os.chmod(path, mode)
                # whole entries: an FSDP model's folder (pytorch_model_fsdp_0/) moves as it is, empty ones too
                for entry in sorted(folder.iterdir()):
                    os.replace(entry, ck.path(entry.name))
        run.dist.barrier()
        if run.is_main:
            shutil.rmtree(folder, ignore_errors=True)


def _epoch_ends(state) -> bool:
    """True at the last optimizer step of an epoch (``state.epoch`` is a whole number there)."""
    return state.epoch is not None and abs(state.epoch - round(state.epoch)) < 1e-9 and state.epoch >= 1


def _save_strategy(args) -> str:
    """``args.save_strategy`` as text (an enum in recent versions, a string in older ones)."""
    return str(getattr(args.save_strategy, "value", args.save_strategy))


def _eval_strategy(args) -> str:
    return str(getattr(args.eval_strategy, "value", args.eval_strategy))


def _best_as_evaluations(args) -> None:
    """``save_strategy="best"``: the Trainer would save only at a new best, deciding it after the step's
    callbacks, and so drop the run's own checkpoints (its eviction's, ``eval_every``'s). Here it saves at each
    evaluation (``eval_strategy``, ``eval_steps``): the run's store keeps ``keep`` of them for resuming, and each
    new best is the named checkpoint the Trainer's ``best_model_checkpoint`` points at."""
    from transformers.trainer_utils import SaveStrategy

    if _save_strategy(args) == "best":
        args.save_strategy = SaveStrategy(_eval_strategy(args))
        if args.save_strategy == SaveStrategy.STEPS:
            args.save_steps = args.eval_steps


def _check_arguments(args: Any, keep: int | None) -> int | None:
    """Refuse the Trainer's arguments that would work against the run's store or tracking (see the module's
    docstring); returns the ``keep`` to use.

    Raises:
        ConfigError: the setting, why, and what to do.
    """
    reporters = [r for r in (args.report_to or []) if r not in ("none", "mlflow")]
    if reporters:
        raise ConfigError(f"TrainingArguments(report_to={args.report_to!r}): {', '.join(reporters)} would start a "
                          "run of its own at each requeue; set report_to='mlflow' or 'none' (the Trainer's logs go "
                          "to the job's MLflow run either way)")
    if _save_strategy(args) == "best" and _eval_strategy(args) == "no":
        raise ConfigError("TrainingArguments(save_strategy='best') with eval_strategy='no': a best checkpoint needs "
                          "evaluations; set eval_strategy='steps' (with eval_steps) or 'epoch'")
    if args.save_only_model:
        raise ConfigError("TrainingArguments(save_only_model=True): a resumed run needs the optimizer, scheduler "
                          "and RNG states; leave save_only_model off")
    if args.push_to_hub:
        raise ConfigError("TrainingArguments(push_to_hub=True): the model's version is its git commit (Output); "
                          "push a promoted version instead (python -m gwenlake_hpc models ...), or leave it off")
    limit = args.save_total_limit
    if limit is not None and keep is not None and limit != keep:
        raise ConfigError(f"TrainingArguments(save_total_limit={limit}) and run_trainer(keep={keep}) disagree: "
                          "give one of them (both mean the checkpoints kept in the run's store)")
    return keep if keep is not None else limit


def _tracker_refusal(exc: BaseException) -> ConfigError | None:
    """The Trainer's constructor failing to start a ``report_to`` tracker (``report_to="wandb"`` where wandb is
    not installed raises RuntimeError from ``transformers/integrations/``): the same refusal as
    :func:`_check_arguments`'s, exit 2 instead of a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not isinstance(exc, (RuntimeError, ImportError)):
        return None
    where = [f.filename.replace(os.sep, "/") for f in frames]
    if "/transformers/integrations/" not in where[-1] or not any(w.endswith("/transformers/trainer.py")
                                                                    for w in where):
        return None
    return ConfigError(f"TrainingArguments(report_to=...): the Trainer could not start its tracker ({exc}); set "
                       "report_to='mlflow' or 'none': the Trainer's logs go to the job's MLflow run either way, and "
                       "another tracker would start a run of its own at each requeue")


recognise_config_errors(_tracker_refusal)


def _hub_refusal(exc: BaseException) -> ConfigError | None:
    """The Trainer's constructor failing to reach the Hugging Face Hub for ``push_to_hub=True`` (it creates the
    Hub repository in ``Trainer.__init__``, before :func:`run_trainer` can refuse the setting): exit 2 with the
    setting named instead of the Hub client's traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not any(f.name == "init_hf_repo" and f.filename.replace(os.sep, "/").endswith("/transformers/trainer.py")
               for f in frames):
        return None
    return ConfigError(f"TrainingArguments(push_to_hub=True): the Trainer could not reach the Hugging Face Hub "
                       f"({type(exc).__name__}: {exc}); set push_to_hub=False: the job commits the model as its "
                       "version (save_model), and a push from each start would race the requeues")


recognise_config_errors(_hub_refusal)


def _arguments_refusal(exc: BaseException) -> ConfigError | None:
    """``TrainingArguments(...)`` refusing a combination in its own checks (``load_best_model_at_end=True`` with
    different save and eval strategies, ``save_steps`` not a multiple of ``eval_steps``...): its message already
    names the settings and the fix; exit 2 with it instead of a traceback."""
    if not isinstance(exc, ValueError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not frames[-1].filename.replace(os.sep, "/").endswith("/transformers/training_args.py"):
        return None
    return ConfigError(f"TrainingArguments: {exc}")


recognise_config_errors(_arguments_refusal)


def run_trainer(trainer: Any, run: Any, *, keep: int | None = None) -> Any:
    """Train ``trainer`` (a ``transformers.Trainer``) as this job's loop, from the run's newest checkpoint.

    Sets the Trainer's ``max_steps`` (``job.steps``) or ``num_train_epochs`` (``job.epochs``), its
    ``output_dir`` (``<run dir>/hf_trainer``, a scratch folder) and ``save_total_limit`` (None: the store keeps
    ``keep``), replaces HF's ``MLflowCallback`` with :class:`GwenlakeCallback`, and calls
    ``trainer.train(resume_from_checkpoint=run.resume_path)``.

    Args:
        trainer: the Trainer, built by the training function.
        run: the job's Run.
        keep: complete checkpoints kept (default: ``save_total_limit``, else all).

    Returns:
        The Trainer's ``TrainOutput``. After an eviction ``run.evicted`` is true: return None from the
        training function (the job exits 75 and the next start resumes).

    Raises:
        ConfigError: a Trainer setting that cannot work here (see the module's docstring).
    """
    args = trainer.args
    keep = _check_arguments(args, keep)
    if run.total_steps is not None:
        args.max_steps = int(run.total_steps)
    elif run.epochs is not None:
        args.max_steps, args.num_train_epochs = -1, run.epochs
    scratch = Path(run.run_dir) / SCRATCH
    if args.output_dir and Path(args.output_dir).resolve() != scratch.resolve():
        log.info("the Trainer's output_dir (%s) is replaced by %s: its checkpoints are moved from there into the "
                 "run's store", args.output_dir, scratch)
        try:
            Path(args.output_dir).rmdir()  # the empty folder the Trainer's constructor made; nothing else
        except OSError:
            pass
    args.output_dir, args.save_total_limit = str(scratch), None
    # a resume is the same training going on: ExportableState callbacks (EarlyStoppingCallback's patience...)
    # get their states back from trainer_state.json, HF's own mechanism (off by default in HF)
    args.restore_callback_states_from_checkpoint = True
    _best_as_evaluations(args)
    if run.is_main and scratch.is_dir():
        shutil.rmtree(scratch)  # an interrupted start's unsealed folders
    from transformers.integrations import MLflowCallback
    trainer.remove_callback(MLflowCallback)
    callback = GwenlakeCallback(run, keep, trainer)  # reads the counters as built, before the resume sets them
    trainer.add_callback(callback)
    resume = str(run.resume_path) if run.resumed else None
    if resume is not None:
        extra.read_extra(trainer, Path(resume))
    return trainer.train(resume_from_checkpoint=resume)


def save_model(trainer: Any, output: Any) -> Path:
    """Save the trained model (``save_pretrained``: config and safetensors weights; the tokenizer or processor
    the Trainer holds) into the ``Output``, which the job commits and registers as the model's version.

    Returns:
        The Output's folder (``output.path``). ``transformers.AutoModel*.from_pretrained`` opens it, as it
        opens ``gwenlake_hpc.load_model(name).path``.
    """
    trainer.save_model(str(output.path))
    mode = 0o666 & ~umask()  # the modes of a plain open(), as the version's other files (safetensors writes 0600)
    for path in Path(output.path).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)
    return Path(output.path)

