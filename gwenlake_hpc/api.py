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
import typing
from typing import Any, Callable, Mapping

from .errors import TrainDefinitionError
from .bindings import Binding, Input, Model, Output, resolve_params
from .names import check_name
from .resources import parse_resources

#: Re-exported: the bindings live in :mod:`gwenlake_hpc.bindings` (``fit.local`` and the job import them
#: without the decorator).
__all__ = ["Input", "Output", "Model", "TrainFunction", "train", "resolve_params", "check_name", "DEFAULTS",
           "REGISTRY", "SUBMITTER", "split_train_kwargs"]


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
