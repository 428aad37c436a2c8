"""The current run of this process, for code that is not handed ``run`` (a metrics helper, a callback):
:func:`current_run`, :func:`log_metrics`, :func:`checkpoint` (named checkpoints), :func:`last_checkpoint_path`,
:func:`log_rollout`; :func:`active` makes a Run current while the training function runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
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

    In a job of several ranks it is a collective: call it on every rank, with the same arguments, as
    ``save_state``. The arguments are checked on every rank and a refusal on any rank is raised on all of them
    (no rank goes on into a collective the others left); a sharded model (FSDP2's DTensors) is gathered tensor
    by tensor into one full file written by rank 0 (every rank takes part); an FSDP1 model's full state dict is
    gathered by FSDP1 one unit at a time into rank 0's host memory and written by rank 0 (every rank takes
    part); a plain model is written by rank 0 alone; every rank then learns how rank 0's write ended, and
    returns or raises with it.

    Args:
        model: an ``nn.Module`` (its state_dict) or a state_dict; stored as ``model.safetensors``.
        path: the checkpoint's name (default: the run key); letters, digits, ``_ . -``.
        metadata: JSON-able values kept in ``checkpoint.json`` with the run key and step.
        additional_files: files copied beside the weights (read on rank 0).

    Returns:
        The checkpoint's folder ``<runs_root>/<model name>/named/<path>/``, on every rank.

    Raises:
        GwenlakeError: outside a training (``GWENLAKE_RUN_ID`` unset). ConfigError: a bad name, metadata or file,
            on any rank (every rank raises it, naming the rank). CheckpointError: rank 0 could not write it (every
            rank raises it).
    """
    from ..base.errors import CheckpointError, ConfigError
    from ..stores.checkpoints.named import begin_named, check_named, seal_named, store_dir, write_named_model
    from ..stores.checkpoints.sharded import holds_dtensors, is_sharded_model

    run = current_run()
    d = run.dist
    refusal, name = None, str(path or run.run_key)
    try:
        name, meta, files = check_named(name, metadata, additional_files)
    except ConfigError as exc:
        refusal = str(exc)
    refusal = _agree_to_save(d, name, refusal)
    if refusal is not None:
        raise ConfigError(refusal)
    model_root = run.run_dir.parent
    # FSDP1 too: every rank takes part in its full state dict's gather (rank 0 keeps it, in host memory)
    sharded = is_sharded_model(model) or isinstance(model, Mapping) and holds_dtensors(dict(model))
    failure, tmp = None, None
    if run.is_main:
        try:
            tmp = begin_named(model_root)
        except OSError as exc:
            failure = f"{type(exc).__name__}: {exc}"
    # Every rank knows rank 0 has its folder before a collective write begins (none waits in a gather alone).
    failure = d.broadcast(failure)
    if failure is None:
        try:
            if run.is_main or sharded:  # the others take part in a sharded model's gathers; they write nothing
                write_named_model(tmp if tmp is not None else store_dir(model_root) / name, model)
            if run.is_main:
                dest = seal_named(tmp, model_root, name, run_key=run.run_key, step=run.step, meta=meta, files=files)
        except (OSError, CheckpointError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        failure = d.broadcast(failure)
    if failure is not None:
        raise CheckpointError(f"named checkpoint {name!r}: rank 0 could not write it ({failure}); nothing was put "
                              "in place")
    dest = store_dir(model_root) / name
    if run.is_main:
        log.info("named checkpoint %s saved at step %d: %s", name, run.step, dest)
    return dest


#: The name this call gives itself in :meth:`Dist.where_all` (the job's end gives ``"end"``).
CALL = "gwenlake_hpc.checkpoint"


def _agree_to_save(d: Any, name: str, refusal: str | None) -> str | None:
    """What every rank says before a named checkpoint is written: None to go on, or the one refusal every rank
    raises (a collective in a job of several ranks).

    Refused: a rank's own refusal of its arguments (the first, naming its rank); another rank that is not in
    this call (it reached the end of its function, or another call of ours: ``if run.is_main:`` around it);
    ranks that gave other names."""
    if not d.enabled:
        return refusal
    everyone = d.where_all((CALL, name, refusal))
    absent = [r for r, w in enumerate(everyone) if w[:1] != (CALL,)]
    if absent:
        return (f"gwenlake_hpc.checkpoint({name!r}) is a collective: rank(s) {', '.join(map(str, absent))} did not "
                f"call it ({everyone[absent[0]][0]} instead); call it on every rank, not under `if run.is_main:`")
    for r, (_call, _name, said) in enumerate(everyone):
        if said:
            return f"{said} (refused on rank {r}: every rank stops here)"
    names = {w[1] for w in everyone}
    if len(names) > 1:
        given = ", ".join(f"rank {r}: {w[1]!r}" for r, w in enumerate(everyone))
        return f"gwenlake_hpc.checkpoint: the ranks gave different names ({given}); give every rank the same path"
    return None


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
