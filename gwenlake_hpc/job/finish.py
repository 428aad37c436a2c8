"""The end of a job's start: an eviction's exit status, or the checks of the result, the lineage and the commit
of the model version, its registration and ``candidate`` alias.

:func:`finish` is called by :mod:`gwenlake_hpc.job.execute` once the training function returned. Imports the stores
(versions, registry, tracking through the tracker it is handed), never a launcher.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from omegaconf import DictConfig, OmegaConf

from .. import __version__
from ..base.errors import EXIT_EVICTED, EXIT_FAILED, ConfigError
from ..base.fsutil import write_json_atomic
from ..base.lease import check_fence
from .output_dir import drop_unfinished
from .plan import JobPlan
from ..stores.registry import after_commit, complete_pending_registrations, serving_info, warn_if_pending
from ..runtime.signals import StopRequest
from ..stores.versioning import commit_model, find_run_version

if TYPE_CHECKING:
    from ..runtime.run import Run

log = logging.getLogger("gwenlake_hpc.job")

#: MLflow run tag of an evicted run: the step its start stopped at (the run is KILLED until a start resumes it).
EVICTED_TAG = "gwenlake.evicted_at_step"
#: What :data:`EVICTED_TAG` becomes once the run finished: the step of its last eviction, as history.
LAST_EVICTED_TAG = "gwenlake.last_evicted_at_step"


@dataclass
class JobResult:
    """What a job ended with.

    Attributes:
        exit_code: 0 success, 2 usage/config error, 75 evicted (resume later), 1 failure, 130 forced interrupt.
        version: the model version (commit SHA) when one was committed or found.
        run_dir: the run directory, when one was made.
        final_step: the last step completed.
    """

    exit_code: int
    version: str | None = None
    run_dir: Path | None = None
    final_step: int | None = None



@dataclass
class Start:
    """What one start of a job holds besides its plan and its Run.

    Attributes:
        tracker: the MLflow tracker (a NullTracker with tracking off or on ranks other than 0).
        info: the run's record (``run.json``), this start appended.
        info_path: where ``info`` is written (``<run_dir>/run.json``).
        code: the code state (commit, dirty flag) the version's lineage names.
        stop: the stop flag the signal handlers set.
        finish_timeout: seconds the end waits for tracking (``tracking.finish_timeout_s``).
        inputs: the Input datasets the function was given, by parameter name, set once it returned (their
            schema goes into the version's serving info).
        ledger: this start's goodput ledger (:class:`gwenlake_hpc.runtime.ledger.StartLedger`, rank 0), or None.
        mtbf_s: gives M for ``job.eval_every=auto`` (seconds), or None.
        output_before: the Output's entries as this start found them (:func:`.output_dir.entries`): those still
            untouched are removed before the commit.
    """

    tracker: Any
    info: dict[str, Any]
    info_path: Path
    code: Any
    stop: StopRequest
    finish_timeout: float
    inputs: dict[str, Any]
    ledger: Any = None
    mtbf_s: Any = None
    output_before: dict = field(default_factory=dict)


def finish(p: JobPlan, run: Run, result: Any, start: Start) -> JobResult:
    """The end of a start of plan ``p``, after the training function returned ``result`` with ``run``.

    An eviction: the tracker marks the run KILLED, exit 75. Otherwise the result is checked (a dict of numbers,
    or None for ``run.summary()``) and the Output must hold a file; the version is committed with its metrics
    and lineage (or found, when an earlier start committed it and died before recording it), then registered,
    ``candidate`` moved and pushed (:func:`gwenlake_hpc.stores.registry.after_commit`, which only warns), ``run.json``
    records the completion and the tracker marks the run FINISHED. Ranks other than 0 only report.

    Returns:
        The :class:`JobResult`: 0 with the version, 75 evicted, 1 when nothing could be committed.

    Raises:
        ConfigError: the function returned something other than a dict of numbers or None.
    """
    tracker, finish_timeout = start.tracker, start.finish_timeout
    if not run.is_main:  # rank 0 commits; the others only report how the loop ended
        return JobResult(EXIT_EVICTED if run.evicted else 0, None, p.run_dir, run.step)
    if run.evicted:
        check_fence("ending this start as evicted")  # a start that lost its run exits 2: not requeued
        log.warning("evicted at step %d (%s); newest checkpoint: %s; run the same job again to resume",
                    run.step, start.stop.reason, run.checkpoint_level)
        tracker.set_tags({EVICTED_TAG: str(run.step)})
        goodput_totals(p, run, start, evicted=True)
        tracker.finish("KILLED", timeout_s=min(finish_timeout, 20.0))
        return JobResult(EXIT_EVICTED, None, p.run_dir, run.step)
    drop_unfinished(p.run_dir / "output", start.output_before)  # a version holds only this start's files
    metrics = _checked_metrics(p, run, result, start)
    if metrics is None:
        return JobResult(EXIT_FAILED, None, p.run_dir, run.step)
    tracker.log_metrics(metrics, run.step)
    if p.tracking_on and tracker.run_id is None:  # short runs, a slow store: the version should name its run
        tracker.wait_attached(min(finish_timeout, 30.0))
    lineage = _lineage(p, run, start)
    lineage["goodput"] = goodput_totals(p, run, start)
    check_fence(f"committing the version of {p.model_name} at step {run.step}")  # a start that lost its run
    committed = _commit(p, run, metrics, lineage, start)
    if committed is None:
        tracker.finish("FAILED", timeout_s=finish_timeout)
        return JobResult(EXIT_FAILED, None, p.run_dir, run.step)
    repo, version = committed
    run.release_local_level()  # the version is committed: no node needs this run's local checkpoints now
    # Registry, alias 'candidate', push: each failure only logs a warning (after_commit never raises).
    # The MLflow registration is deferred to the delivery process (MLflow is loaded there, not here).
    _complete(p, run, start, after_commit(
        repo=repo, model_name=p.model_name, version=version, out_dir=p.run_dir / "output", lineage=lineage,
        tracking_uri=p.tracking_uri if p.tracking_on else None, run_id=tracker.run_id if p.tracking_on else None,
        metrics=metrics, state_dir=tracker.state_dir if p.tracking_on else None, defer=p.tracking_on), version)
    return JobResult(0, version, p.run_dir, run.step)


def goodput_totals(p: JobPlan, run: Run, start: Start, evicted: bool = False) -> dict[str, Any] | None:
    """The run's goodput ledger added up over its starts, this one ending now (finished, or evicted), logged
    to the MLflow run as ``goodput/*`` at the run's step (``goodput/goodput`` 0..1, ``goodput/<part>_s``
    seconds, ``goodput/lost_steps``, ``goodput/starts``, ``goodput/unannounced``) and returned for the
    version's lineage (:func:`gwenlake_hpc.runtime.ledger.summarize`). None without a ledger (rank 0 keeps it)."""
    from ..runtime import ledger as ledgers

    if start.ledger is None:
        return None
    start.ledger.flush()
    recs = ledgers.read_ledger(p.run_dir)
    if recs:
        recs[-1]["end"] = ledgers.EVICTED if evicted else ledgers.FINISHED
        if evicted and start.stop.received_at is not None:  # this start's drain so far (its end adds the rest)
            recs[-1]["drain_s"] = max(0.0, time.monotonic() - start.stop.received_at)
    totals = ledgers.summarize(recs)
    values = {f"goodput/{k}": float(totals[k]) for k in ("allocated_s", *ledgers.PARTS, "lost_steps", "starts",
                                                          "unannounced", "drain_s")}
    if totals["goodput"] is not None:
        values["goodput/goodput"] = float(totals["goodput"])
    start.tracker.log_metrics(values, run.step)
    return totals


def _checked_metrics(p: JobPlan, run: Run, result: Any, start: Start) -> dict[str, float] | None:
    """The version's metrics: the function's dict of numbers, or ``run.summary()`` for None. None (the run
    ended FAILED) when the Output holds no file.

    Raises:
        ConfigError: ``result`` is neither a dict of numbers nor None (the run ended FAILED).
    """
    tracker, finish_timeout, tf = start.tracker, start.finish_timeout, p.tf
    if result is not None and not isinstance(result, Mapping):
        tracker.finish("FAILED", timeout_s=finish_timeout)
        raise ConfigError(f"{tf.target} returned {type(result).__name__} {str(result)[:80]!r}: return a dict of "
                          "numbers (the model's metrics), or None for run.summary(); nothing is committed, and the "
                          "same job resumes from its final checkpoint once the function is fixed")
    if not any(f.is_file() for f in (p.run_dir / "output").rglob("*")):
        log.error("%s wrote no file into its Output: nothing is committed (a version without a model is no use). "
                  "Save the model with output.file(NAME), then run the same job again: it resumes from its final "
                  "checkpoint", tf.target)
        tracker.finish("FAILED", timeout_s=finish_timeout)
        return None
    metrics = result if isinstance(result, Mapping) else run.summary()
    try:
        return {str(k): float(v) for k, v in metrics.items()}
    except (TypeError, ValueError) as exc:
        tracker.finish("FAILED", timeout_s=finish_timeout)
        raise ConfigError(f"{tf.target} returned {result!r}: return a dict of numbers (or None)") from exc


def _lineage(p: JobPlan, run: Run, start: Start) -> dict[str, Any]:
    """The version's ``lineage.json``: what produced it (data, initial models, code, config, starts, packages)."""
    code, info, tracker = start.code, start.info, start.tracker
    return {
        "model": p.model_name, "run_name": p.run_name, "run_key": p.key, "target": p.tf.target,
        "datasets": p.dataset_facts, "init_models": p.model_versions,
        "code": {"commit": code.commit, "dirty": code.dirty, "repo": str(code.repo_root) if code.repo_root else None,
                 **_code_patch()},
        "config": {"params": p.params, "seed": p.seed, "steps": p.steps, "epochs": p.epochs,
                   "eval_every": p.eval_every},
        # run_id None: not attached in time; state_dir/run_id names it once it exists (models register).
        "tracking": {"run_id": tracker.run_id, "experiment": p.model_name, "state_dir": str(tracker.state_dir)}
        if p.tracking_on else None,
        "final_step": run.step,
        "starts": info["starts"],
        # the image of the start that finished the training (each start's is in starts[])
        "container": info["starts"][-1].get("container") if info["starts"] else None,
        "packages": _package_versions(),
        # SLURM job ids of every start (a requeue keeps the id; a resubmission gets a new one)
        "slurm_jobs": sorted({s["SLURM_JOB_ID"] for s in info["starts"] if s.get("SLURM_JOB_ID")}),
        "job_config": OmegaConf.to_container(p.cfg.job, resolve=True) if isinstance(p.cfg, DictConfig) else None,
        "serving": serving_info(p.tf, start.inputs),  # predict entry point and input schema, for load_model
    }


def _commit(p: JobPlan, run: Run, metrics: Mapping[str, float], lineage: Mapping[str, Any],
            start: Start) -> tuple[Any, str] | None:
    """Commit ``<run_dir>/output`` as a version of the model (or find the one an earlier start committed at this
    step and died before recording). Returns ``(repository, version SHA)``, or None when it could not be
    committed (logged, with the command that commits the files kept)."""
    code, out_dir, model_name = start.code, p.run_dir / "output", p.model_name
    try:
        repo = p.model_repo()
        same_repo = code.repo_root is not None and Path(repo.working_dir).resolve() == code.repo_root.resolve()
        # A start killed between its commit and run.json committed this very version already: use it.
        run_ref = f"{p.key}/{start.info['uid']}@{run.step}"
        version = find_run_version(repo, model_name, run_ref)
        if version is not None:
            log.warning("version %s of this run at step %d was committed by an earlier start that ended before "
                        "recording it; using it (no second commit)", version[:12], run.step)
            return repo, version
        return repo, commit_model(
            repo, model_name, out_dir, run=run_ref,
            message=f"{model_name}: {p.run_name} at step {run.step}\n\n"
                    + "".join(f"{k}: {v:.6g}\n" for k, v in sorted(metrics.items())),
            code_commit=code.commit if same_repo else None,
            extra_files={"metrics.json": (json.dumps(finite_json(metrics), indent=2, sort_keys=True, allow_nan=False)
                                          + "\n").encode(),
                         "lineage.json": (json.dumps(finite_json(lineage), indent=2, sort_keys=True, default=str,
                                                     allow_nan=False) + "\n").encode()},
        )
    except Exception as exc:
        log.error("the model could not be committed (%s); its files are kept in %s: once the cause is fixed, run "
                  "the same job again (it resumes at its last step and commits them with the run's lineage), or "
                  "commit them by hand, without it, with `python -m gwenlake_hpc models commit %s %s`", exc,
                  out_dir, out_dir, model_name)
        return None


def _complete(p: JobPlan, run: Run, start: Start, deferred: bool, version: str) -> None:
    """Record a committed version: its tags, the completion in ``run.json``, the tracker's run FINISHED."""
    tracker, info = start.tracker, start.info
    tracker.set_tags({"gwenlake.version": version})
    # a FINISHED run is not evicted: an earlier start's eviction stays as history under another name
    tracker.rename_tags({EVICTED_TAG: LAST_EVICTED_TAG})
    info["completed"] = {"steps": p.steps, "epochs": p.epochs, "final_step": run.step, "version": version,
                         "time": time.time()}
    info.setdefault("completions", []).append(info["completed"])
    check_fence("recording the completion in run.json")
    write_json_atomic(start.info_path, info)
    tracker.finish("FINISHED", timeout_s=min(start.finish_timeout, 5.0) if start.stop.requested
                   else start.finish_timeout, after_finish=complete_pending_registrations if deferred else None)
    if deferred:
        warn_if_pending(tracker.state_dir, p.model_name, version)
    print(f"model {p.model_name} version {version}", flush=True)


def finite_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by its name (``"nan"``, ``"inf"``, ``"-inf"``):
    JSON has no such numbers, and Python's ``NaN`` token makes the file unreadable to other parsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _code_patch() -> dict[str, Any]:
    """The uncommitted diff a remote submission applied on top of the commit (``cluster.allow_dirty``), if any.

    From ``GWENLAKE_CODE_PATCH`` (the diff file on the cluster) and ``GWENLAKE_CODE_PATCH_SHA256``, set by the
    job script that :mod:`gwenlake_hpc.launch.remote` renders; the diff text itself goes into the lineage.
    """
    path = os.environ.get("GWENLAKE_CODE_PATCH")
    if not path:
        return {}
    try:
        diff = Path(path).read_text(errors="replace")
    except OSError as exc:
        log.warning("the code patch %s named by GWENLAKE_CODE_PATCH cannot be read (%s)", path, exc)
        diff = None
    return {"patch": {"path": path, "sha256": os.environ.get("GWENLAKE_CODE_PATCH_SHA256"), "diff": diff}}


def _package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "gwenlake_hpc": __version__}
    for name in ("torch", "numpy", "h5py", "safetensors", "mlflow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out
