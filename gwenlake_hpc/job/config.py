"""Structured configs registered in Hydra's ConfigStore, so a wrong key or type fails before anything runs.

``conf/config.yaml`` starts from the schema ``gwenlake_schema`` registered here; ``conf/job/<name>.yaml``
files fill the ``job`` node (``+job=churn``).

Here: the schemas (one dataclass a section, each ``__post_init__`` checking its values with
:mod:`gwenlake_hpc.base.rules`), their registration and the config directory. A composed config becomes these
dataclasses in :mod:`gwenlake_hpc.job.config_typed` (``typed``); the config files' checks before Hydra and the
composed config's unknown keys are :mod:`gwenlake_hpc.job.config_files`'.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..base import rules
from ..base.errors import ConfigError
from ..base.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S
from ..runtime.interval import AUTO, DEFAULT_MAX_INTERVAL_S, DEFAULT_MTBF_H

#: ``launcher.progress`` values: a tqdm bar on a terminal and log lines otherwise, or one of them, or none.
PROGRESS_MODES = ("auto", "bar", "lines", "off")
#: ``launcher.container.runtime`` values (null: chosen from the image).
CONTAINER_RUNTIMES = ("apptainer", "singularity", "oci")
#: The longest ``launcher.timeout_min`` accepted: a year (SLURM shows larger limits as INVALID).
MAX_TIMEOUT_MIN = 365 * 24 * 60
#: ``launcher.name`` values, and the schema each one's settings follow.
LAUNCHERS = ("local", "slurm")


class Resume(str, Enum):
    """``auto``: continue from the newest complete checkpoint of the run; ``never``: refuse if one exists."""

    auto = "auto"
    never = "never"


class OnNonFinite(str, Enum):
    """``stop``: a non-finite loss ends the run with exit 1 (default); ``warn``: log a warning and go on."""

    stop = "stop"
    warn = "warn"


@dataclass
class PathsConfig:
    """Where data, runs and models live.

    Attributes:
        data_root: catalog root; dataset ``crm.churn-train`` is ``<data_root>/crm/churn-train.h5``.
        runs_root: run directories ``<runs_root>/<model name>/<run key>/`` (put it on the shared filesystem).
        model_repo: git repository receiving model versions; default: the repository around the working
            directory, else ``./models`` (created).
    """

    data_root: str = "data"
    runs_root: str = "runs"
    model_repo: Optional[str] = None


@dataclass
class CheckpointConfig:
    """How a start finds the run's checkpoints on a shared filesystem (:mod:`gwenlake_hpc.stores.checkpoints.store`).

    Attributes:
        visible_wait_s: seconds a start waits for the newest checkpoint that the run's pointer
            (``checkpoints/LATEST.json``, written at each seal) names but this node's cached listing does not
            show yet (NFS ``actimeo`` up to 60 s, FUSE ``cache_timeout``); past it the server does not have it:
            the pointer is damaged, set aside, and the start resumes from the newest intact checkpoint (a damaged
            manifest it names is set aside at once). 90 by default; 0: no wait.
        local_dir: a node-local disk or RAM disk (absolute path) for the first level of checkpoints
            (:mod:`gwenlake_hpc.stores.checkpoints.levels`): sealed there, then copied to the run directory in the
            background. None (the default): ``$SLURM_TMPDIR`` where it is set, else off; ``off``: off.
        shared_wait_s: seconds after a stop signal during which the end of the loop waits for the copy of the
            newest local checkpoint to the shared level (20 by default: SLURM's default KillWait is 30 s); past
            it the start exits, and the log says which level holds the newest checkpoint.
    """

    visible_wait_s: float = 90.0
    local_dir: Optional[str] = None
    shared_wait_s: float = 20.0

    def __post_init__(self) -> None:
        rules.positive_seconds("checkpoint.visible_wait_s", self.visible_wait_s, allow_zero=True)
        if self.visible_wait_s is None:
            raise ConfigError("checkpoint.visible_wait_s=None: must be a number of seconds >= 0 (90 by default)")
        rules.positive_seconds("checkpoint.shared_wait_s", self.shared_wait_s, allow_zero=True)
        if self.shared_wait_s is None:
            raise ConfigError("checkpoint.shared_wait_s=None: must be a number of seconds >= 0 (20 by default)")
        if self.local_dir is not None and (not isinstance(self.local_dir, str) or self.local_dir != "off" and
                                           not Path(self.local_dir).is_absolute()):
            raise ConfigError(f"checkpoint.local_dir={self.local_dir!r}: must be an absolute path to a node-local "
                              "disk or RAM disk (e.g. /tmp/ckpt), off, or null ($SLURM_TMPDIR where set)")

    def local_level(self, environ: Mapping[str, str] | None = None) -> Path | None:
        """The node-local level's folder where this process runs: ``local_dir``, else ``$SLURM_TMPDIR`` (when set
        and absolute), else None (off)."""
        if self.local_dir == "off":
            return None
        if self.local_dir is not None:
            return Path(self.local_dir)
        tmp = (os.environ if environ is None else environ).get("SLURM_TMPDIR") or ""
        return Path(tmp) if tmp and Path(tmp).is_absolute() else None


@dataclass
class TrackingConfig:
    """MLflow tracking.

    Attributes:
        uri: tracking URI; default ``sqlite:///<runs_root>/mlflow.db``. ``http(s)://`` for a server.
        flush_interval_s: seconds between two writes of the spool by the training (and deliveries by the
            delivery process); 1000 waiting points trigger one sooner.
        finish_timeout_s: seconds the end of a job waits for undelivered points before leaving them to
            ``python -m gwenlake_hpc tracking sync``.
    """

    uri: Optional[str] = None
    flush_interval_s: float = 2.0
    finish_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        rules.positive_seconds("tracking.flush_interval_s", self.flush_interval_s)
        rules.positive_seconds("tracking.finish_timeout_s", self.finish_timeout_s, allow_zero=True)


@dataclass
class StatsdConfig:
    """Where ``gwenlake_hpc.log_custom_metric`` sends its gauges (StatsD over UDP, DogStatsD tags).

    Attributes:
        host: the StatsD agent's host; None: ``$STATSD_HOST``, and without it custom metrics are off.
        port: its UDP port; None: ``$STATSD_PORT``, else 8125.
        prefix: metric names are ``<prefix>.custom_metrics.<name>``; None: ``$STATSD_PREFIX``, else
            ``gwenlake``.
    """

    host: Optional[str] = None
    port: Optional[int] = None
    prefix: Optional[str] = None

    def __post_init__(self) -> None:
        from ..stores.tracking.custom_metrics import check_settings

        check_settings(self.host, self.port, self.prefix)


@dataclass
class JobConfig:
    """One training job.

    Attributes:
        target: the decorated function, ``package.module:function`` or ``path/to/file.py:function``.
        steps, epochs, eval_every, seed, model, tracking: override the decorator's settings (None keeps them).
        resume: ``auto`` or ``never``.
        on_nonfinite: ``stop`` (a NaN or infinite loss ends the run with exit 1) or ``warn``.
        hang_timeout_s: the hang watchdog (:mod:`gwenlake_hpc.job.watchdog`): ``auto`` (derived from the run's
            step times, never below 300 s), seconds, or 0 (off).
        slow_rank_factor: a rank slower than the median rank by this factor for 3 evaluations in a row is
            warned about once, naming its host (:mod:`gwenlake_hpc.runtime.ranks`); 0: no warning.
        eval_every: a whole number of steps, or ``auto``: chosen from the run's measurements
            (:mod:`gwenlake_hpc.runtime.interval`: sqrt(2 C M), C the cost of an evaluation step, M the mean
            time between unannounced interruptions).
        mtbf_h: with ``eval_every=auto``, M in hours until the run has seen an unannounced interruption (24).
        max_eval_interval_s: with ``eval_every=auto``, the longest interval between two evaluations (1800 s).
        lease_timeout_s: seconds a start's lease of its run may go without renewal before the next start breaks
            it (:mod:`gwenlake_hpc.base.lease`; renewed every quarter of it). 60 by default.
        lease_wait_s: seconds a start waits for the run's lease held by a live start before it exits 2; None:
            0 for a first start, ``max(180, 2 x lease_timeout_s)`` for a requeued SLURM start.
        params: hyperparameters passed as ``config`` (checked against the function's dataclass if annotated).
    """

    target: str = MISSING
    steps: Optional[int] = None
    epochs: Optional[int] = None
    eval_every: Any = None
    seed: Optional[int] = None
    model: Optional[str] = None
    tracking: Optional[bool] = None
    resume: Resume = Resume.auto
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    hang_timeout_s: Any = "auto"
    slow_rank_factor: float = 1.5
    mtbf_h: Any = DEFAULT_MTBF_H
    max_eval_interval_s: Any = DEFAULT_MAX_INTERVAL_S
    lease_timeout_s: Any = DEFAULT_LEASE_TIMEOUT_S
    lease_wait_s: Any = None
    params: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # 0 steps would commit an untrained model as a version (and move `candidate` to it).
        rules.whole_number("job.steps", self.steps, 1, "(a training of 0 steps trains nothing)")
        rules.whole_number("job.epochs", self.epochs)
        if self.eval_every != AUTO:
            rules.whole_number("job.eval_every", self.eval_every, why="(or auto: chosen from the run's step and "
                               "checkpoint times)")
        rules.positive_number("job.mtbf_h", self.mtbf_h, "hours: the mean time between unannounced "
                              f"interruptions job.eval_every=auto assumes until it has measured one ({DEFAULT_MTBF_H:g} "
                              "by default)")
        rules.positive_number("job.max_eval_interval_s", self.max_eval_interval_s, "seconds: the longest interval "
                              f"job.eval_every=auto chooses ({DEFAULT_MAX_INTERVAL_S:g} by default)")
        rules.positive_number("job.lease_timeout_s", self.lease_timeout_s, "seconds a run's lease may go without "
                              f"renewal before the next start breaks it ({DEFAULT_LEASE_TIMEOUT_S:g} by default)")
        # renewed every quarter of it: below a second the renewals would flood the server; above a day a lost
        # node's run would wait that long (and a huge number overflows the renewing thread's timer)
        if not 1 <= self.lease_timeout_s <= 86400:
            raise ConfigError(f"job.lease_timeout_s={self.lease_timeout_s!r}: must be between 1 and 86400 seconds "
                              f"({DEFAULT_LEASE_TIMEOUT_S:g} by default)")
        if self.lease_wait_s is not None:
            rules.positive_seconds("job.lease_wait_s", self.lease_wait_s, allow_zero=True)
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(f"job.steps={self.steps} and job.epochs={self.epochs} are both set: keep one "
                              "(e.g. job.steps=null)")
        if self.seed is not None:
            rules.seed("job.seed", self.seed)
        rules.choice("job.resume", self.resume, [r.value for r in Resume], "auto continues, never refuses a rerun")
        rules.choice("job.on_nonfinite", self.on_nonfinite, [o.value for o in OnNonFinite],
                     "stop: a NaN loss ends the run")
        from .watchdog import hang_rule

        hang_rule(self.hang_timeout_s)
        rules.factor_above_one("job.slow_rank_factor", self.slow_rank_factor, "1.5 by default")


@dataclass
class LauncherConfig:
    """How the job runs. ``local`` (the default): in this process, as a plain loop.

    Attributes:
        name: the launcher (``local`` or ``slurm``).
        progress: ``auto`` (bar on a terminal, log lines otherwise), ``bar``, ``lines`` or ``off``.
        progress_every_s: seconds between progress lines.
    """

    name: str = "local"
    progress: str = "auto"
    progress_every_s: float = 30.0

    def __post_init__(self) -> None:
        rules.choice("launcher.name", self.name, LAUNCHERS, "local: in this process; slurm: submitted")
        rules.choice("launcher.progress", self.progress, PROGRESS_MODES)
        rules.positive_seconds("launcher.progress_every_s", self.progress_every_s)


@dataclass
class ContainerConfig:
    """The container image the job step runs in (``launcher.container``; read by
    :mod:`gwenlake_hpc.launch.container`). No image: the step runs in the node's own environment.

    Attributes:
        image: an Apptainer/Singularity image (a ``.sif`` file, or a ``docker://``, ``oras://``, ``library://``
            reference that the runtime pulls), or an OCI bundle directory (``config.json`` and a root file
            system) for SLURM's ``--container``. Default: ``@train(image=)``, else none.
        runtime: ``apptainer``, ``singularity`` or ``oci``; null: ``oci`` for a directory, else ``apptainer``.
        binds: more host paths to bind, ``SRC[:DST[:ro|rw]]``; the runs, data and model-repository roots,
            the job's log folder and the submitting directory are bound already.
        gpu: pass the node's GPUs in (``--nv`` for Apptainer; the NVIDIA container toolkit's hook for OCI);
            null: when the job asks for GPUs (``gpus_per_node``, ``gres``, ``@train(gpu=)``).
        env: environment variables set inside the container (over the job's own, which pass through).
        python: the interpreter inside the image that has gwenlake_hpc installed.
        pin: refuse a requeued start whose image differs from the previous start's (default: warn).
    """

    image: Optional[str] = None
    runtime: Optional[str] = None
    binds: List[str] = field(default_factory=list)
    gpu: Optional[bool] = None
    env: Dict[str, str] = field(default_factory=dict)
    python: str = "python3"
    pin: bool = False

    def __post_init__(self) -> None:
        if self.runtime is not None:
            rules.choice("launcher.container.runtime", self.runtime, CONTAINER_RUNTIMES,
                         "or null to choose from the image")
        if not str(self.python).strip() or any(c.isspace() or ord(c) < 32 for c in str(self.python)):
            raise ConfigError(f"launcher.container.python={self.python!r}: give one interpreter path or name, "
                              "e.g. python3")
        for name, value in self.env.items():
            rules.env_name(f"launcher.container.env.{name}", name)
            if any(ord(c) < 32 for c in str(value)):
                raise ConfigError(f"launcher.container.env.{name}: give a single-line value")
        for bind in self.binds:
            rules.single_line("launcher.container.binds", bind)
        # the image's path is written into the batch script's setup lines (its identity) and the step's command
        rules.single_line("launcher.container.image", self.image, "the sbatch script")


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """Submission to SLURM through submitit (``launcher=slurm``); see conf/launcher/slurm.yaml.

    Attributes:
        partition, account, qos, constraint, exclude: as sbatch's options of the same names.
        timeout_min: time limit of each attempt (minutes).
        nodes, tasks_per_node, cpus_per_task: as sbatch's ``--nodes``, ``--ntasks-per-node``,
            ``--cpus-per-task``.
        gpus_per_node: GPUs per node (``--gpus-per-node``); or ``gres`` such as ``gpu:a100:2``.
        mem_gb: memory per node in GB.
        signal_delay_s: seconds before the time limit at which SLURM sends SIGUSR2 (``--signal``).
        max_retries: starts in a row that sealed no newer checkpoint and still get requeued after a time limit or
            a killed job step (a start that advanced the checkpoint resets the count; preemptions are requeued
            by SLURM); null: ``@train(max_retries=)``, else 3.
        max_starts: starts of one job in all, progress or not (the last one is not requeued).
        cpus_per_task, mem_gb, gres, env, secrets left null/empty take what ``@train(cpu=, memory=, gpu=, env=,
        secrets=)`` declared (:mod:`gwenlake_hpc.authoring.resources`).
        setup: shell lines run in the job before the training (module load, environment activation).
        additional_parameters: further sbatch options, e.g. ``{mail-type: END}``.
        env: environment variables for the job (not secret: they appear in the script).
        secrets: names of environment variables read from the submitting environment at submission and
            passed through a 0600 file, never through the script, logs, params, tags or commits.
        folder: where submitit keeps scripts and logs; default ``<run_dir>/slurm``.
        container: the container image the step runs in (:class:`ContainerConfig`).
        wait: block until the job ends and report its result.
        dry_run: print the sbatch script that would be submitted, submit nothing.
    """

    name: str = "slurm"
    progress: str = "lines"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    timeout_min: int = 60
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    gres: Optional[str] = None
    mem_gb: Optional[float] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    signal_delay_s: int = 120
    max_retries: Optional[int] = None
    max_starts: int = 100
    setup: List[str] = field(default_factory=list)
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    env: Dict[str, str] = field(default_factory=dict)
    secrets: List[str] = field(default_factory=list)
    folder: Optional[str] = None
    container: ContainerConfig = field(default_factory=ContainerConfig)
    wait: bool = False
    dry_run: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        rules.whole_number("launcher.timeout_min", self.timeout_min, 1, "(minutes; a year at most)",
                           maximum=MAX_TIMEOUT_MIN + 1)
        if not isinstance(self.signal_delay_s, int) or not 1 <= self.signal_delay_s < self.timeout_min * 60:
            raise ConfigError(f"launcher.signal_delay_s={self.signal_delay_s}: must be between 1 and the time limit "
                              f"({self.timeout_min * 60} s)")
        rules.whole_number("launcher.max_retries", self.max_retries, 0)
        rules.whole_number("launcher.max_starts", self.max_starts, 1, "(starts of one job in all; 1: never requeued)")
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node"):
            rules.whole_number(f"launcher.{key}", getattr(self, key), 1,
                               "(or null for the cluster's default)" if key not in ("nodes", "tasks_per_node") else "")
        if self.mem_gb is not None and not (math.isfinite(self.mem_gb) and self.mem_gb * 1024 >= 1):
            # sbatch takes whole MiB, and --mem=0 would mean all of the node's memory
            raise ConfigError(f"launcher.mem_gb={self.mem_gb}: must be a finite number of GB, at least 1/1024 "
                              "(1 MiB), or null for the cluster's default")
        for key in ("partition", "account", "qos", "gres", "constraint", "exclude"):
            rules.single_line(f"launcher.{key}", getattr(self, key), "sbatch options")
        # the log folder is an #SBATCH --output line: a newline there would start a directive or a command
        rules.single_line("launcher.folder", self.folder, "the sbatch script's #SBATCH --output and --error lines")
        rules.gres("launcher.gres", self.gres)
        for name in self.env:
            rules.env_name(f"launcher.env.{name}", name)
        for name in self.secrets:
            rules.env_name("launcher.secrets", name)
        for k, v in self.additional_parameters.items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]*", str(k)):
                raise ConfigError(f"launcher.additional_parameters: {k!r} is not an sbatch option name "
                                  "(e.g. mail-type)")
            if not isinstance(v, (str, int, float, bool)):
                raise ConfigError(f"launcher.additional_parameters.{k}: give a single value, not {type(v).__name__}")
            rules.single_line(f"launcher.additional_parameters.{k}", v, "sbatch options")


@dataclass
class ClusterConfig:
    """A remote SLURM cluster reached over SSH (``cluster=NAME``, ``conf/cluster/NAME.yaml``).

    No password field on purpose: authentication is by key (``key_file``) or by the SSH agent.

    Attributes:
        host: the login node's host name or address.
        port: its SSH port.
        user: the remote user name; default: the local user name.
        key_file: private key file (unencrypted, or load it into ssh-agent instead); None: the SSH agent's keys.
        known_hosts: OpenSSH known_hosts file the host key must be listed in (unknown keys are rejected).
        proxy_jump: optional jump host ``[user@]host[:port]`` (like ``ssh -J``), same key and known_hosts.
        remote_dir: the project's git checkout on the cluster's shared filesystem; each submitted commit gets
            its own worktree under ``<remote_dir>/.gwenlake/worktrees/``. Relative ``paths.*`` resolve here.
        python: the Python on the cluster (after ``setup``) that has gwenlake_hpc installed.
        setup: shell lines run before it, on the login node and in the job (module load, activation).
        launcher: sbatch settings for this cluster (the keys and defaults of ``launcher=slurm``: partition,
            timeout_min, signal_delay_s, max_retries, env, secrets, wait, dry_run...);
            ``cluster.launcher.KEY=VALUE`` on the command line changes one.
        allow_dirty: submit a working tree with uncommitted changes to tracked files: the diff is applied on
            the cluster on top of the commit and recorded in the run's lineage.
        connect_timeout_s: seconds to wait for the TCP connection, the SSH banner and the authentication.
    """

    host: str = MISSING
    port: int = 22
    user: Optional[str] = None
    key_file: Optional[str] = None
    known_hosts: str = "~/.ssh/known_hosts"
    proxy_jump: Optional[str] = None
    remote_dir: str = MISSING
    python: str = "python3"
    setup: List[str] = field(default_factory=list)
    launcher: SlurmLauncherConfig = field(default_factory=SlurmLauncherConfig)
    allow_dirty: bool = False
    connect_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        # nan or a negative value would reach paramiko as a socket timeout (a traceback, or no timeout at all)
        rules.positive_seconds("cluster.connect_timeout_s", self.connect_timeout_s)
        # both are written into the scripts run on the login node and the batch script (cd, the interpreter)
        for key in ("remote_dir", "python"):
            rules.single_line(f"cluster.{key}", getattr(self, key), "the cluster's scripts")


@dataclass
class GwenlakeConfig:
    """The whole configuration of a run (``python -m gwenlake_hpc --cfg job`` prints it).

    ``cluster`` is typed here, so Hydra merges ``conf/cluster/NAME.yaml`` onto :class:`ClusterConfig` whether or
    not the file names ``cluster_schema``: its keys are checked and the ones it leaves out (``launcher.*``...)
    take their defaults. ``launcher`` stays untyped: its schema depends on ``launcher.name``.
    """

    job: JobConfig = field(default_factory=JobConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    statsd: StatsdConfig = field(default_factory=StatsdConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: Any = MISSING
    cluster: Optional[ClusterConfig] = None  # set by cluster=NAME (conf/cluster/NAME.yaml)


def register() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="gwenlake_schema", node=GwenlakeConfig)
    # conf/launcher/<name>.yaml files extend these (defaults: [slurm_schema, _self_]).
    cs.store(group="launcher", name="local_schema", node=LauncherConfig)
    cs.store(group="launcher", name="slurm_schema", node=SlurmLauncherConfig)
    # GwenlakeConfig.cluster is typed already; conf/cluster/<name>.yaml files may still name this one
    # (defaults: [cluster_schema, _self_]), as older files and the example do.
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)


def conf_dir() -> Path:
    """The config directory: ``$GWENLAKE_CONF``, else ``./conf`` when it has a config.yaml, else the one
    shipped beside the package (the project's own ``conf/``)."""
    env = os.environ.get("GWENLAKE_CONF")
    if env:
        return Path(env).resolve()
    local = Path.cwd() / "conf"
    if (local / "config.yaml").is_file():
        return local.resolve()
    return Path(__file__).resolve().parents[2] / "conf"  # <repo>/gwenlake_hpc/job/config.py
