"""The decorator and its bindings: what a training function declares about itself.

    @train(training_set=Input("crm.churn-train"), output=Output("crm.churn"), steps=30_000, eval_every=1_000)
    def fit(training_set, output, run, config): ...

Bindings are declarations; the job (``gwenlake_hpc.job``) resolves them when it runs: an ``Input`` becomes a
:class:`gwenlake_hpc.data.Dataset`, an ``Output`` a bound ``Output`` with a directory in the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import ConfigError, TrainDefinitionError
from .names import check_name, is_alias
from .resources import parse_resources

def resolve_params(tf: "TrainFunction", params: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Check ``job.params`` against the function's config dataclass, if it has one.

    Returns:
        ``(config, plain)``: what the function receives (dataclass instance or dict) and a plain dict of every
        hyperparameter with defaults filled in (it enters the run key and MLflow params).

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming ``job.params.<key>``.
    """
    if tf.config_type is None:
        plain = dict(params)
        return plain, plain
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(tf.config_type), dict(params))
        plain = OmegaConf.to_container(merged, resolve=True, enum_to_str=True)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"job.params{('.' + str(key)) if key else ''}: {msg} "
                          f"(fields of {tf.config_type.__name__}: "
                          f"{', '.join(f.name for f in dataclasses.fields(tf.config_type))})") from exc
    return obj, plain  # type: ignore[return-value]


class Input:
    """A dataset the training reads: ``Input("crm.churn-train")``.

    Resolved through the catalog to ``<paths.data_root>/crm/churn-train.h5`` and passed to the function as a
    :class:`gwenlake_hpc.data.Dataset` (``.rows``, ``.columns``, ``.revision``, ``.batches(...)``).
    """

    def __init__(self, name: str):
        self.name = check_name(name, "Input dataset")

    def __repr__(self) -> str:
        return f"Input({self.name!r})"


class Output:
    """The model a training produces: ``Output("crm.churn")``.

    The name is the model's name: it names the MLflow experiment, the run directory's parent
    (``<paths.runs_root>/crm.churn/``) and the path ``crm/churn/`` in the model repository. In the function
    the binding is bound to a directory: write the final model files with ``output.file("model.safetensors")``.

    ``predict="package.module:function"`` declares how to use the model: ``function(model_dir, batch)`` takes
    the directory of a version's files (a Path) and a batch ``{column: numpy array [n, ...]}`` of input columns,
    and returns scores as a numpy array ``[n]``. ``inputs`` names those columns (default: every column of the
    first Input). Both are recorded with each version (``lineage.json``, key ``serving``, with the columns'
    dtypes and shapes taken from the training dataset), so ``gwenlake_hpc.load_model`` and the release gate
    can run any version.
    """

    def __init__(self, name: str, *, path: str | os.PathLike | None = None, predict: str | None = None,
                 inputs: typing.Sequence[str] | None = None):
        self.name = check_name(name, "Output model")
        self._path = Path(path) if path is not None else None
        if predict is not None and (not isinstance(predict, str)
                                    or not re.match(r"^[\w.]+:[\w.]+$", predict)):
            raise ConfigError(f"Output({name!r}, predict={predict!r}): use 'package.module:function'")
        if inputs is not None and (isinstance(inputs, str) or not all(isinstance(c, str) for c in inputs)):
            raise ConfigError(f"Output({name!r}, inputs={inputs!r}): give a list of column names")
        self.predict = predict
        self.inputs = list(inputs) if inputs is not None else None

    def bind(self, path: str | os.PathLike) -> "Output":
        """A copy bound to the directory ``path`` (created)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        return Output(self.name, path=path, predict=self.predict, inputs=self.inputs)

    @property
    def path(self) -> Path:
        """The model's directory (``<run_dir>/output``); everything in it is committed at the end.

        Raises:
            RuntimeError: the binding is not bound (outside a job).
        """
        if self._path is None:
            raise RuntimeError(f"Output({self.name!r}) is not bound to a directory outside a job")
        return self._path

    def file(self, name: str) -> Path:
        """Path of a file inside the model's directory; parent folders are created.

        Raises:
            ConfigError: ``name`` is absolute or escapes the directory (``../x``, symlinks pointing out).
        """
        root = self.path.resolve()
        candidate = (root / name).resolve()
        if Path(name).is_absolute() or not candidate.is_relative_to(root) or candidate == root:
            raise ConfigError(f"output.file({name!r}): the path escapes the model directory {root}; "
                              "use a relative name such as 'model.safetensors'")
        candidate.parent.mkdir(parents=True, exist_ok=True)
        return candidate

    def __repr__(self) -> str:
        return f"Output({self.name!r})" if self._path is None else f"Output({self.name!r}, path={str(self._path)!r})"


class Model:
    """An existing model version to start from (fine-tuning): ``Model("crm.churn", version=SHA)``.

    ``version`` is a commit SHA of the model repository, or None for the newest version of the model's
    branch; ``alias="champion"`` takes the version an alias points to now (see :mod:`gwenlake_hpc.registry`;
    the version it resolved to is logged). In the function the binding is a directory with that version's files
    (``.path``, ``.file(name)``), exported without touching any working tree; the resolved version enters the
    run key and the lineage.

    Raises:
        ConfigError: both ``version`` and ``alias`` given, or a malformed alias.
    """

    def __init__(self, name: str, version: str | None = None, *, alias: str | None = None):
        self.name = check_name(name, "Model")
        if version is not None and alias is not None:
            raise ConfigError(f"Model({name!r}): give version= or alias=, not both")
        if alias is not None and not is_alias(alias):
            raise ConfigError(f"Model({name!r}, alias={alias!r}): an alias is a name such as 'champion' "
                              "(letters, digits, '_' and '-', starting with a letter)")
        self.version = version
        self.alias = alias
        self._path: Path | None = None

    def bind(self, path: str | os.PathLike, version: str) -> "Model":
        """A copy bound to the exported directory ``path`` of ``version``."""
        m = Model(self.name, version)
        m.alias = self.alias
        m._path = Path(path)
        return m

    @property
    def path(self) -> Path:
        """Directory holding the files of the version (bound in a job)."""
        if self._path is None:
            raise RuntimeError(f"Model({self.name!r}) is not bound outside a job")
        return self._path

    def file(self, name: str) -> Path:
        """Path of one of the version's files."""
        return self.path / name

    def __repr__(self) -> str:
        if self.alias is not None and self._path is None:
            return f"Model({self.name!r}, alias={self.alias!r})"
        return f"Model({self.name!r}, version={self.version!r})"


Binding = typing.Union[Input, Output, Model]

#: Decorator arguments that are settings rather than bindings, with their defaults.
DEFAULTS: dict[str, Any] = {
    "steps": None, "epochs": None, "eval_every": 1000, "seed": 0, "model": None, "tracking": True,
    "cpu": None, "memory": None, "gpu": None, "env": None, "secrets": None, "metadata": None, "max_retries": None,
    "name": None, "image": None,
}

#: How ``TrainFunction.submit`` reaches a launcher: ``"module:function"``, resolved at the call and called as
#: ``function(target, overrides, job)``. The decorator never imports a launcher (launchers import the job layer,
#: which imports this module); a plug-in or a test may point it elsewhere.
SUBMITTER = "gwenlake_hpc.launch.slurm:submit_training"

#: Every decorated function, by target ``module:qualname``.
REGISTRY: dict[str, "TrainFunction"] = {}


class TrainFunction:
    """A decorated training function: the plain function plus what it declared.

    Attributes:
        fn: the function itself (calling the TrainFunction calls it unchanged).
        bindings: parameter name -> Input / Output / Model.
        defaults: the decorator's settings (``steps``, ``epochs``, ``eval_every``, ``seed``, ``model``,
            ``tracking``, resources ``cpu``/``memory``/``gpu``...), overridden by the job config.
        resources: the declared :class:`gwenlake_hpc.resources.Resources` (parsed at import).
        prepare: optional ``callable(catalog, config)`` run before the inputs are opened (to materialise
            datasets that are absent).
        config_type: the dataclass ``config`` is annotated with, or None (then config is a mapping).
        wants_config: whether the function declares a ``config`` parameter.
    """

    def __init__(self, fn: Callable[..., Any], bindings: dict[str, Binding], defaults: dict[str, Any],
                 prepare: Callable[..., Any] | None):
        self.fn = fn
        self.bindings = bindings
        if defaults.get("name") is not None:  # name= is the run's name, as model= (Chalk's spelling)
            if defaults.get("model") not in (None, defaults["name"]):
                raise TrainDefinitionError(f"@train on {fn.__qualname__}: name={defaults['name']!r} and "
                                           f"model={defaults['model']!r} both name the run: keep one")
            if not isinstance(defaults["name"], str) or not defaults["name"].strip():
                raise TrainDefinitionError(f"@train name={defaults['name']!r}: give a non-empty string")
            defaults = {**defaults, "model": defaults["name"]}
        self.defaults = defaults
        self.resources = parse_resources(defaults)  # TrainDefinitionError at import, naming the setting
        self.prepare = prepare
        functools.update_wrapper(self, fn)
        sig = inspect.signature(fn)
        params = sig.parameters
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [n for n in [*bindings, "run"] if n not in params and not accepts_kwargs]
        if missing:
            raise TrainDefinitionError(f"@train on {fn.__qualname__}: the function has no parameter for "
                            f"{', '.join(missing)}; add it to the signature")
        self.wants_config = "config" in params
        self.config_type = None
        if self.wants_config:
            try:
                hint = typing.get_type_hints(fn).get("config")
            except Exception:  # unresolved forward references: fall back to a mapping
                hint = None
            if hint is not None and dataclasses.is_dataclass(hint):
                self.config_type = hint
        outputs = [n for n, b in bindings.items() if isinstance(b, Output)]
        if len(outputs) != 1:
            raise TrainDefinitionError(f"@train on {fn.__qualname__}: declare exactly one Output (found {len(outputs)})")
        self.output_binding = outputs[0]

    @property
    def output(self) -> Output:
        """The Output binding (the model this training produces)."""
        return self.bindings[self.output_binding]  # type: ignore[return-value]

    @property
    def target(self) -> str:
        """``module:qualname``, as a job config's ``job.target`` names it."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    @property
    def run_name(self) -> str:
        """The run's name within the model: ``model=`` if given, else the function's name."""
        return self.defaults.get("model") or self.fn.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def local(self, config: Any = None, **kwargs: Any) -> Any:
        """Run this training in this process, for a quick try: no tracking, no commit, a temporary run
        directory; returns what the function returned. ``fit.local(steps=50)`` is a smoke run.

        Keyword arguments: ``steps``, ``epochs``, ``seed``, ``eval_every``, ``data_root`` (default ``data``),
        ``run_dir`` (keep the run directory there), ``progress`` and bindings by name (see
        :func:`gwenlake_hpc.local.run_local`).

        Raises:
            ConfigError: an unknown binding or bad setting; whatever the function raises.
        """
        from .local import run_local

        return run_local(self, config, **kwargs)

    def submit(self, *overrides: str, job: str | None = None):
        """Submit this training to SLURM (``launcher=slurm``) and return a handle.

        Args:
            overrides: Hydra overrides, e.g. ``"job.steps=5000"``, ``"launcher.partition=gpu"``.
            job: a job config name (``conf/job/<job>.yaml``) to start from; default: this function alone.

        Returns:
            :class:`gwenlake_hpc.launch.status.JobHandle` with ``job_id``, ``run_id``, ``status()``,
            ``wait(timeout=None)``, ``latest_checkpoint()``, ``cancel()``.

        Raises:
            ConfigError: a bad override or launcher value. GwenlakeError: sbatch failed.
        """
        module, _, name = SUBMITTER.partition(":")
        return getattr(importlib.import_module(module), name)(self.target, overrides, job)

    def __repr__(self) -> str:
        return f"<training {self.target} -> {self.output.name}>"


def split_train_kwargs(kwargs: Mapping[str, Any], settings: tuple[str, ...] = tuple(DEFAULTS),
                       refused: Mapping[str, str] | None = None) -> tuple[dict[str, Binding], dict[str, Any]]:
    """Split ``@train`` keyword arguments into bindings (Input/Output/Model) and settings over :data:`DEFAULTS`.

    Raises:
        TrainDefinitionError: a keyword in ``refused`` (its message says why), or neither a binding nor one of
            ``settings``.
    """
    bindings: dict[str, Binding] = {}
    defaults = dict(DEFAULTS)
    for key, value in kwargs.items():
        if isinstance(value, (Input, Output, Model)):
            bindings[key] = value
        elif refused and key in refused:
            raise TrainDefinitionError(f"@train {key}={value!r}: {refused[key]}")
        elif key in settings:
            defaults[key] = value
        else:
            raise TrainDefinitionError(f"@train got {key}={value!r}: not a binding (Input/Output/Model) nor a "
                                       f"setting ({', '.join(settings)})")
    return bindings, defaults


def train(*, prepare: Callable[..., Any] | None = None, **kwargs: Any) -> Callable[[Callable[..., Any]], TrainFunction]:
    """Declare a training function.

    Keyword arguments are either bindings (``Input``, ``Output``, ``Model`` instances, by parameter name) or
    settings that the job config and command line override: ``steps`` (int, total optimisation steps),
    ``epochs`` (int, alternative to steps: epochs over the batches given to ``run.steps``), ``eval_every``
    (int, steps between ``run.at_eval``), ``seed`` (int), ``model`` (str, the run's name within the model),
    ``tracking`` (bool), ``name`` (str, same as ``model``), and for the SLURM launcher (defaults that
    ``launcher.*`` overrides; see :mod:`gwenlake_hpc.resources`): ``cpu`` (``"8"``), ``memory`` (``"32Gi"``,
    ``"500Mi"``, ``"2T"``, or a number of GiB), ``gpu`` (``"1"`` or ``"nvidia-a10g:1"``), ``env`` (dict),
    ``secrets`` (names of environment variables), ``max_retries`` (int), ``image`` (the container image the job
    runs in: ``launcher.container.image``); ``metadata`` (dict) becomes tags of the
    MLflow run.
    ``prepare`` is an optional ``callable(catalog, config)`` called before inputs are opened.

    The function must accept every binding by name and a ``run`` parameter (a :class:`gwenlake_hpc.run.Run`);
    a ``config`` parameter, if declared, receives the job's hyperparameters (an instance of its annotated
    dataclass, else a mapping). Its return value (a dict of metrics, or None for ``run.summary()``) becomes the
    model's metrics.

    Raises:
        TypeError: an unknown keyword, a binding without a parameter, not exactly one Output.
    """
    bindings, defaults = split_train_kwargs(kwargs)

    def decorate(fn: Callable[..., Any]) -> TrainFunction:
        tf = TrainFunction(fn, bindings, defaults, prepare)
        REGISTRY[tf.target] = tf
        return tf

    return decorate
