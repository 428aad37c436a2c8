"""Structured configs registered in Hydra's ConfigStore, so a wrong key or type fails before anything runs.

``conf/config.yaml`` starts from the schema ``gwenlake_schema`` registered here; ``conf/job/<name>.yaml``
files fill the ``job`` node (``+job=churn``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..base import rules
from ..base.errors import ConfigError

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
        params: hyperparameters passed as ``config`` (checked against the function's dataclass if annotated).
    """

    target: str = MISSING
    steps: Optional[int] = None
    epochs: Optional[int] = None
    eval_every: Optional[int] = None
    seed: Optional[int] = None
    model: Optional[str] = None
    tracking: Optional[bool] = None
    resume: Resume = Resume.auto
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    params: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # 0 steps would commit an untrained model as a version (and move `candidate` to it).
        rules.whole_number("job.steps", self.steps, 1, "(a training of 0 steps trains nothing)")
        rules.whole_number("job.epochs", self.epochs)
        rules.whole_number("job.eval_every", self.eval_every)
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(f"job.steps={self.steps} and job.epochs={self.epochs} are both set: keep one "
                              "(e.g. job.steps=null)")
        if self.seed is not None:
            rules.seed("job.seed", self.seed)
        rules.choice("job.resume", self.resume, [r.value for r in Resume], "auto continues, never refuses a rerun")
        rules.choice("job.on_nonfinite", self.on_nonfinite, [o.value for o in OnNonFinite],
                     "stop: a NaN loss ends the run")


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
    launcher: Any = MISSING
    cluster: Optional[ClusterConfig] = None  # set by cluster=NAME (conf/cluster/NAME.yaml)


def typed(cfg: Any) -> GwenlakeConfig:
    """The composed config ``cfg`` (a DictConfig from Hydra, or a plain mapping such as the config a SLURM job
    receives) as a :class:`GwenlakeConfig` of dataclasses, every ``__post_init__`` check run.

    ``launcher`` becomes a :class:`LauncherConfig` or :class:`SlurmLauncherConfig` (by ``launcher.name``),
    ``cluster`` a :class:`ClusterConfig` when set; ``job.params`` stays a dict. Other top-level keys (Hydra's
    own ``hydra`` node) are left out. Each node is converted on its own: a node Hydra typed already is read as
    it is (about 1 ms for a whole config; a sweep plans hundreds), a plain one is merged onto its schema first.

    Raises:
        ConfigError: a missing mandatory value, a wrong type, an unknown key (also one Hydra let in with
            ``+KEY=``, at the top level or under a typed node) or a value a rule refuses; the message names the
            key.
    """
    from omegaconf import DictConfig, OmegaConf

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    _refuse_unknown_top_keys(node)  # each node's own keys are checked as it is converted
    parts: dict[str, Any] = {}
    with _as_config_error():
        for key, schema in (("job", JobConfig), ("paths", PathsConfig), ("tracking", TrackingConfig),
                            ("statsd", StatsdConfig), ("launcher", LauncherConfig), ("cluster", ClusterConfig)):
            if key not in node or OmegaConf.is_missing(node, key) or node[key] is None:
                if key == "cluster":
                    continue
                sub = OmegaConf.create({})  # the schema's defaults
            else:
                sub = node[key]
            if key == "launcher":
                name = str(sub.get("name", "local"))
                rules.choice("launcher.name", name, LAUNCHERS, "local: in this process; slurm: submitted")
                schema = SlurmLauncherConfig if name == "slurm" else LauncherConfig
            parts[key] = typed_cluster(sub) if key == "cluster" else _node_object(sub, schema, key)
    return GwenlakeConfig(**parts)


def _node_object(sub: Any, schema: type, key: str) -> Any:
    """One node of the config as an instance of ``schema`` (its checks run); its errors name ``key``."""
    from omegaconf import OmegaConf

    with _as_config_error(f"{key}."):
        _refuse_unknown_keys(sub, schema, key)
        return OmegaConf.to_object(_schema_node(sub, schema))


#: The top-level keys of a composed config: the schema's, and Hydra's own node (a sweep's task configs hold it).
_TOP_KEYS = (*(f.name for f in fields(GwenlakeConfig)), "hydra")


def check_keys(cfg: Any) -> None:
    """Refuse a key of the composed config ``cfg`` (a DictConfig) that no schema has, at the top level or under
    a typed node (``job``, ``paths``, ``tracking``, ``statsd``, ``launcher`` by its ``name``, ``cluster`` and
    their sections), before any work: Hydra lets ``+job.foo=1`` in and OmegaConf would drop it without a word.
    Only keys are checked; values are :func:`typed`'s (a ``cluster=`` job is planned on the cluster).

    Raises:
        ConfigError: ``KEY: no such setting``, naming the closest setting.
    """
    from omegaconf import OmegaConf

    _refuse_unknown_top_keys(cfg)
    for key, schema in (("job", JobConfig), ("paths", PathsConfig), ("tracking", TrackingConfig),
                        ("statsd", StatsdConfig), ("launcher", None), ("cluster", ClusterConfig)):
        if key not in cfg or OmegaConf.is_missing(cfg, key):
            continue
        data = cfg[key]
        if key == "launcher" and OmegaConf.is_dict(data):
            name = data.get("name", "local")
            schema = SlurmLauncherConfig if name == "slurm" else LauncherConfig if name == "local" else None
        if schema is not None:  # an unknown launcher.name: typed() names it
            _refuse_unknown_keys(data, schema, key)


def _refuse_unknown_top_keys(cfg: Any) -> None:
    for key in cfg.keys():
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: no such setting at the top level{_did_you_mean(str(key), _TOP_KEYS, '')} "
                              f"(it takes {', '.join(_TOP_KEYS[:-1])}): remove it or correct its name")


def _did_you_mean(key: str, names: Any, prefix: str) -> str:
    """`` (did you mean PREFIX.NAME?)`` for the name of ``names`` closest to a mistyped ``key``, or ''."""
    import difflib

    close = difflib.get_close_matches(key, [n for n in names if n != "hydra"], n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


@functools.lru_cache(maxsize=None)
def _hints(schema: type) -> tuple[dict[str, Any], dict[str, type]]:
    """The fields of ``schema`` with their types, and those that are sections (dataclasses, ``Optional`` or not);
    cached: a sweep checks hundreds of task configs."""
    import typing

    hints = typing.get_type_hints(schema)
    sections = {}
    for name, kind in hints.items():
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(kind):
            sections[name] = kind
    return hints, sections


def _refuse_unknown_keys(data: Any, schema: type, prefix: str) -> None:
    """Refuse a key of ``data`` (a mapping or a DictConfig) that ``schema`` has no field for, and so on in its
    sections.

    Hydra lets ``+job.foo=1`` into a node it typed, and OmegaConf then drops the key without a word; mappings
    the schema types as dicts (``job.params``, ``launcher.env``, ``launcher.additional_parameters``) are free-form.

    Raises:
        ConfigError: ``PREFIX.KEY: no such setting`` with the closest setting's name, or, for a SLURM setting
            under the local launcher, the ``name: slurm`` it lacks.
    """
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(data, (dict, DictConfig)):
        return  # a value of the wrong shape: the schema's own type error names it
    hints, sections = _hints(schema)
    for key in data.keys():
        if key in hints:
            continue
        full = f"{prefix}.{key}"
        if schema is LauncherConfig and key in _hints(SlurmLauncherConfig)[0]:
            raise ConfigError(f"{full} is a setting of launcher=slurm: add `name: slurm` to this launcher's file "
                              "conf/launcher/NAME.yaml (without it the job runs here, locally), or give "
                              "launcher=slurm")
        listed = f"; {prefix} takes {', '.join(hints)}" if len(hints) <= 12 else \
            f"; {prefix} takes the keys of {schema.__name__} (gwenlake_hpc/config.py)"
        raise ConfigError(f"{full}: no such setting{_did_you_mean(str(key), hints, prefix + '.')}: remove it or "
                          f"correct its name{listed}")
    for key, kind in sections.items():
        try:
            value = data.get(key)
        except OmegaConfBaseException:  # a missing or broken value: the schema's conversion names it
            continue
        _refuse_unknown_keys(value, kind, f"{prefix}.{key}")


def _schema_node(sub: Any, schema: type) -> Any:
    """``sub`` (a DictConfig) as a DictConfig typed by ``schema``: itself when Hydra typed it already (its file
    named the schema), else merged onto the schema's defaults (OmegaConf's errors pass unchanged)."""
    from omegaconf import DictConfig, OmegaConf

    typed_as = OmegaConf.get_type(sub) if isinstance(sub, DictConfig) else None
    if isinstance(typed_as, type) and issubclass(typed_as, schema):
        return sub
    return OmegaConf.merge(OmegaConf.structured(schema), sub)


def typed_cluster(cc: Any) -> ClusterConfig:
    """The ``cluster`` node (``cluster=NAME``: a DictConfig, or a mapping) as a :class:`ClusterConfig`, with its
    ``launcher`` a :class:`SlurmLauncherConfig`, their checks run.

    Raises:
        ConfigError: as :func:`typed`; a rule of ``cluster.launcher`` names ``cluster.launcher.KEY``.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cc, ClusterConfig):
        return cc
    node = cc if isinstance(cc, DictConfig) else OmegaConf.create(dict(cc))
    try:
        return _node_object(node, ClusterConfig, "cluster")
    except ConfigError as exc:
        if str(exc).startswith("launcher."):
            raise ConfigError(f"cluster.{exc}") from None
        raise


def typed_launcher(lc: Any) -> SlurmLauncherConfig:
    """The SLURM launcher settings ``lc`` (``launcher`` or ``cluster.launcher``, a DictConfig or a mapping) as a
    :class:`SlurmLauncherConfig`, its checks run.

    Raises:
        ConfigError: as :func:`typed`.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(lc, SlurmLauncherConfig):
        return lc
    return _node_object(lc if isinstance(lc, DictConfig) else OmegaConf.create(dict(lc)), SlurmLauncherConfig,
                        "launcher")


def launcher_node(lc: Any) -> Any:
    """A copy of the SLURM launcher settings ``lc`` (a DictConfig, a mapping or a :class:`SlurmLauncherConfig`)
    as a DictConfig typed by :class:`SlurmLauncherConfig`, every key present, so keys may be set on it (a
    launcher file that does not name ``slurm_schema`` composes to an untyped node holding only its own keys,
    where setting another fails). ``lc`` is not changed.

    Raises:
        ConfigError: a wrong type or an unknown key, named ``launcher.KEY``.
    """
    import copy

    from omegaconf import DictConfig, OmegaConf

    if isinstance(lc, SlurmLauncherConfig):
        return OmegaConf.structured(lc)
    with _as_config_error("launcher."):
        lc = lc if isinstance(lc, DictConfig) else OmegaConf.create(dict(lc))
        _refuse_unknown_keys(lc, SlurmLauncherConfig, "launcher")
        node = _schema_node(lc, SlurmLauncherConfig)
    return copy.deepcopy(node) if node is lc else node


#: The config groups a command line chooses files of, and the schema each file's keys follow (a launcher file
#: is checked against the SLURM launcher's, the larger one: unknown keys are the schema's own error).
GROUP_SCHEMAS = {"job": JobConfig, "launcher": SlurmLauncherConfig, "cluster": ClusterConfig}


def check_group_choices(overrides: Any, root: Path) -> None:
    """Refuse a ``GROUP=null`` override and a config file under ``root`` (``config.yaml``, the ``conf/GROUP/NAME.yaml``
    files the command line or config.yaml's defaults choose, and the files of their group their own defaults
    name) where Hydra's own error would be a traceback or name no key: a file that is not valid YAML (or repeats a
    key), a ``defaults`` that is not a list of names or ``GROUP: NAME`` pairs, a file that is not a mapping of
    keys, a value that is not a mapping where the schema has a section (``cluster.launcher``,
    ``launcher.container``), an empty launcher file (it would run the job locally without a word). Missing or
    unreadable files, and every other mistake, are left to Hydra and the schemas.

    Raises:
        ConfigError: naming the override, or the file (and line) and the key, and the fix.
    """
    chosen: dict[str, str] = {}
    for ov in overrides:
        key, eq, name = str(ov).lstrip("+").partition("=")
        if not eq or key not in GROUP_SCHEMAS:
            continue
        if name.strip() in ("null", ""):
            raise ConfigError(f"{ov}: {key} takes the name of a file conf/{key}/NAME.yaml"
                              + ("; leave cluster= out to run without a cluster" if key == "cluster" else ""))
        chosen[key] = name
    primary = _read_config_file(root / "config.yaml", "config")
    for entry in (primary.get("defaults") or []) if isinstance(primary, dict) else []:
        if isinstance(entry, dict) and len(entry) == 1:  # `- launcher: local`: the choice when none is given
            (group, name), = entry.items()
            if group in GROUP_SCHEMAS and isinstance(name, str):
                chosen.setdefault(group, name)
    seen: set[Path] = set()
    for key, names in chosen.items():
        for name in names.split(","):  # a sweep over files: launcher=a,b
            _check_group_file(root, key, name.strip(), seen)


def _check_group_file(root: Path, key: str, name: str, seen: set) -> None:
    """Check ``root/key/name.yaml`` (see :func:`check_group_choices`) and the files of its group it names."""
    path = root / key / f"{name}.yaml"
    if path in seen or not path.is_file():
        return
    seen.add(path)
    data = _read_config_file(path, key)
    if data is None and key == "launcher":
        raise ConfigError(f"launcher ({path}) is empty: write `name: slurm` and the sbatch settings in it to submit "
                          "to SLURM (see conf/launcher/slurm.yaml), or choose launcher=local to run here")
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{key} ({path}): the file holds a {type(data).__name__}, not a mapping: write one "
                          f"KEY: VALUE line per setting")
    for entry in (data or {}).get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":  # another file of the group, e.g. a shared base
            _check_group_file(root, key, entry, seen)
    _check_sections(data or {}, GROUP_SCHEMAS[key], key)


@functools.lru_cache(maxsize=None)
def _strict_loader() -> type:
    """A safe YAML loader (libyaml's when installed: a few times faster) that, as OmegaConf's, which Hydra reads
    config files with, refuses a key given twice in one mapping."""
    import yaml

    class StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    if key_node.value in keys:
                        raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                                f"found duplicate key {key_node.value}",
                                                                key_node.start_mark)
                    keys.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _read_config_file(path: Path, key: str) -> Any:
    """The data of the config file ``path`` (None when empty, missing or unreadable: Hydra's to report), its
    ``defaults`` list checked.

    Raises:
        ConfigError: not valid YAML (file, line, the parser's words), a key given twice, a misshapen ``defaults``.
    """
    import yaml

    try:
        text = path.read_text()
    except (OSError, ValueError):
        return None
    try:
        data = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as exc:
        mark, at = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        said = f" ({context} at line {at.line + 1}, column {at.column + 1})" if context and at else ""
        raise ConfigError(f"{path}{f', line {mark.line + 1}' if mark else ''}: not valid YAML: {problem}{said}; "
                          "fix the file") from None
    if isinstance(data, dict) and "defaults" in data:
        defaults = data["defaults"]
        how = ("write one `- NAME` line per entry under `defaults:` (e.g. `- slurm_schema` then `- _self_`), "
               "or remove it")
        if not isinstance(defaults, list):
            raise ConfigError(f"{key} ({path}): defaults: {defaults!r} is not a list: {how}")
        for entry in defaults:
            ok = isinstance(entry, str) or (
                isinstance(entry, dict) and len(entry) == 1 and all(
                    v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(i, str) for i in v))
                    for v in entry.values()))
            if not ok:
                raise ConfigError(f"{key} ({path}): defaults entry {entry!r}: give a name (`- slurm_schema`) or one "
                                  "GROUP: NAME pair (`- launcher: slurm`)")
    return data


def _check_sections(data: dict, schema: type, prefix: str) -> None:
    """Refuse a value of ``data`` that is not a mapping where ``schema`` has a section (a dataclass field)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    for name, value in data.items():
        kind = hints.get(name)
        kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        if not dataclasses.is_dataclass(kind) or value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{prefix}.{name}={value!r}: give a section, its keys indented on the lines under "
                              f"`{name}:` (the keys of {kind.__name__})")
        _check_sections(value, kind, f"{prefix}.{name}")


_ROOT_KEYS = tuple(f"{f}." for f in ("job", "paths", "tracking", "statsd", "launcher", "cluster"))


class _as_config_error:
    """OmegaConf's errors (a missing value, a wrong type, an unknown key) as a :class:`ConfigError` naming the
    key; a ConfigError from a ``__post_init__`` check passes unchanged."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # for a node merged on its own, whose keys do not name their parent

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

        if exc is None or isinstance(exc, ConfigError) or not isinstance(exc, OmegaConfBaseException):
            return False
        key = str(getattr(exc, "full_key", "") or "")
        if not key.startswith(_ROOT_KEYS):  # a node still in the whole config names its path already
            key = (self.prefix + key).rstrip(".")  # an error on the node itself has no key of its own
        if isinstance(exc, MissingMandatoryValue):
            raise ConfigError(f"{key} is not set: give it in the config file or on the command line ({key}=...)") \
                from None
        raise ConfigError(f"{key or 'config'}: {str(exc).splitlines()[0]}") from None


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
