"""One job, from a resolved config to a committed model version.

config -> plan (:mod:`gwenlake_hpc.job.plan`: the function, its bindings, the run key and run directory) -> Run
(+ tracking) -> the function -> commit of the Output (or, when evicted, nothing but a checkpoint and a
non-success exit status).

This module owns the job's sequence and its failures: the start limit, the ranks' set-up and teardown, the
resume point, tracking and the hang watchdog of this start, the training function's call (again after a damaged
checkpoint) and each failure turned into its exit code. It takes its parts from:

- :mod:`.run_lock`: the run's lock and lease (one start trains a run at a time);
- :mod:`.start_record`: ``run.json`` (the run's record, this start's entry), SLURM facts and queue times, the
  goodput ledger;
- :mod:`.node_local`: this run's folder on the node-local checkpoint level, and the sweep of other runs' folders;
- :mod:`.finish`: the end of a start (commit, lineage, registration).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from ..authoring.api import Input, Model
from ..stores.checkpoints import DamagedFileError
from ..runtime.distributed import Dist
from ..runtime.distributed import setup as setup_distributed
from ..runtime.distributed import MISMATCHED
from ..runtime.distributed import teardown as teardown_distributed
from ..base.errors import (EXIT_EVICTED, EXIT_FAILED, EXIT_USAGE, ConfigError, NonFiniteError, RendezvousError,
                           StartLimitError, as_config_error)
from .finish import JobResult, Start, finish
from .arguments import bind_arguments
from .node_local import local_level, sweep_local_levels
from .output_dir import entries, output_dir
from .plan import JobPlan, open_inputs, plan
from .resume import finished_with, resume_point, retry_after_damaged_load
from .run_lock import RunLock
from .start_record import record_first_step, record_start, run_record, slurm_facts, start_ledger
from ..base.processes import shield_children
from ..runtime import ledger as ledgers
from ..runtime.signals import StopInterrupt, StopRequest
from ..stores.tracking import NullTracker, Tracker, flatten, is_sqlite, state_dir_for, user_mlflow
from ..stores.registry import complete_pending_registrations
from ..stores.tracking.custom_metrics import configure as configure_statsd
from ..stores.versioning import code_state, export_version

if TYPE_CHECKING:
    from ..runtime.run import Run

log = logging.getLogger("gwenlake_hpc.job")

EXIT_INTERRUPTED = 130


# --- the job -------------------------------------------------------------------------------------------------

def execute(cfg: DictConfig | Mapping[str, Any], *, stop: StopRequest | None = None) -> JobResult:
    """Run one job described by a composed config (see :class:`gwenlake_hpc.job.config.GwenlakeConfig`).

    Never raises for expected failures: they become the exit code, with the reason logged.
    """
    try:
        check_start_limit(os.environ)
    except StartLimitError as exc:
        log.error("%s", exc)
        return JobResult(exc.exit_code)
    stop = stop or StopRequest()
    try:
        stop.arm()  # until the plan is made: a stop signal ends the start-up at once (see StopRequest.arm)
        return _execute(cfg, stop)
    except StopInterrupt as exc:
        stop.disarm()
        log.warning("stop requested (%s) during the start-up: this start ends now (exit %d), having trained "
                    "nothing; the checkpoints are kept: run the same job again to resume", exc, EXIT_EVICTED)
        return JobResult(EXIT_EVICTED)
    except ConfigError as exc:
        log.error("%s", exc)
        return JobResult(EXIT_USAGE)
    except RendezvousError as exc:  # a rank never joined: one line, not the store's traceback
        log.error("%s", exc)
        return JobResult(exc.exit_code)
    except OmegaConfBaseException as exc:
        log.error("config error: %s", exc)
        return JobResult(EXIT_USAGE)


def check_start_limit(environ: Mapping[str, str]) -> None:
    """Refuse a start past ``launcher.max_starts``: the batch script exports it as ``GWENLAKE_MAX_STARTS``, and
    SLURM numbers starts with ``SLURM_RESTART_COUNT`` (0 on the first). Outside such a job (either unset or not a
    number): nothing to check.

    Raises:
        StartLimitError: ``SLURM_RESTART_COUNT + 1 > GWENLAKE_MAX_STARTS``.
    """
    cap, restarts = environ.get("GWENLAKE_MAX_STARTS", ""), environ.get("SLURM_RESTART_COUNT", "0") or "0"
    if cap.isdigit() and restarts.isdigit() and int(restarts) + 1 > int(cap):
        raise StartLimitError(
            f"this is start {int(restarts) + 1} of SLURM job {environ.get('SLURM_JOB_ID', '?')} and "
            f"launcher.max_starts={cap} caps all starts (SLURM requeued it itself: a preemption or a lost node): "
            "not training. Its checkpoints are kept: submit the same job again to resume, with a higher "
            "launcher.max_starts if it should go on by itself")


def _execute(cfg: Any, stop: StopRequest) -> JobResult:
    d = setup_distributed()  # a single process unless SLURM (or torchrun) started several tasks
    try:
        result = _execute_rank(cfg, stop, d)
    except Exception as exc:
        teardown_distributed(d, ok=False)
        lost = d.lost_peer(exc, "during the start-up")  # a rank gone before the training function began
        if lost is None:
            raise
        log.error("%s", lost)
        return JobResult(EXIT_FAILED)
    except BaseException:
        teardown_distributed(d, ok=False)
        raise
    # A start stopped before its loop leaves at once: the other ranks may be in their loop's collectives.
    left = teardown_distributed(d, ok=result.exit_code in (0, EXIT_EVICTED) and not stop.interrupted)
    if left == MISMATCHED:  # gwenlake_hpc.checkpoint on another rank alone: a misuse, named in the log
        return JobResult(EXIT_USAGE, result.version, result.run_dir, result.final_step)
    if not left and result.exit_code == 0:  # a rank gone at the very end: no rank reports success
        return JobResult(EXIT_FAILED, result.version, result.run_dir, result.final_step)
    return result


def _execute_rank(cfg: Any, stop: StopRequest, d: Dist) -> JobResult:
    if not d.is_main:
        d.barrier()  # rank 0 plans first: a prepare hook materialises the data once, not once a rank
    p = plan(cfg)  # imports the user's module: still interruptible (armed by execute)
    stop.disarm()  # the job's own set-up (lock, run.json, tracking) records a stop; _train acts on it
    statsd = p.settings.statsd
    configure_statsd(statsd.host, statsd.port, statsd.prefix)  # exported to child processes
    p.run_dir.mkdir(parents=True, exist_ok=True)
    out = output_dir(p.run_dir, d.rank)
    kwargs = bind_arguments(p.tf, out, open_inputs(p),  # the revisions the plan read, or a ConfigError
                            lambda name, b: _initial_model(p, name, b, d))
    if not d.is_main:
        return _execute_locked(p, kwargs, stop, d)  # rank 0 holds the run's lock for all ranks
    d.barrier()
    job = p.settings.job  # one start per run directory: a second one would fork the history
    lock = RunLock(p.run_dir, job.lease_wait_s, float(job.lease_timeout_s), on_lost=stop.request)
    try:
        return _execute_locked(p, kwargs, stop, d)
    finally:
        lock.release()


def _initial_model(p: JobPlan, name: str, b: Model, d: Dist) -> tuple[Path, str]:
    """The folder of the planned version of ``Model`` binding ``name`` (exported by rank 0 once) and its version."""
    version = p.model_versions[name].rsplit("@", 1)[1]
    dest = p.run_dir / "init_models" / name / version
    if d.is_main and not dest.exists():
        export_version(p.model_repo(create=False), b.name, version, dest)
    return dest, version


def _execute_locked(p: JobPlan, kwargs: dict[str, Any], stop: StopRequest, d: Dist) -> JobResult:
    info_path = p.run_dir / "run.json"
    info = run_record(p, info_path)
    done = finished_with(info, p.steps, p.epochs)
    if done is not None:
        return _already_finished(p, done, d)
    # job.resume=never, job.steps below the newest checkpoint, a newest checkpoint this node cannot see yet
    local = local_level(p, info)
    point = resume_point(p, float(p.settings.checkpoint.visible_wait_s), local, repair=d.is_main)
    if d.is_main:
        log.info("resume point: %s", point.why)
        if local is not None:
            sweep_local_levels(local)
    past = ledgers.summarize(ledgers.read_ledger(p.run_dir))  # the earlier starts (before this one's file exists)
    container = record_start(p, info, info_path, d)
    ledger = start_ledger(p, info, d)
    code = code_state(Path(sys.modules[p.tf.fn.__module__].__file__ or ".").resolve().parent
                      if getattr(sys.modules.get(p.tf.fn.__module__), "__file__", None) else Path.cwd())
    reporting = _open_tracking(p, info, code, container, d)
    start = Start(reporting.tracker, info, info_path, code, stop, p.settings.tracking.finish_timeout_s, {},
                  ledger=ledger, mtbf_s=_mtbf(p, past, ledger))
    reason = ledgers.FAILURE
    try:
        result = _train(p, kwargs, d, reporting, start)
        reason = _end_reason(result.exit_code, stop)
        return result
    finally:
        if ledger is not None:
            ledger.end(reason, stop.received_at, stop.reason)


def _mtbf(p: JobPlan, past: Mapping[str, Any], ledger: Any) -> Any:
    """M for ``job.eval_every=auto`` (seconds): the run's allocated time, this start's so far included, over
    its unannounced interruptions (a kill, a lost node, a hang), or ``job.mtbf_h`` until it has seen one."""
    default_s = float(p.settings.job.mtbf_h) * 3600.0
    seen, allocated = int(past.get("unannounced") or 0), float(past.get("allocated_s") or 0.0)
    if not seen:
        return lambda: default_s
    return lambda: (allocated + (ledger.now() if ledger is not None else 0.0)) / seen


def _end_reason(exit_code: int, stop: StopRequest) -> str:
    """The ledger's end reason of a start that returned ``exit_code``. A stop by SIGUSR2 (the job's
    ``--signal`` ahead of its time limit) is the time limit; any other stop signal an eviction."""
    import signal

    if exit_code == 0:
        return ledgers.FINISHED
    if exit_code in (EXIT_EVICTED, EXIT_INTERRUPTED):
        return ledgers.TIME_LIMIT if stop.signum == signal.SIGUSR2 else ledgers.EVICTED
    return ledgers.FAILURE


def _already_finished(p: JobPlan, done: Mapping[str, Any], d: Dist) -> JobResult:
    """A rerun of a run that committed a version for these steps/epochs: nothing trains, its version is printed."""
    log.info("run %s already finished at step %s; nothing to train", p.run_dir, done.get("final_step"))
    if d.is_main and p.tracking_on:
        _complete_pending_registrations(state_dir_for(p.run_dir, p.tracking_uri), p.tracking_uri)
    if d.is_main:
        print(f"model {p.model_name} version {done['version']}", flush=True)
    return JobResult(0, done["version"], p.run_dir, done.get("final_step"))


@dataclass
class _Reporting:
    """Where this rank's points go: the tracker, and for MLflow's own API the state folder or why it is off."""

    tracker: Any
    reports: bool
    state_dir: Path | None
    off_reason: str


def _open_tracking(p: JobPlan, info: Mapping[str, Any], code: Any, container: Mapping[str, Any] | None,
                   d: Dist) -> _Reporting:
    """The tracker of this start: rank 0 alone reports (a :class:`Tracker` with the run's tags), the other ranks
    and a job without tracking get a :class:`NullTracker` and the reason."""
    if not (p.tracking_on and d.is_main):
        off_reason = (f"rank {d.rank}: only rank 0 reports to MLflow" if p.tracking_on else
                      "tracking is off for this job (tracking=False or job.tracking=false)")
        return _Reporting(NullTracker(), False, None, off_reason)
    tags = _tracking_tags(p, info, code, container)
    tracking_uri = p.tracking_uri
    artifact_location = (p.runs_root / "mlartifacts" / p.model_name).as_uri() if is_sqlite(tracking_uri) else None
    state_dir = state_dir_for(p.run_dir, tracking_uri)
    # Versions an earlier start committed but could not register: the delivery process registers them
    # once the run is attached (the job hands tracking the registry's function: tracking imports no registry).
    pending = complete_pending_registrations if (state_dir / "pending_registrations.json").is_file() else None
    tracker = Tracker(tracking_uri, p.model_name, p.key, state_dir,
                      params=flatten({"params": p.params, "seed": p.seed}), tags=tags,
                      artifact_location=artifact_location,
                      flush_interval_s=p.settings.tracking.flush_interval_s, after_attach=pending)
    tracker.set_tags(tags)
    return _Reporting(tracker, True, state_dir, "")


def _tracking_tags(p: JobPlan, info: Mapping[str, Any], code: Any,
                   container: Mapping[str, Any] | None) -> dict[str, str]:
    """The MLflow run's tags: ``@train(metadata={...})``, then ours (``gwenlake.*``, ``slurm.*``), which win.
    ``gwenlake.restarts``: the earlier starts of ``run.json`` that reached their loop (``first_step`` set)."""
    tags = dict(p.tf.resources.metadata)
    # Restarts: the earlier starts that began a loop. One that trained nothing (refused with exit 2, failed in its
    # set-up: first_step null) is none; one recorded before first_step existed trained.
    tags.update({"gwenlake.run_key": p.key, "gwenlake.target": p.tf.target, "gwenlake.host": socket.gethostname(),
                 "gwenlake.restarts": str(sum(s.get("first_step", 0) is not None for s in info["starts"][:-1]))})
    tags.update({f"gwenlake.dataset.{n}": v for n, v in p.datasets.items()})
    tags.update({f"gwenlake.init_model.{n}": v for n, v in p.model_versions.items()})
    if code.commit:
        tags.update({"gwenlake.code_commit": code.commit, "gwenlake.code_dirty": str(code.dirty).lower()})
    if os.environ.get("GWENLAKE_CODE_PATCH_SHA256"):
        tags["gwenlake.code_patch_sha256"] = os.environ["GWENLAKE_CODE_PATCH_SHA256"]
    if container:
        tags.update({f"gwenlake.container.{k}": str(v) for k, v in container.items() if v})
    tags.update({f"slurm.{k[6:].lower()}": v for k, v in slurm_facts().items()})
    return tags


def _train(p: JobPlan, kwargs: dict[str, Any], d: Dist, reporting: _Reporting, start: Start) -> JobResult:
    """Build the Run, call the training function (again from the previous checkpoint when the one it resumed
    from proves damaged while loading), then :func:`finish`; a failure ends the tracker's run and becomes the
    exit code (a :class:`ConfigError` is raised on, for exit 2)."""
    tf, tracker, stop, finish_timeout = p.tf, reporting.tracker, start.stop, start.finish_timeout
    # torch comes with the Run: planning and submitting a job (the launchers) never load it
    from ..runtime.current import active as active_run
    from ..runtime.rng import seed_everything
    from ..runtime.run import Run

    heartbeat, watchdog = _start_watchdog(p, d, reporting.state_dir, start.ledger)

    def make_run() -> Run:
        # Rank r draws from seed + r: dropout and augmentation differ across ranks (DDP copies rank 0's initial
        # parameters to all); the data order comes from the run seed alone, so the shards fit together.
        seed_everything(p.seed + d.rank)
        launcher = p.settings.launcher
        try:
            return Run(run_dir=p.run_dir, run_key=p.key, steps=p.steps, epochs=p.epochs, eval_every=p.eval_every,
                       seed=p.seed, tracker=tracker, stop=stop, resume=p.resume, on_nonfinite=p.on_nonfinite,
                       progress=launcher.progress, progress_every_s=launcher.progress_every_s, dist=d,
                       heartbeat=heartbeat, slow_rank_factor=float(p.settings.job.slow_rank_factor),
                       on_loop_start=lambda first: record_first_step(start, first, d), ledger=start.ledger,
                       mtbf_s=start.mtbf_s, max_eval_interval_s=float(p.settings.job.max_eval_interval_s),
                       local_dir=local_level(p, start.info), shared_wait_s=float(p.settings.checkpoint.shared_wait_s))
        except BaseException:
            tracker.close()
            raise

    try:
        run = make_run()
    except BaseException:
        _stop_watchdog(heartbeat, watchdog)
        raise
    # Under the lock: what an unfinished start left in the Output, removed before the commit if still untouched.
    start.output_before = entries(output_dir(p.run_dir, d.rank))
    # a point MLflow records at step 0 (no step given) goes to the loop's current step; a short fit has no loop
    current_step = (lambda: 0) if getattr(tf, "is_short", False) else (lambda: run.step)
    if tf.wants_config:
        kwargs["config"] = p.config_obj
    installed = stop.install()
    try:  # handlers kept through the commit and tracking's finish: a SIGTERM there only sets the flag
        try:
            while True:
                kwargs["run"] = run
                try:
                    # gwenlake_hpc.log_metrics(), GWENLAKE_RUN_ID, and MLflow's own API into the job's run
                    with active_run(run), user_mlflow.reporting(tracker if reporting.reports else None,
                                                                reporting.state_dir, current_step,
                                                                reporting.off_reason):
                        with _watched(heartbeat):
                            stop.arm()  # the function before its loop: a stop ends it at once (the Run disarms)
                            result = tf.fn(**kwargs)
                            stop.disarm()
                    run.wait_for_checkpoint()  # a background write that failed fails the job here
                    break
                except DamagedFileError as exc:
                    if not retry_after_damaged_load(run, exc):
                        raise
                    run = make_run()  # from the previous intact checkpoint, the function started afresh
        except StopInterrupt as exc:
            stop.disarm()
            log.warning("stop requested (%s) before the training loop began: this start ends now (exit %d), having "
                        "trained nothing; its checkpoints (if any) are kept: run the same job again to resume", exc,
                        EXIT_EVICTED)
            run.wait_for_checkpoint(raise_error=False)
            tracker.finish("KILLED", timeout_s=min(finish_timeout, 20.0))
            return JobResult(EXIT_EVICTED, None, p.run_dir, run.step)
        except KeyboardInterrupt:
            stop.disarm()
            log.error("interrupted at step %d; the newest complete checkpoint is kept", run.step)
            tracker.finish("KILLED", timeout_s=min(finish_timeout, 10.0))
            return JobResult(EXIT_INTERRUPTED, None, p.run_dir, run.step)
        except ConfigError:
            _end_failed(run, tracker, finish_timeout)
            raise
        except NonFiniteError as exc:
            log.error("%s", exc)
            return _end_failed(run, tracker, finish_timeout)
        except Exception as exc:
            refusal = as_config_error(exc)  # a framework's refusal of a setting (an integration's translator)
            if refusal is not None:
                _end_failed(run, tracker, finish_timeout)
                raise refusal from None
            lost = d.lost_peer(exc, f"at step {run.step}")  # a rank died: one line naming it, not gloo's chain
            if lost is not None and stop.requested:  # it left on the same stop as this rank: an eviction
                log.warning("%s (stop requested here too: %s)", lost, stop.reason)
                run.wait_for_checkpoint(raise_error=False)
                tracker.finish("KILLED", timeout_s=min(finish_timeout, 20.0))
                return JobResult(EXIT_EVICTED, None, p.run_dir, run.step)
            if lost is not None:
                log.error("%s", lost)
                log.debug("the collective's error:\n%s", traceback.format_exc())
            else:
                log.error("the training function raised at step %d:\n%s", run.step, traceback.format_exc())
            return _end_failed(run, tracker, finish_timeout)
        with shield_children():  # git, the registry: SLURM's signals must not kill the children of the commit
            start.inputs = {n: kwargs[n] for n, b in tf.bindings.items() if isinstance(b, Input)}
            return finish(p, run, result, start)
    finally:
        if installed:
            stop.uninstall()
        _stop_watchdog(heartbeat, watchdog)


@contextlib.contextmanager
def _watched(heartbeat: Any) -> Iterator[None]:
    """The training function's call, watched from its start (start-up counts from here, not from the job's own
    preparation) to its end (after it, returned or raised, nothing is: a failure's or an interrupt's tracking
    finish is no hang)."""
    if heartbeat is None:
        yield
        return
    from ..runtime.heartbeat import DONE, STARTING

    heartbeat.phase(STARTING)
    try:
        yield
    finally:
        heartbeat.phase(DONE)


def _stop_watchdog(heartbeat: Any, watchdog: Any) -> None:
    if watchdog is not None:
        watchdog.stop()
        heartbeat.close()
        heartbeat.path.unlink(missing_ok=True)


def _start_watchdog(p: JobPlan, d: Dist, state_dir: Path | None, ledger: Any = None) -> tuple[Any, Any]:
    """This rank's heartbeat and hang watchdog (:mod:`gwenlake_hpc.job.watchdog`), or ``(None, None)`` when
    ``job.hang_timeout_s=0`` or the function is a short fit (no loop to beat). ``state_dir``: the tracking
    state folder where this rank reports (a hang's verdict goes to the MLflow run through it), else None;
    ``ledger``: this start's goodput ledger (rank 0), where a hang is recorded as the start's end."""
    rule = p.hang_rule
    if not rule.enabled or getattr(p.tf, "is_short", False):
        return None, None
    from ..runtime.heartbeat import Heartbeat, heartbeat_dir
    from .watchdog import Watchdog, heartbeat_name, sweep_leftovers

    sweep_leftovers(p.run_dir, p.key, d.is_main)  # before the broadcast: no rank's files of this start exist yet
    heartbeat = Heartbeat(heartbeat_dir() / heartbeat_name(p.key, d.rank))
    started = d.broadcast(time.strftime("%Y%m%d-%H%M%S"))  # one hangs/<start>/ folder for all ranks
    try:
        return heartbeat, Watchdog(rule, p.run_dir, d.rank, heartbeat.path, started, d.world_size, state_dir,
                                   ledger.path if ledger is not None else None)
    except BaseException:
        heartbeat.close()
        heartbeat.path.unlink(missing_ok=True)
        raise


def _end_failed(run: Run, tracker: Any, finish_timeout: float) -> JobResult:
    """A training that raised: the checkpoint in flight is still sealed, the tracker's run ends FAILED."""
    run.wait_for_checkpoint(raise_error=False)
    tracker.finish("FAILED", timeout_s=finish_timeout)
    return JobResult(EXIT_FAILED, None, run.run_dir, run.step)


def _complete_pending_registrations(state_dir: Path, tracking_uri: str) -> None:
    """A rerun of a finished job: deliver what its end could not (points, status) and register the versions it
    committed but could not register."""
    from ..stores.registry import PENDING_REGISTRATIONS
    from ..stores.tracking import sync
    from ..stores.tracking.delivery.spool import segment_paths

    if not ((state_dir / PENDING_REGISTRATIONS).is_file() or (state_dir / "pending_status").is_file()
            or segment_paths(state_dir)):
        return
    log.info("delivering what the end of this run left in %s", state_dir)
    try:
        sync(state_dir, uri=tracking_uri, timeout_s=30.0)  # the run, if it was never created
    except ConfigError as exc:
        log.warning("could not sync %s: %s", state_dir, exc)
        return
    if (state_dir / PENDING_REGISTRATIONS).is_file():
        complete_pending_registrations(state_dir, tracking_uri)
