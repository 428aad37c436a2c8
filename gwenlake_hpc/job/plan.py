"""The job plan: a composed config resolved into what a job will do, before it does anything.

:func:`plan` imports the training function (:func:`load_target`), checks every setting (exit 2 with the key's name),
reads the inputs' revisions (they enter the run key, :func:`make_run_key`; the files are closed again,
:func:`open_inputs` opens them for the training) and resolves initial model versions, and returns a
:class:`JobPlan`: the run directory, the tracking URI, the bindings. The launchers plan before they submit (a bad
task is refused with nothing submitted); the job (:mod:`gwenlake_hpc.job.execute`) plans again where it runs and executes
the plan. Imports no torch, no MLflow, no launcher.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from ..authoring.api import Input, Model, TrainFunction, resolve_params
from ..stores.checkpoints.writer import async_default
from .config import GwenlakeConfig, JobConfig
from .config_typed import typed
from ..stores.data import Catalog
from ..base.errors import ConfigError
from ..base.fsutil import refuse_symlinks
from ..stores.tracking import default_uri, is_sqlite, sqlite_path, validate_uri
from ..stores.versioning import default_model_repo, list_versions, open_model_repo

log = logging.getLogger("gwenlake_hpc.job")


def load_target(target: str) -> TrainFunction:
    """Import ``module:function`` or ``path/to/file.py:function`` and return the decorated function.

    Raises:
        ConfigError: malformed target, module or file not found, no such attribute, or not ``@train``.
    """
    if not isinstance(target, str) or ":" not in target:
        raise ConfigError(f"job.target={target!r}: use 'package.module:function' or 'path/to/file.py:function'")
    mod_part, qualname = target.rsplit(":", 1)
    if mod_part.endswith(".py"):
        path = Path(mod_part).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"job.target={target!r}: file {path} does not exist")
        mod_name = "gwenlake_job_" + hashlib.sha1(str(path).encode()).hexdigest()[:10] + "_" + re.sub(r"\W", "_", path.stem)
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, path)
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException as exc:
                del sys.modules[mod_name]  # half-imported: a later lookup must not find it without its functions
                if isinstance(exc, ConfigError):  # a misused @train: its message says what to change
                    raise ConfigError(f"job.target={target!r}: importing {path.name} failed: {exc}") from None
                raise
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_part)
        except ModuleNotFoundError as exc:
            if exc.name and mod_part.startswith(exc.name):
                raise ConfigError(f"job.target={target!r}: module {mod_part!r} not found "
                                  f"(run from the project directory, or give a file path)") from exc
            raise
        except ConfigError as exc:
            raise ConfigError(f"job.target={target!r}: importing {mod_part} failed: {exc}") from None
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"job.target={target!r}: {mod_part} has no attribute {qualname!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, TrainFunction):
        raise ConfigError(f"job.target={target!r} is not decorated with @gwenlake_hpc.train")
    return obj


def make_run_key(model: str, run_name: str, params: Mapping[str, Any], seed: int,
                 datasets: Mapping[str, str], init_models: Mapping[str, str]) -> str:
    """The run key: ``<run name>-<16 hex>`` of a hash of what defines the training's result.

    Derived from the model name, the run name, the hyperparameters, the seed, the dataset revisions and the
    initial model versions, and nothing else: not ``steps``/``epochs`` (so a larger ``--steps`` extends a run),
    not paths, not launcher settings. So a requeued or resubmitted job finds its checkpoints.
    """
    doc = json.dumps({"model": model, "run": run_name, "params": params, "seed": seed,
                      "datasets": dict(datasets), "init_models": dict(init_models)},
                     sort_keys=True, default=str, separators=(",", ":"))
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[:64]
    return f"{safe}-{hashlib.sha256(doc.encode()).hexdigest()[:16]}"


@dataclass
class JobPlan:
    """Everything a job resolves before it trains: the function, its settings, bindings and run directory.

    Built by :func:`plan` without writing anything but the datasets a ``prepare`` hook materialises (their
    revisions enter the run key, so they must exist to plan) and without keeping a file open, so a launcher can
    print the run directory before submitting, and the job itself can run it.
    """

    cfg: Any
    settings: GwenlakeConfig
    tf: TrainFunction
    config_obj: Any
    params: dict[str, Any]
    tracking_uri: str | None
    runs_root: Path
    repo_path: Path | None
    datasets: dict[str, str]
    dataset_facts: dict[str, Any]
    model_versions: dict[str, str]
    key: str
    run_dir: Path

    @property
    def model_name(self) -> str:
        return self.tf.output.name

    # The job's settings, the config's over the decorator's (checked by JobConfig's rules).
    @property
    def steps(self) -> int | None:
        return self.settings.job.steps

    @property
    def epochs(self) -> int | None:
        return self.settings.job.epochs

    @property
    def eval_every(self) -> int | str:
        """``job.eval_every``: a whole number of steps, or ``"auto"`` (:mod:`gwenlake_hpc.runtime.interval`)."""
        every = self.settings.job.eval_every
        return every if every == "auto" else int(every)  # type: ignore[arg-type]

    @property
    def seed(self) -> int:
        return int(self.settings.job.seed)  # type: ignore[arg-type]

    @property
    def run_name(self) -> str:
        return str(self.settings.job.model)

    @property
    def resume(self) -> str:
        return str(self.settings.job.resume.value)

    @property
    def on_nonfinite(self) -> str:
        return str(self.settings.job.on_nonfinite.value)

    @property
    def hang_rule(self) -> Any:
        """``job.hang_timeout_s`` as a :class:`~gwenlake_hpc.job.watchdog.HangRule`."""
        from .watchdog import hang_rule

        return hang_rule(self.settings.job.hang_timeout_s)

    @property
    def tracking_on(self) -> bool:
        return self.tracking_uri is not None

    def model_repo(self, create: bool = True):
        return open_model_repo(self.repo_path or default_model_repo(Path.cwd()), create=create)


class PlanCache:
    """Read-only facts that the plans of one sweep's tasks share instead of reading them again per task.

    Dataset facts are keyed by path and by the file's inode, modification time (ns) and size, so a dataset
    replaced between two plans (an atomic rename gives a new inode) is read again. Only the process that plans
    a sweep holds one; a job plans once, without it.
    """

    def __init__(self) -> None:
        self._facts: dict[tuple[str, int, int, int], dict[str, Any]] = {}

    def dataset_facts(self, catalog: Catalog, name: str) -> dict[str, Any]:
        """:func:`dataset_facts`, or the facts read for an earlier task of the same file.

        Raises:
            DataError: as :meth:`Catalog.open`.
        """
        path = catalog.path(name)
        try:
            st = path.stat()
        except OSError:
            return dataset_facts(catalog, name)  # its own message for a missing file
        key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
        if key not in self._facts:
            self._facts[key] = dataset_facts(catalog, name)
        return dict(self._facts[key])


def dataset_facts(catalog: Catalog, name: str) -> dict[str, Any]:
    """``{"name", "revision", "rows", "path"}`` of dataset ``name``, read and closed again (the plan keeps no
    file open: the job opens its inputs when it executes, :func:`open_inputs`).

    Raises:
        DataError: the dataset is missing or malformed (as :meth:`Catalog.open`).
    """
    with catalog.open(name) as ds:
        return {"name": name, "revision": ds.revision, "rows": ds.rows, "path": str(ds.path)}


def open_inputs(p: JobPlan) -> dict[str, Any]:
    """Open the plan's Input datasets for the training: ``{binding name: Dataset}``.

    Raises:
        ConfigError: a dataset's revision is no longer the one the plan read (it was replaced in between; the
            revision is part of the run key, so the job must be planned again: run it again).
    """
    from ..stores.data import Dataset

    opened: dict[str, Any] = {}
    for name, facts in p.dataset_facts.items():
        ds = Dataset(facts["path"], name=facts["name"])
        if ds.revision != facts["revision"]:
            ds.close()
            for other in opened.values():
                other.close()
            raise ConfigError(f"dataset {facts['name']} changed while the job started (revision "
                              f"{facts['revision'][:12]} when planned, {ds.revision[:12]} now): run the job again")
        opened[name] = ds
    return opened


def plan(cfg: DictConfig | Mapping[str, Any], cache: PlanCache | None = None) -> JobPlan:
    """Resolve a composed config into a :class:`JobPlan`.

    ``cache``: the facts shared by the tasks of one sweep (see :class:`PlanCache`); None reads everything.

    Raises:
        ConfigError: no job, bad target, a setting a rule refuses (:func:`gwenlake_hpc.job.config_typed.typed`), bad
            params, bad tracking URI, missing or malformed dataset, unknown initial model version.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    if OmegaConf.select(cfg, "job.target", default=None) is None or OmegaConf.is_missing(cfg.job, "target"):
        raise ConfigError("no job given: add +job=NAME (a file conf/job/NAME.yaml) or job.target=module:function")
    settings = typed(cfg)  # every key's type and rule checked (config_typed.py), before the function is imported
    tf = load_target(settings.job.target)
    job = _effective(settings.job, tf)
    settings = dataclasses.replace(settings, job=job)
    async_default()  # GWENLAKE_CHECKPOINT_ASYNC is checked before anything is written
    config_obj, params = resolve_params(tf, dict(job.params))

    paths = settings.paths
    runs_root = _path_setting("paths.runs_root", paths.runs_root)
    data_root = _path_setting("paths.data_root", paths.data_root)
    catalog = Catalog(data_root)
    tracking_uri = None
    if job.tracking:
        tracking_uri = validate_uri(settings.tracking.uri) if settings.tracking.uri else default_uri(runs_root)
    repo_path = _path_setting("paths.model_repo", paths.model_repo) if paths.model_repo is not None else None
    _check_paths(runs_root, data_root, repo_path, tracking_uri)
    _check_local_dir(settings.checkpoint.local_dir, runs_root)
    if tf.prepare is not None:
        tf.prepare(catalog, config_obj)

    # Bindings: the inputs' revisions (they enter the run key; the files are closed again) and initial models.
    datasets: dict[str, str] = {}
    facts: dict[str, Any] = {}
    model_versions: dict[str, str] = {}
    for name, b in tf.bindings.items():
        if isinstance(b, Input):
            facts[name] = cache.dataset_facts(catalog, b.name) if cache is not None else dataset_facts(catalog, b.name)
            datasets[name] = f"{b.name}@{facts[name]['revision']}"
        elif isinstance(b, Model):
            model_versions[name] = f"{b.name}@{_resolve_version(repo_path, b)}"

    key = make_run_key(tf.output.name, job.model, params, job.seed, datasets, model_versions)
    run_dir = runs_root / tf.output.name / key
    refuse_symlinks(run_dir)  # a link planted in it would take the start's writes elsewhere: every rank, at once
    return JobPlan(cfg=cfg, settings=settings, tf=tf, config_obj=config_obj, params=params,
                   tracking_uri=tracking_uri, runs_root=runs_root, repo_path=repo_path,
                   datasets=datasets, dataset_facts=facts, model_versions=model_versions, key=key,
                   run_dir=run_dir)


def _effective(job: JobConfig, tf: TrainFunction) -> JobConfig:
    """``job`` with what it leaves null taken from the decorator (``@train(steps=, seed=...)``), checked again
    by :class:`JobConfig`'s rules (``dataclasses.replace`` runs ``__post_init__``).

    ``job.epochs`` given in the config replaces a ``steps`` that only comes from the decorator (and the other
    way round); both given in the config is refused (by the rules) rather than one silently ignored.

    Raises:
        ConfigError: a loop setting for a short fit, or a decorator value a rule refuses.
    """
    d = tf.defaults
    if getattr(tf, "is_short", False):
        loop = [k for k in ("steps", "epochs", "eval_every") if getattr(job, k) is not None]
        if loop:
            raise ConfigError(f"job.{loop[0]}={getattr(job, loop[0])}: {tf.target} is a short fit (one call, no "
                              f"loop); drop job.{loop[0]}")
    steps, epochs = job.steps, job.epochs
    if steps is None and epochs is None:
        steps, epochs = d.get("steps"), d.get("epochs")

    def pick(key: str) -> Any:
        value = getattr(job, key)
        return d.get(key) if value is None else value

    return dataclasses.replace(job, steps=steps, epochs=epochs, eval_every=pick("eval_every"), seed=pick("seed"),
                               tracking=bool(pick("tracking")), model=job.model or tf.run_name)


def _path_setting(key: str, value: Any) -> Path:
    """The absolute path of a ``paths.*`` setting (``~`` expanded, symlinks resolved).

    Raises:
        ConfigError: empty (it would silently mean the working directory), or unresolvable (a symlink loop).
    """
    if value is None or not str(value).strip():
        raise ConfigError(f"{key} is empty: give a folder (e.g. {key}=runs), or leave it out for the default")
    try:
        return Path(str(value)).expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: a symlink loop
        raise ConfigError(f"{key}={value!r} cannot be resolved ({exc}): point it to a real folder") from None


def _check_local_dir(local_dir: str | None, runs_root: Path) -> None:
    """Refuse a ``checkpoint.local_dir`` on the shared level: inside ``paths.runs_root`` (a run directory, its
    output, its checkpoints), where a "local" level is neither local nor out of the way of what a run publishes.

    Raises:
        ConfigError: naming both settings.
    """
    if local_dir in (None, "off"):
        return
    local, root = Path(local_dir).resolve(), runs_root.resolve()
    if local == root or root in local.parents:
        raise ConfigError(f"checkpoint.local_dir={local_dir} is inside paths.runs_root={runs_root}: the local level "
                          "belongs on the node's own disk or RAM disk (e.g. /tmp/ckpt, /dev/shm/ckpt, "
                          "$SLURM_TMPDIR), outside the shared run directories; or use checkpoint.local_dir=off")


def _check_paths(runs_root: Path, data_root: Path, repo_path: Path | None, tracking_uri: str | None) -> None:
    """Refuse, before any work, folders the job could only fail on later (after hours of training, for the model
    repository). Writes nothing but the runs root folder itself, and a probe file (for a model repository still
    to be made, a probe folder beside it) that is removed at once.

    Raises:
        ConfigError: naming the ``paths.*`` setting and what to do.
    """
    for key, value in (("paths.runs_root", runs_root), ("paths.data_root", data_root), ("paths.model_repo", repo_path)):
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
            raise ConfigError(f"{key}={str(value)!r} holds control characters (a newline?): remove them")
    if data_root.exists() and not data_root.is_dir():
        raise ConfigError(f"paths.data_root={data_root} is a file, not a folder: point it to the folder that holds "
                          "the datasets (<data_root>/<group>/<name>.h5)")
    if runs_root.exists() and not runs_root.is_dir():
        raise ConfigError(f"paths.runs_root={runs_root} is a file, not a folder: point it to a writable folder")
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=runs_root, prefix=".gwenlake-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"paths.runs_root={runs_root} cannot be written ({exc.strerror or exc}): point it to a "
                          "writable folder on the shared filesystem (run directories and checkpoints go there)") \
            from None
    store = sqlite_path(tracking_uri) if tracking_uri and is_sqlite(tracking_uri) else None
    if store is not None:
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=store.parent, prefix=".gwenlake-probe-"):
                pass
        except OSError as exc:
            raise ConfigError(f"tracking.uri={tracking_uri}: the store's folder {store.parent} cannot be written "
                              f"({exc.strerror or exc}); point it to a writable folder, or use a tracking server "
                              "(http://host:5000)") from None
    if repo_path is not None and not repo_path.exists():
        # Created at the commit, after the whole training: its nearest existing folder must take a new one,
        # tried for real (permission bits say nothing of /proc, a read-only mount or a full disk).
        parent = next(p for p in repo_path.parents if p.exists())
        why = "not a folder" if not parent.is_dir() else ""
        if not why:
            try:
                os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".gwenlake-probe-"))
            except OSError as exc:
                why = f"a folder cannot be made in it: {exc.strerror or exc}"
        if why:
            raise ConfigError(f"paths.model_repo={repo_path} cannot be created ({parent} is {why}): point it to "
                              "a git repository, or to a new folder in a writable place")
    if repo_path is not None and repo_path.exists():
        if not repo_path.is_dir():
            raise ConfigError(f"paths.model_repo={repo_path} is a file, not a git repository: point it to a "
                              "repository, or to a new folder (one is created there)")
        if any(repo_path.iterdir()):
            open_model_repo(repo_path, create=False)  # ConfigError when it is not a repository's top level


def _resolve_version(repo_path: Path | None, b: Model) -> str:
    repo = open_model_repo(repo_path or default_model_repo(Path.cwd()), create=False)
    if b.alias is not None:
        from ..stores.registry import resolve_alias

        sha = resolve_alias(b.name, b.alias, repo)  # logs the version it resolved
        log.info("Model(%r, alias=%r) resolved to version %s", b.name, b.alias, sha)
        return sha
    if b.version is None:
        versions = list_versions(repo, b.name)
        if not versions:
            raise ConfigError(f"Model({b.name!r}): the model repository {repo.working_dir} has no "
                              "version of it yet; train it first or give version=SHA")
        return versions[0]["version"]
    try:
        return repo.git.rev_parse("--verify", f"{b.version}^{{commit}}")
    except Exception as exc:
        raise ConfigError(f"Model({b.name!r}, version={b.version!r}): no such commit in {repo.working_dir}") from exc
