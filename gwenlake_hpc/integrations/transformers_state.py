"""What a Hugging Face Trainer's checkpoint folder does not hold, and its best checkpoints, for
:mod:`gwenlake_hpc.integrations.transformers`.

Responsibilities:

- a Trainer subclass's own counters (TRL's ``SFTTrainer._total_train_tokens``, logged as ``num_tokens``): its
  number attributes that ``transformers.Trainer``'s own code never names and that changed since the Trainer was
  built are written into the checkpoint folder (``gwenlake_trainer.pt``) and set again before a resumed
  ``train()``; the Trainer's ``TrainerState`` (``trainer_state.json``) holds the rest, ``stateful_callbacks``
  (``ExportableState`` callbacks) included;
- callbacks with ``state_dict()``/``load_state_dict()`` that are not ``ExportableState``: their states, in the
  same file;
- the best checkpoints (``metric_for_best_model``): each checkpoint that is the Trainer's new best
  (``state.best_global_step``) has its model files copied into a named checkpoint of the run's model
  (:mod:`gwenlake_hpc.stores.checkpoints.named`): ``<run key>.best-<step>``, with the metric, kept until deleted
  by hand, so that ``state.best_model_checkpoint`` (and ``load_best_model_at_end``) reads a folder that outlives
  the run's pruned checkpoints and its evictions.

Not here: the loop, the refusals, moving the Trainer's folder into the run's checkpoint
(:mod:`gwenlake_hpc.integrations.transformers`).
"""

from __future__ import annotations

import json
import logging
import shutil
import types
from pathlib import Path
from typing import Any

log = logging.getLogger("gwenlake_hpc.integrations")

#: The file of this module's states inside the Trainer's checkpoint folder.
EXTRA_FILE = "gwenlake_trainer.pt"
#: The Trainer's checkpoint files that are the training's, not the model's: not copied into a best checkpoint.
_TRAINING_FILES = {"optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "trainer_state.json",
                   "training_args.bin", EXTRA_FILE}
_BASE_NAMES: set[str] | None = None


def _base_names() -> set[str]:
    """Every name that ``transformers.Trainer``'s code (its methods, nested code included) uses: an attribute
    of that name is the Trainer's own, set by its loop (``_globalstep_last_logged``, ``current_flos``...)."""
    global _BASE_NAMES
    if _BASE_NAMES is None:
        from transformers import Trainer

        names: set[str] = set()

        def walk(code: types.CodeType) -> None:
            names.update(code.co_names)
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    walk(const)

        for klass in Trainer.__mro__:
            for value in vars(klass).values():
                value = getattr(value, "__func__", value)
                value = value.fget if isinstance(value, property) else value
                if isinstance(getattr(value, "__code__", None), types.CodeType):
                    walk(value.__code__)
        _BASE_NAMES = names
    return _BASE_NAMES


def _numbers(trainer: Any) -> dict[str, int | float]:
    base = _base_names()
    return {k: v for k, v in vars(trainer).items() if type(v) in (int, float) and k not in base}


def built_values(trainer: Any) -> dict[str, int | float]:
    """The subclass's number attributes as the Trainer was built (before a resume sets them)."""
    return _numbers(trainer)


def _stateful(trainer: Any) -> list[tuple[str, Any]]:
    from transformers.trainer_callback import ExportableState

    found = [cb for cb in trainer.callback_handler.callbacks
             if not isinstance(cb, ExportableState) and callable(getattr(cb, "state_dict", None))
             and callable(getattr(cb, "load_state_dict", None))]
    return [(f"{i}:{type(cb).__name__}", cb) for i, cb in enumerate(found)]


def write_extra(trainer: Any, built: dict[str, int | float], folder: Path) -> None:
    """Write the subclass's changed counters and the ``state_dict`` callbacks' states into ``folder``
    (``gwenlake_trainer.pt``; rank 0's: the counters TRL logs are gathered over the ranks)."""
    import torch

    counters = {k: v for k, v in _numbers(trainer).items() if built.get(k, None) != v}
    callbacks = {key: cb.state_dict() for key, cb in _stateful(trainer)}
    if counters or callbacks:
        torch.save({"attributes": counters, "callbacks": callbacks}, folder / EXTRA_FILE)


def read_extra(trainer: Any, checkpoint: Path) -> None:
    """Set the counters and callbacks' states of a checkpoint written by :func:`write_extra` (nothing where the
    checkpoint has none)."""
    import torch

    path = Path(checkpoint) / EXTRA_FILE
    if not path.is_file():
        return
    saved = torch.load(path, map_location="cpu", weights_only=True)
    for name, value in saved.get("attributes", {}).items():
        setattr(trainer, name, value)
    states = saved.get("callbacks", {})
    for key, cb in _stateful(trainer):
        if key in states:
            cb.load_state_dict(states[key])
        else:
            log.warning("the checkpoint holds no state of callback %s: it starts afresh", key)
    if saved.get("attributes"):
        log.info("restored the Trainer's own counters: %s", ", ".join(sorted(saved["attributes"])))


def best_name(run: Any, step: int) -> str:
    """The named checkpoint of the run's best at ``step``: ``<run key>.best-<step, 9 digits>``."""
    return f"{run.run_key}.best-{int(step):09d}"


def is_new_best(args: Any, state: Any) -> bool:
    """True where the checkpoint the Trainer just wrote is its new best by ``metric_for_best_model``."""
    return bool(args.metric_for_best_model) and state.best_metric is not None \
        and state.best_global_step == state.global_step


def keep_best(run: Any, args: Any, state: Any, folder: Path) -> Path:
    """Copy the model files of the Trainer's checkpoint ``folder`` (weights, config, an FSDP model folder; not the
    optimizer, scheduler, RNG, trainer state) into the named checkpoint :func:`best_name`, with the metric
    (rank 0 writes; every rank gets the path), and point ``state.best_model_checkpoint`` and the folder's
    ``trainer_state.json`` at it.

    Raises:
        OSError: a copy or rename failed (rank 0).
    """
    from ..stores.checkpoints.named import begin_named, seal_named, store_dir

    model_root = Path(run.run_dir).parent
    name = best_name(run, state.global_step)
    dest = store_dir(model_root) / name
    if run.is_main:
        tmp = begin_named(model_root)
        try:
            for entry in sorted(folder.iterdir()):
                if entry.name in _TRAINING_FILES or entry.name.startswith(("rng_state", "optimizer")):
                    continue
                if entry.is_dir():
                    shutil.copytree(entry, tmp / entry.name)
                else:
                    shutil.copyfile(entry, tmp / entry.name)
            metric = args.metric_for_best_model
            metric = metric if metric.startswith("eval_") else f"eval_{metric}"
            meta = {"metric": metric, "value": float(state.best_metric),
                    "greater_is_better": bool(args.greater_is_better), "global_step": int(state.global_step)}
            dest = seal_named(tmp, model_root, name, run_key=run.run_key, step=state.global_step, meta=meta, files=[])
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        trainer_state = folder / "trainer_state.json"
        if trainer_state.is_file():  # written before on_save with the scratch folder as the best
            doc = json.loads(trainer_state.read_text())
            doc["best_model_checkpoint"] = str(dest)
            trainer_state.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        log.info("step %d is the best so far (%s %.6g): named checkpoint %s", state.global_step, meta["metric"],
                 meta["value"], name)
    state.best_model_checkpoint = str(dest)
    return dest
