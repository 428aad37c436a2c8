"""The decorator's data: what a training function declares about itself (:class:`TrainFunction`), the registry
of decorated functions and the settings ``@train`` takes. The public ``@train``, whose functions also have
``.local()`` and ``.submit()``, is :mod:`gwenlake_hpc.decorator` (on top of the job and the launchers).

    @train(training_set=Input("crm.churn-train"), output=Output("crm.churn"), steps=30_000, eval_every=1_000)
    def fit(training_set, output, run, config): ...

Bindings are declarations; the job (``gwenlake_hpc.job.execute``) resolves them when it runs: an ``Input`` becomes a
:class:`gwenlake_hpc.data.Dataset`, an ``Output`` a bound ``Output`` with a directory in the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Mapping, TypeVar

from ..base.errors import TrainDefinitionError
from .bindings import Binding, Input, Model, Output, resolve_params
from ..base.names import check_name
from .resources import parse_resources

#: Re-exported: the bindings live in :mod:`gwenlake_hpc.authoring.bindings` (``fit.local`` and the job import
#: them without the decorator).
__all__ = ["Input", "Output", "Model", "TrainFunction", "resolve_params", "check_name", "DEFAULTS",
           "REGISTRY", "split_train_kwargs", "decorator"]


DEFAULTS: dict[str, Any] = {
    "steps": None, "epochs": None, "eval_every": 1000, "seed": 0, "model": None, "tracking": True,
    "cpu": None, "memory": None, "gpu": None, "env": None, "secrets": None, "metadata": None, "max_retries": None,
    "name": None, "image": None,
}

TF = TypeVar("TF", bound="TrainFunction")

#: Every decorated function, by target ``module:qualname``.
REGISTRY: dict[str, "TrainFunction"] = {}


class TrainFunction:
    """A decorated training function: the plain function plus what it declared.

    Attributes:
        fn: the function itself (calling the TrainFunction calls it unchanged).
        bindings: parameter name -> Input / Output / Model.
        defaults: the decorator's settings (``steps``, ``epochs``, ``eval_every``, ``seed``, ``model``,
            ``tracking``, resources ``cpu``/``memory``/``gpu``...), overridden by the job config.
        resources: the declared :class:`gwenlake_hpc.authoring.resources.Resources` (parsed at import).
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


def decorator(cls: type[TF], bindings: dict[str, Binding], defaults: dict[str, Any],
              prepare: Callable[..., Any] | None) -> Callable[[Callable[..., Any]], TF]:
    """The decorator ``@train(...)`` returns: each function it decorates becomes a ``cls`` (a
    :class:`TrainFunction`), recorded in :data:`REGISTRY` under its target. The public ``@train``
    (:mod:`gwenlake_hpc.decorator`, :mod:`gwenlake_hpc.transforms`) passes its own class, the one with
    ``.local()`` and ``.submit()``."""

    def decorate(fn: Callable[..., Any]) -> TF:
        tf = cls(fn, bindings, defaults, prepare)
        REGISTRY[tf.target] = tf
        return tf

    return decorate
