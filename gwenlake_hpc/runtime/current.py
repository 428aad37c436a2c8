"""The current run of this process, for code that is not handed ``run`` (a metrics helper, a callback):
:func:`current_run`, :func:`log_metrics`, :func:`checkpoint` (named checkpoints), :func:`last_checkpoint_path`,
:func:`log_rollout`; :func:`active` makes a Run current while the training function runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from ..base.errors import GwenlakeError

log = logging.getLogger("gwenlake_hpc.run")

if TYPE_CHECKING:
    from .run import Run

_ACTIVE: Run | None = None


@contextlib.contextmanager
def active(run: Run) -> Iterator[Run]:
    """Make ``run`` the current run while the training function runs (:func:`current_run`), and set
    ``GWENLAKE_RUN_ID`` (the run key) for it and the processes it starts."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, run
    os.environ["GWENLAKE_RUN_ID"] = run.run_key
    try:
        yield run
    finally:
        _ACTIVE = previous


def current_run() -> Run:
    """The Run of the training running in this process.

    Raises:
        GwenlakeError: no training runs here (a plain script, a notebook, a DataLoader worker process).
    """
    if _ACTIVE is None:
        raise GwenlakeError("no training runs in this process: call this inside a @train function run by "
                            "`python -m gwenlake_hpc +job=NAME` or `gwenlake-train` (or use its `run` argument)")
    return _ACTIVE


def log_metrics(metrics: Mapping[str, Any], tags: Mapping[str, Any] | None = None, step: int | None = None) -> None:
    """``run.log(metrics, step=step, tags=tags)`` on the current run, for code that is not handed ``run``
    (a metrics helper, a callback). See :meth:`Run.log` for tags and steps.

    Raises:
        GwenlakeError: outside a training (see :func:`current_run`); ValueError: bad tags.
    """
    current_run().log(metrics, step=step, tags=tags)


def checkpoint(model: Any, path: str | None = None, metadata: Mapping[str, Any] | None = None,
               additional_files: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """Save ``model`` as a named checkpoint of the current run's model (see :mod:`gwenlake_hpc.stores.checkpoints.named`).

    Args:
        model: an ``nn.Module`` (its state_dict) or a state_dict; stored as ``model.safetensors``.
        path: the checkpoint's name (default: the run key); letters, digits, ``_ . -``.
        metadata: JSON-able values kept in ``checkpoint.json`` with the run key and step.
        additional_files: files copied beside the weights.

    Returns:
        The checkpoint's folder ``<runs_root>/<model name>/named/<path>/`` (on ranks other than 0, where
        nothing is written, the folder rank 0 writes).

    Raises:
        GwenlakeError: outside a training (``GWENLAKE_RUN_ID`` unset); ConfigError: a bad name, metadata or file.
    """
    from ..stores.checkpoints.named import check_name, save_named, store_dir

    run = current_run()
    name = check_name(path or run.run_key)
    if not run.is_main:
        return store_dir(run.run_dir.parent) / name
    dest = save_named(run.run_dir.parent, name, model, run_key=run.run_key, step=run.step, metadata=metadata,
                      additional_files=additional_files)
    log.info("named checkpoint %s saved at step %d: %s", name, run.step, dest)
    return dest


def last_checkpoint_path() -> Path | None:
    """The folder of the newest named checkpoint of the current run's model (written by this run or any other
    run of the model), or None when there is none yet.

    Raises:
        GwenlakeError: outside a training.
    """
    from ..stores.checkpoints.named import latest_path

    return latest_path(current_run().run_dir.parent)


def log_rollout(messages: Any, reward: float | None = None, step: int | None = None, task_id: str | None = None,
                metrics: Mapping[str, Any] | None = None, rollout_id: str | None = None) -> str:
    """Record one RL episode as an MLflow trace of the current run (see :mod:`gwenlake_hpc.stores.tracking.rollouts`).

    Args:
        messages: the conversation in the OpenAI chat format (``role``, ``content``, ``tool_calls``,
            ``tool_call_id``), checked here.
        reward: the episode's reward (a finite number), or None.
        step: the training step it belongs to (default ``run.step``).
        task_id: the task or prompt id, recorded as the tag ``gwenlake.task_id``.
        metrics: further numbers attached to the trace.
        rollout_id: 32 lowercase hex characters (default: drawn); a rollout logged again with the same id after a
            restart is not created twice.

    Returns:
        The rollout id (the trace's ``gwenlake.rollout_id`` tag).

    Raises:
        GwenlakeError: outside a training; ValueError: bad messages, reward, metrics or id (nothing recorded).
    """
    from ..stores.tracking.rollouts import rollout_entry

    run = current_run()
    entry = rollout_entry(messages, reward=reward, step=run.step if step is None else int(step), task_id=task_id,
                          metrics=metrics, rollout_id=rollout_id)
    if run.is_main:
        run.tracker.log_rollout(entry)
    return str(entry["rollout"]["id"])
