"""Submission to SLURM through submitit, with our own eviction and requeue handling.

submitit builds the sbatch script, submits it, pickles the callable and runs it in the job. Its own
preemption path does not fit ours (it ignores SIGTERM, guesses a time limit from elapsed time, and requeues
from inside its signal handler, in the middle of a step), so the callable is not "checkpointable" in its
sense: the Run installs its own handlers after submitit's, ends the loop at a step boundary, and the batch
script's teardown (:mod:`gwenlake_hpc.launch.requeue`) decides about requeueing from SLURM's own facts.
"""

from __future__ import annotations

import copy
import logging
import os
import shlex
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from ..base import rules
from ..job.config_typed import launcher_node, typed_launcher
from ..base.errors import EXIT_EVICTED, EXIT_USAGE, ConfigError, GwenlakeError
from .records import record_job

log = logging.getLogger("gwenlake_hpc.launch.slurm")



class SlurmEntry:
    """The callable submitit pickles: the resolved config as plain data, never a secret value.

    In the job it runs the training in this process (launcher ``local``, progress as log lines) and turns
    the job's exit status into submitit's terms: a result on success, an exception on failure, and
    ``SystemExit(75)`` on eviction (no result, so nobody reads it as a success).
    """

    def __init__(self, cfg: Mapping[str, Any]):
        self.cfg = dict(cfg)

    def __call__(self) -> dict[str, Any]:
        from ..runtime.signals import StopRequest, process_stop

        # Our handlers, never submitit's: SLURM may send the time-limit warning seconds after the start, and
        # submitit's own handler would end the job there ("timed-out too many times"). Started by
        # gwenlake_hpc.launch.boot, the process has had ours since its first line and submitit installs none
        # (boot.keep_our_handlers); reclaim() covers a step started otherwise.
        early = process_stop()
        if early is not None:
            early.reclaim()
            return self._run(early)
        stop = StopRequest()
        stop.install()
        try:
            return self._run(stop)
        finally:
            stop.uninstall()

    def _run(self, stop: Any) -> dict[str, Any]:
        from ..job.execute import execute

        cfg = OmegaConf.create(self.cfg)
        s = typed_launcher(cfg.launcher)  # in the job: its loop runs here, with the progress settings it had
        cfg.launcher = OmegaConf.create({"name": "local", "progress": s.progress, "progress_every_s": s.progress_every_s})
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        result = execute(cfg, stop=stop)
        if result.exit_code == 0:
            return {"version": result.version, "run_dir": str(result.run_dir), "final_step": result.final_step}
        if result.exit_code in (EXIT_EVICTED, EXIT_USAGE):  # 2: the message is logged, no traceback on top
            sys.stdout.flush()
            raise SystemExit(result.exit_code)
        raise RuntimeError(f"the training failed with exit status {result.exit_code}; see the log above")


#: Requeues when neither ``launcher.max_retries`` nor ``@train(max_retries=)`` says.
DEFAULT_MAX_RETRIES = 3


def max_retries(lc: Any) -> int:
    """``launcher.max_retries``, or :data:`DEFAULT_MAX_RETRIES` when it is null.

    Raises:
        ConfigError: a negative or non-integer value (:func:`gwenlake_hpc.base.rules.whole_number`).
    """
    value = typed_launcher(lc).max_retries
    return DEFAULT_MAX_RETRIES if value is None else value


def with_declared(lc: Any, res: Any) -> Any:
    """A copy of the launcher config ``lc`` (a DictConfig typed by the SLURM launcher's schema, see
    :func:`gwenlake_hpc.job.config_typed.launcher_node`) with the resources ``res`` declared on ``@train`` (a
    :class:`gwenlake_hpc.authoring.resources.Resources`, or None) filled in where ``lc`` leaves them null:
    ``cpus_per_task``, ``mem_gb``, ``gres`` (unless ``gpus_per_node`` is set), ``max_retries``,
    ``container.image``; ``env`` merged
    under ``launcher.env``; ``secrets`` added to ``launcher.secrets``. The job config and the command line
    therefore override the decorator.

    Raises:
        ConfigError: ``lc`` has a wrong type or an unknown key (named ``launcher.KEY``).
    """
    from ..authoring.resources import launcher_defaults

    out = launcher_node(lc)  # typed, so keys the launcher file left out can be set
    if res is None:
        return out
    for key, value in launcher_defaults(res).items():
        if key == "gres" and out.get("gpus_per_node") is not None:
            continue
        if key == "container.image":
            if OmegaConf.select(out, "container.image") is None:
                OmegaConf.update(out, "container.image", value, force_add=True)
            continue
        if out.get(key) is None:
            out[key] = value
    if res.env:
        out.env = {**res.env, **(OmegaConf.to_container(out.env) if out.get("env") else {})}
    if res.secrets:
        have = [str(s) for s in (out.get("secrets") or [])]
        out.secrets = have + [s for s in res.secrets if s not in have]
    return out


def sbatch_parameters(lc: Any, job_name: str) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters from the launcher config ``lc`` (``launcher`` or
    ``cluster.launcher``, after :func:`with_declared`), read as a :class:`SlurmLauncherConfig` whose rules
    (:mod:`gwenlake_hpc.job.config`) check every value.

    Raises:
        ConfigError: a value with control characters, a bad option name, bad numbers (named by key).
    """
    s = typed_launcher(lc)
    params: dict[str, Any] = {"job_name": job_name, "time": s.timeout_min, "nodes": s.nodes,
                              "ntasks_per_node": s.tasks_per_node, "signal_delay_s": s.signal_delay_s}
    for key in ("partition", "account", "qos", "cpus_per_task", "gpus_per_node", "gres", "constraint", "exclude"):
        if getattr(s, key) is not None:
            params[key] = getattr(s, key)
    if s.mem_gb is not None:
        params["mem"] = f"{int(float(s.mem_gb) * 1024)}M"
    params["additional_parameters"] = {"requeue": True, **{str(k): v for k, v in s.additional_parameters.items()}}
    rules.single_line("job name", job_name, "sbatch options")  # #SBATCH lines: a newline starts a shell line
    return params


#: The teardown's ``--run-dir`` in a job array: the task's entry of the list :func:`setup_lines` defines.
ARRAY_RUN_DIR = '"${gwenlake_run_dirs[$SLURM_ARRAY_TASK_ID]}"'


def shell_path(path: Path | str) -> str:
    """``path`` shell-quoted for the batch script; ``%a`` in it stands for the array task's index."""
    return '"$SLURM_ARRAY_TASK_ID"'.join(shlex.quote(part) for part in str(path).split("%a"))


def setup_lines(lc: Any, secrets_file: Path | None, array_run_dirs: Sequence[Path] | None = None) -> list[str]:
    """Shell lines run before the step: SIGTERM ignored by the shell, this start's time (``$gwenlake_started``,
    Unix seconds: the teardown counts the checkpoints sealed since), the run directory of each task of a job
    array (``array_run_dirs``, in task order), the user's ``setup``, then quoted ``export``s
    (``GWENLAKE_MAX_STARTS``: ``launcher.max_starts``, which the job checks at its start), then secrets
    (``%a`` in ``secrets_file``: the array task's index)."""
    # The batch shell and srun ignore SIGTERM: on preemption or scancel SLURM signals every step, and srun
    # answers SIGTERM by SIGKILLing its tasks at once, which would cut the training's last checkpoint short.
    # The training itself (started by slurmstepd, not by this shell) still gets SIGTERM and stops cleanly.
    s = typed_launcher(lc)  # env names checked by its rules
    lines = ["trap '' TERM", "gwenlake_started=$(date +%s)"]
    if array_run_dirs:
        lines.append("gwenlake_run_dirs=(" + " ".join(shlex.quote(str(d)) for d in array_run_dirs) + ")")
    lines += [str(line) for line in s.setup]
    lines += [f"export {name}={shlex.quote(str(value))}" for name, value in s.env.items()]
    # One thread per process unless told otherwise: jobs share nodes' cores.
    lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"')
    # The job refuses a start past the cap (a preemption's requeue is SLURM's, not the teardown's to refuse)
    lines.append(f"export GWENLAKE_MAX_STARTS={s.max_starts}")
    if secrets_file is not None:
        lines.append(f"set -a; . {shell_path(secrets_file)}; set +a")
    return lines


def check_secrets(lc: Any, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The names in ``launcher.secrets``, each set in the submitting environment ``environ``.

    Raises:
        ConfigError: a name that is not a valid variable name (the launcher's rules) or that is not set.
    """
    names = [str(n) for n in typed_launcher(lc).secrets]
    for name in names:
        if name not in environ:
            raise ConfigError(f"launcher.secrets: {name} is not set in the submitting environment; export it first")
    return names


def write_secrets(lc: Any, folder: Path, environ: Mapping[str, str] = os.environ, tasks: int = 1) -> Path | None:
    """Write the values of ``launcher.secrets`` to a new 0600 file that the job sources,
    ``<folder>/secrets-<random>.env``; for a job array of ``tasks`` > 1 tasks one file per task,
    ``secrets-<random>-<index>.env``, and the path returned has ``%a`` for the index. None if no secrets.
    The job's teardown removes its file when the job ends for good (:mod:`gwenlake_hpc.launch.requeue`).

    Raises:
        ConfigError: a name is not a valid variable name or is not set in the submitting environment.
    """
    names = check_secrets(lc, environ)
    if not names:
        return None
    lines = [f"{name}={shlex.quote(environ[name])}\n" for name in names]
    folder.mkdir(parents=True, exist_ok=True)
    # A name of its own: the end of this job removes its file, never that of a later submission of the run.
    path = folder / (f"secrets-{uuid.uuid4().hex[:12]}" + ("-%a" if tasks > 1 else "") + ".env")
    for task in range(tasks):
        one = Path(str(path).replace("%a", str(task)))
        fd = os.open(one, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.writelines(lines)
        os.chmod(one, 0o600)
    return path


def secrets_files(path: Path | None, tasks: int = 1) -> list[Path]:
    """The files :func:`write_secrets` wrote for ``path`` (one per array task when it holds ``%a``)."""
    if path is None:
        return []
    return [Path(str(path).replace("%a", str(i))) for i in range(tasks)] if "%a" in str(path) else [path]


def teardown_args(lc: Any, run_dir: Path | str | None = None, secrets: Path | None = None) -> str:
    """The requeue teardown's options after ``--max-retries`` and ``--signal-delay``: ``--max-starts``, this
    start's time, the run directory whose checkpoints tell progress (a path, or :data:`ARRAY_RUN_DIR`), the
    secrets file it removes when the job ends for good (``%a``: the array task's index)."""
    args = f"--max-starts {typed_launcher(lc).max_starts} --started \"$gwenlake_started\""
    if run_dir is not None:
        args += " --run-dir " + (run_dir if run_dir == ARRAY_RUN_DIR else shlex.quote(str(run_dir)))
    if secrets is not None:
        args += " --secrets " + shell_path(secrets)
    return args


def teardown_lines(lc: Any, python: str | None = None, run_dir: Path | str | None = None,
                   secrets: Path | None = None) -> list[str]:
    """After the step: requeue on a time limit or a killed step within the budgets, remove the secrets at the
    job's end (see requeue.py; ``run_dir`` and ``secrets`` as for :func:`teardown_args`).

    ``python`` is the interpreter on the cluster (default: this one, for submissions from the login node).
    """
    py = shlex.quote(python or sys.executable)
    return ["rc=$?",
            f"{py} -m gwenlake_hpc.launch.requeue --rc \"$rc\" --max-retries {max_retries(lc)} "
            f"--signal-delay {typed_launcher(lc).signal_delay_s} {teardown_args(lc, run_dir, secrets)}",
            "exit $?"]


@dataclass
class Submission:
    """What ``launcher=slurm`` submitted: job id, log paths, run directory."""

    job_id: str
    run_dir: Path
    stdout: Path
    stderr: Path
    folder: Path
    secrets: Path | None = None  # this job's secrets file (removed by its teardown, and by `cancel`)


#: The job step's interpreter command: our stop handlers first (gwenlake_hpc.launch.boot), then submitit's runner.
BOOT_PYTHON = f"{shlex.quote(sys.executable)} -m gwenlake_hpc.launch.boot"


def make_executor(folder: Path, params: Mapping[str, Any], setup: list[str], teardown: list[str],
                  python: str = BOOT_PYTHON, srun_args: list[str] | None = None):
    """A submitit ``SlurmExecutor`` writing its scripts and logs under ``folder`` (``%j``: the job id), with
    the sbatch ``params`` of :func:`sbatch_parameters`, our ``setup``/``teardown`` lines, the step's
    ``python`` command and ``srun_args``. submitit's own timeout requeue is off (``max_num_timeout=0``): the
    teardown decides (:mod:`gwenlake_hpc.launch.requeue`)."""
    import submitit

    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=0, python=python)
    ex.update_parameters(**params, setup=setup, teardown=teardown, stderr_to_stdout=False,
                         **({"srun_args": srun_args} if srun_args else {}))
    return ex


def container_step(lc: Any, job_cfg: Mapping[str, Any], folder: Path, write: bool,
                   others: Sequence[Mapping[str, Any]] = ()):
    """``launcher.container`` made ready for this job (None without an image); see
    :func:`gwenlake_hpc.launch.container.prepare`. ``job_cfg`` is :func:`job_container`'s (absolute paths);
    ``others``: the other tasks' of a sweep, whose roots and targets are bound too."""
    from .container import prepare

    s = typed_launcher(lc)
    gpus = bool(s.gpus_per_node or str(s.gres or "").startswith("gpu"))
    more = []
    for c in others:
        more += [v for v in c["paths"].values() if v]
        mod = str(c["job"]["target"]).rpartition(":")[0]
        if mod.endswith(".py"):
            more.append(str(Path(mod).parent))
    return prepare(lc, job_cfg["paths"], folder, Path.cwd(), job_cfg["job"]["target"], gpus_requested=gpus,
                   write=write, more_paths=more)


def step_parts(lc: Any, step: Any, secrets: Path | None,
               run_dirs: Sequence[Path] = ()) -> tuple[str, list[str], list[str], list[str]]:
    """(interpreter command, setup lines, teardown lines, srun options) with or without a container;
    ``run_dirs``: the job's run directory, or each array task's in task order."""
    array = len(run_dirs) > 1
    setup = setup_lines(lc, secrets, run_dirs if array else None)
    run_dir = ARRAY_RUN_DIR if array else (run_dirs[0] if run_dirs else None)
    if step is None:
        return BOOT_PYTHON, setup, teardown_lines(lc, run_dir=run_dir, secrets=secrets), []
    return (step.python(), setup + step.setup,
            step.teardown(max_retries(lc), typed_launcher(lc).signal_delay_s, teardown_args(lc, run_dir, secrets)),
            list(step.srun_args))


def render_script(cfg: DictConfig, run_dir: Path, tracking_uri: str | None = None) -> str:
    """The sbatch script ``launcher=slurm`` would submit (``launcher.dry_run=true`` prints it)."""
    from .sbatch_script import render_sbatch

    lc = cfg.launcher
    s = typed_launcher(lc)
    folder = Path(s.folder) if s.folder else run_dir / "slurm"
    params = sbatch_parameters(s, job_name=_job_name(cfg, run_dir))
    secrets = folder / "secrets-<random>.env" if s.secrets else None
    step = container_step(lc, job_container(cfg, tracking_uri), folder, write=False)
    python, setup, teardown, srun_args = step_parts(lc, step, secrets, [run_dir])
    command = f"{python} -u -m submitit.core._submit {shlex.quote(str(folder / '%j'))}"
    return render_sbatch(command, folder / "%j", params, setup=setup, teardown=teardown, srun_args=srun_args)


def _job_name(cfg: DictConfig, run_dir: Path) -> str:
    return f"gwenlake:{run_dir.parent.name}:{run_dir.name}"


def submit(cfg: DictConfig) -> Submission | None:
    """Submit the job described by ``cfg`` (launcher ``slurm``); None for a dry run (script printed).

    Raises:
        ConfigError: bad launcher values, missing secrets, a job config error found at planning.
        GwenlakeError: ``sbatch`` failed (its message is included).
    """
    from ..job.plan import plan
    from ..job.resume import resume_point
    from ..stores.tracking import is_sqlite

    p = plan(cfg)
    resume_point(p)  # refused here, not after hours in the queue
    cfg = copy.deepcopy(cfg)
    cfg.launcher = with_declared(cfg.launcher, p.tf.resources)  # @train(cpu=, memory=, gpu=...) under launcher.*
    lc = cfg.launcher
    if p.tracking_uri and is_sqlite(p.tracking_uri):
        log.warning("tracking.uri is SQLite (%s): SQLite on a shared filesystem is not safe for many concurrent "
                    "jobs; use an MLflow server (tracking.uri=http://host:5000)", p.tracking_uri)
    s = typed_launcher(lc)
    if s.dry_run:
        check_secrets(s)
        print(render_script(cfg, p.run_dir, p.tracking_uri))
        return None
    folder = Path(s.folder) if s.folder else p.run_dir / "slurm"
    params = sbatch_parameters(s, job_name=_job_name(cfg, p.run_dir))
    check_secrets(lc)
    container = job_container(cfg, p.tracking_uri)
    container_step(lc, container, folder, write=False)  # refuse a bad container before writing anything
    made = next((d for d in [*reversed(folder.parents), folder] if not d.exists()), None)  # the first we create
    folder.mkdir(parents=True, exist_ok=True)
    secrets = None
    try:
        secrets = write_secrets(lc, folder)
        python, setup, teardown, srun_args = step_parts(lc, container_step(lc, container, folder, write=True),
                                                        secrets, [p.run_dir])
        ex = make_executor(folder / "%j", params, setup, teardown, python=python, srun_args=srun_args)
        try:
            job = ex.submit(SlurmEntry(container))
        except Exception as exc:  # submitit raises on sbatch errors with sbatch's message
            raise GwenlakeError(f"sbatch failed: {exc}") from exc
    except BaseException:
        if secrets is not None:  # no job will source it
            secrets.unlink(missing_ok=True)
        if made is not None:  # nothing submitted: what this call created goes (a resubmission's logs stay)
            shutil.rmtree(made, ignore_errors=True)
        raise
    sub = Submission(job.job_id, p.run_dir, Path(job.paths.stdout), Path(job.paths.stderr), folder, secrets)
    record_job(p, sub, container["job"]["target"])
    return sub


def submit_training(target: str, overrides: Sequence[str], job: str | None = None):
    """``TrainFunction.submit``: compose the config of ``target`` (or of ``conf/job/<job>.yaml``) with
    ``launcher=slurm`` and ``overrides``, submit it, return a :class:`gwenlake_hpc.launch.status.JobHandle`.

    Raises:
        ConfigError: a bad override or launcher value, or ``launcher.dry_run=true``. GwenlakeError: sbatch failed.
    """
    from hydra import compose, initialize_config_dir

    from ..job.config import conf_dir, register
    from .status import JobHandle

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    base = [f"+job={job}"] if job else [f"job.target={target}"]
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*base, "launcher=slurm", *overrides])
    except (HydraException, OmegaConfBaseException) as exc:  # a bad override: a usage error, as on the command line
        said = [str(e).strip().splitlines()[0] for e in (exc, exc.__cause__) if e is not None and str(e).strip()]
        raise ConfigError(": ".join(said) or type(exc).__name__) from None
    name = cfg.launcher.get("name", "local")  # a launcher file without its schema may leave it out
    if name != "slurm":
        raise ConfigError(f"launcher.name={name}: fit.submit() submits to SLURM; drop the override, or give "
                          "name: slurm in conf/launcher/slurm.yaml (fit.local() runs in this process)")
    sub = submit(cfg)
    if sub is None:
        raise ConfigError("launcher.dry_run=true submits nothing; drop it to get a handle")
    return JobHandle(sub.job_id, sub.run_dir, secrets=sub.secrets)


def job_container(cfg: DictConfig, tracking_uri: str | None, fill_model_repo: bool = True) -> dict[str, Any]:
    """The config a job receives: plain data, paths made absolute (the job may start elsewhere), no Hydra node.

    An unset ``paths.model_repo`` becomes the default model repository (:func:`default_model_repo`), unless
    ``fill_model_repo`` is False (a sweep looks it up once for all its tasks).
    """
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    container["paths"] = {k: (str(Path(v).expanduser().resolve()) if v else v) for k, v in container["paths"].items()}
    if not container["paths"].get("model_repo") and fill_model_repo:
        from ..stores.versioning import default_model_repo

        container["paths"]["model_repo"] = str(default_model_repo(Path.cwd()))
    container["job"]["target"] = _absolute_target(container["job"]["target"])
    if container.get("tracking", {}).get("uri") is None and tracking_uri:
        container["tracking"]["uri"] = tracking_uri
    return container


def _absolute_target(target: str) -> str:
    mod, _, name = target.rpartition(":")
    if mod.endswith(".py"):
        return f"{Path(mod).expanduser().resolve()}:{name}"
    return target
