"""Sweeps as SLURM job arrays: every task planned (its own run directory), all submitted with one sbatch."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from ..job.config_typed import typed_launcher
from ..base.errors import ConfigError, GwenlakeError
from . import status as slurm_status
from .slurm import (SlurmEntry, Submission, make_executor, step_parts, check_secrets, container_step,
                    job_container, record_job, sbatch_parameters, secrets_files, with_declared, write_secrets)

log = logging.getLogger("gwenlake_hpc.launch.sweep")

#: The tasks of the last sweep this process submitted (see :func:`submit_array`), for the command line's exit
#: status: Hydra's multirun has no status of its own for "submitted, not waited for".
LAST_SWEEP: list[dict[str, Any]] | None = None


def sweep_exit_status(tasks: Sequence[dict[str, Any]]) -> int:
    """0 when every task COMPLETED or was only submitted (no wait), 1 when any ended otherwise."""
    return 1 if any(t.get("state") not in (None, "COMPLETED") for t in tasks) else 0


def submit_array(configs: Sequence[tuple[list[str], DictConfig]]) -> list[dict[str, Any]]:
    """Submit one job array for the sweep tasks ``[(overrides, composed config), ...]``.

    Launcher settings (resources, time limit, retries) must be the same for every task: they are one array.

    Returns:
        One dict per task: ``job_id`` (``<array id>_<index>``), ``run_dir``, ``overrides``; with
        ``launcher.wait=true`` also ``state``, ``restarts`` and ``metrics`` once every task ended.

    Raises:
        ConfigError: tasks with different launcher settings, or a task's config error (nothing submitted).
        GwenlakeError: sbatch failed.
    """
    from ..job.plan import PlanCache, plan
    from ..job.resume import resume_point

    if not configs:
        return []
    cache = PlanCache()  # one sweep's tasks read the same datasets
    plans = [plan(cfg, cache) for _, cfg in configs]  # every task checked before anything is submitted
    for p in plans:
        resume_point(p)
    lc = with_declared(configs[0][1].launcher, plans[0].tf.resources)  # @train(cpu=, memory=, gpu=...) under launcher.*
    runs_root = plans[0].runs_root
    s = typed_launcher(lc)
    folder = Path(s.folder) if s.folder else runs_root / ".arrays" / time.strftime("%Y%m%d-%H%M%S")
    params = sbatch_parameters(lc, job_name=f"gwenlake-sweep:{plans[0].model_name}")
    check_secrets(lc)
    containers = [job_container(cfg, p.tracking_uri, fill_model_repo=False) for (_, cfg), p in zip(configs, plans)]
    # the plain configs hold each task's launcher settings already (converting each node again costs ~1 ms)
    if len({json.dumps(c["launcher"], sort_keys=True, default=str) for c in containers}) > 1:
        raise ConfigError("a sweep is one job array: launcher.* must be the same for every task")
    unset = [c for c in containers if not c["paths"].get("model_repo")]
    if unset:  # looked up once, not per task (it may create <cwd>/models)
        from ..stores.versioning import default_model_repo

        repo = str(default_model_repo(Path.cwd()))
        for c in unset:
            c["paths"]["model_repo"] = repo
    container_step(lc, containers[0], folder, write=False, others=containers[1:])  # refused before writing
    if s.dry_run:
        return _dry_run(configs, plans, lc)
    folder.mkdir(parents=True, exist_ok=True)
    # one secrets file per task (several tasks: submitit submits an array), each removed when its task ends
    secrets = write_secrets(lc, folder, tasks=len(containers))
    try:
        step = container_step(lc, containers[0], folder, write=True, others=containers[1:])  # one image, one bundle
        python, setup, teardown, srun_args = step_parts(lc, step, secrets, [p.run_dir for p in plans])
        ex = make_executor(folder / "%j", params, setup, teardown, python=python, srun_args=srun_args)
        try:
            with ex.batch():
                jobs = [ex.submit(SlurmEntry(c)) for c in containers]
        except Exception as exc:
            raise GwenlakeError(f"sbatch failed: {exc}") from exc
    except BaseException:
        for path in secrets_files(secrets, len(containers)):  # nothing submitted: no task will source them
            path.unlink(missing_ok=True)
        raise
    tasks = []
    for (overrides, _), p, job, c in zip(configs, plans, jobs, containers):
        task_secrets = Path(str(secrets).replace("%a", job.job_id.rpartition("_")[2])) if secrets else None
        sub = Submission(job.job_id, p.run_dir, Path(job.paths.stdout), Path(job.paths.stderr), folder, task_secrets)
        record_job(p, sub, c["job"]["target"], overrides)
        tasks.append({"job_id": job.job_id, "run_dir": str(p.run_dir), "overrides": overrides})
    array_id = tasks[0]["job_id"].split("_")[0]
    print(f"submitted job array {array_id} ({len(tasks)} tasks, one sbatch); logs in {folder}")
    print_table(tasks)
    if s.wait:  # every task waited for (one failure does not stop the others), one poll for the array
        for t, final in zip(tasks, slurm_status.wait_array(tasks)):
            t.update(state=final.state, restarts=final.restarts, step=final.step, metrics=_metrics(final),
                     goodput=_goodput(final))
        print_table(tasks)
        failed = [t["job_id"] for t in tasks if t["state"] != "COMPLETED"]
        if failed:
            log.error("%d of %d task(s) did not complete: %s", len(failed), len(tasks), ", ".join(failed))
    global LAST_SWEEP
    LAST_SWEEP = tasks
    return tasks


def _dry_run(configs: Sequence[tuple[list[str], DictConfig]], plans: Sequence[Any],
             lc: DictConfig) -> list[dict[str, Any]]:
    """``launcher.dry_run=true`` for a sweep: every task checked, the array's tasks and the batch script of its
    first task printed; nothing written, nothing submitted. Returns the tasks (no job id, no state)."""
    import copy

    from .slurm import render_script

    first = copy.deepcopy(configs[0][1])
    first.launcher = lc
    print(f"# dry run: a job array of {len(configs)} task(s) (sbatch --array=0-{len(configs) - 1}) would be submitted; "
          "each task runs this script with its own overrides; nothing was submitted")
    print(render_script(first, plans[0].run_dir, plans[0].tracking_uri))
    tasks = [{"job_id": f"dry-run_{i}", "run_dir": str(p.run_dir), "overrides": overrides, "state": None}
             for i, ((overrides, _), p) in enumerate(zip(configs, plans))]
    print_table([{k: v for k, v in t.items() if k != "state"} | {"state": "DRY-RUN"} for t in tasks])
    global LAST_SWEEP
    LAST_SWEEP = tasks
    return tasks


def _metrics(final: slurm_status.JobStatus) -> dict[str, float]:
    if final.checkpoint is None:
        return {}
    from ..stores.checkpoints import CheckpointStore

    store = CheckpointStore(final.run_dir / "checkpoints", final.run_dir.name)
    best: dict[str, float] = {}
    for ck in store.complete():
        for k, v in ck.metrics.items():
            best[k] = max(best.get(k, v), v)
    return best


def _goodput(final: slurm_status.JobStatus) -> float | None:
    """The task's goodput (kept step time / allocated time, its ledger's), None without a ledger."""
    from ..runtime import ledger as ledgers

    if final.run_dir is None:
        return None
    return ledgers.summarize(ledgers.read_ledger(final.run_dir)).get("goodput")


def print_table(tasks: list[dict[str, Any]]) -> None:
    """One line per task: job id, state, restarts, goodput (once the task ended: kept step time / allocated
    time, from its ledger), best checkpoint metrics, the overrides that vary."""
    common = set.intersection(*(set(t["overrides"]) for t in tasks)) if len(tasks) > 1 else set()
    print(f"{'TASK':>12}  {'STATE':<11} {'RESTARTS':>8} {'GOODPUT':>7}  {'METRICS':<28} OVERRIDES")
    for t in tasks:
        varying = [o for o in t["overrides"] if o not in common]
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted((t.get("metrics") or {}).items()))
        restarts = "" if t.get("restarts") is None else t["restarts"]
        goodput = "" if t.get("goodput") is None else f"{t['goodput']:.2f}"
        print(f"{t['job_id']:>12}  {t.get('state', 'SUBMITTED'):<11} {restarts:>8} {goodput:>7}  {metrics or '-':<28} "
              f"{' '.join(varying)}")
