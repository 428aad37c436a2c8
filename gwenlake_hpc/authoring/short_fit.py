"""Short fits, the decorator's data: :class:`ShortFit` (a function whose inputs arrive as DataFrames, no ``Run``),
its settings and ``to_frame`` (a dataset as a pandas or Polars DataFrame, a column of shape ``[rows, k]`` as ``k``
columns ``<name>_0 .. <name>_<k-1>``).

Users import them from :mod:`gwenlake_hpc.transforms` (the facade, with the usage example and ``.local()`` /
``.submit()``). Inside, the job runs a short fit as a training of one step: the MLflow run gets the params and
the returned metrics, no checkpoint is written, and an interruption starts it over on the next start.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import typing
from typing import Any, Callable

from .api import DEFAULTS, Input, Model, Output, TrainFunction, split_train_kwargs
from ..base.errors import TrainDefinitionError
from .resources import parse_resources
from ..runtime.signals import StopInterrupt

log = logging.getLogger("gwenlake_hpc.transforms")

__all__ = ["Input", "Output", "Model", "ShortFit", "to_frame", "short_fit_settings"]

#: Settings of a long training that mean nothing for a short fit.
_LOOP_SETTINGS = ("steps", "epochs", "eval_every")


def to_frame(dataset: Any, polars: bool = False) -> Any:
    """Read a whole :class:`gwenlake_hpc.data.Dataset` into a DataFrame.

    Columns keep their order; a column of shape ``[rows, k]`` becomes ``k`` columns ``<name>_<i>``; string
    columns stay strings. ``polars=True`` gives a ``polars.DataFrame`` (Polars is an optional extra).

    Raises:
        TrainDefinitionError: ``polars=True`` without Polars installed.
    """
    import numpy as np

    columns = dataset.read(dataset.columns)
    flat: dict[str, Any] = {}
    for name in dataset.columns:
        values = np.asarray(columns[name])
        if values.ndim == 1:
            flat[name] = values
        else:
            wide = values.reshape(len(values), -1)
            for i in range(wide.shape[1]):
                flat[f"{name}_{i}"] = wide[:, i]
    if polars:
        try:
            import polars as pl
        except ImportError:
            raise TrainDefinitionError("a parameter annotated polars.DataFrame needs Polars: pip install polars") \
                from None
        return pl.DataFrame(flat)
    import pandas as pd

    return pd.DataFrame(flat)


class ShortFit(TrainFunction):
    """A decorated short fit. Calling it calls the plain function; the job runs :attr:`fn`, a one-step
    training that reads the inputs into DataFrames and calls it."""

    is_short = True

    def __init__(self, user_fn: Callable[..., Any], bindings: dict[str, Any], defaults: dict[str, Any],
                 prepare: Callable[..., Any] | None):
        params = inspect.signature(user_fn).parameters
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [n for n in bindings if n not in params and not accepts_kwargs]
        if missing:
            raise TrainDefinitionError(f"@train on {user_fn.__qualname__}: the function has no parameter for "
                                       f"{', '.join(missing)}; add it to the signature")
        if "run" in params:
            raise TrainDefinitionError(f"@train on {user_fn.__qualname__}: a short fit has no `run`; use "
                                       "gwenlake_hpc.train (a long training) to own a loop")
        try:
            hints = typing.get_type_hints(user_fn)
        except Exception:  # unresolved forward references: by name below
            hints = {}
        self.polars_inputs = {n for n, b in bindings.items() if isinstance(b, Input)
                              and _is_polars(hints.get(n, params[n].annotation if n in params else None))}
        self.user_fn = user_fn

        @functools.wraps(user_fn)
        def one_step(run: Any, **kwargs: Any) -> Any:
            for name in bindings:
                if isinstance(bindings[name], Input):
                    kwargs[name] = to_frame(kwargs[name], polars=name in self.polars_inputs)
                elif isinstance(bindings[name], Output):  # a start begins from nothing: no file of a stopped one
                    _empty(kwargs[name].path)
            result = None
            for _ in run.steps():
                try:
                    # A stop signal ends the fit where it is (nothing is saved half-way): exit 75, and the
                    # next start fits again from the beginning.
                    with run.interruptible():
                        result = user_fn(**kwargs)
                except StopInterrupt as stop:
                    log.warning("short fit stopped (%s) before its end: nothing is committed; run the same job "
                                "again to fit from the start", stop)
                    run.evicted = True
                    return None
            return None if run.evicted else result

        del one_step.__wrapped__  # the job inspects one_step itself: it takes `run`
        super().__init__(one_step, bindings, defaults, prepare)
        self.wants_config = "config" in params
        hint = hints.get("config")
        self.config_type = hint if self.wants_config and hint is not None and dataclasses.is_dataclass(hint) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.user_fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<short fit {self.target} -> {self.output.name}>"


def _empty(folder: Any) -> None:
    import shutil
    from pathlib import Path

    for p in Path(folder).iterdir() if Path(folder).is_dir() else ():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _is_polars(annotation: Any) -> bool:
    if annotation is None or annotation is inspect.Parameter.empty:
        return False
    text = annotation if isinstance(annotation, str) else f"{getattr(annotation, '__module__', '')}." \
                                                           f"{getattr(annotation, '__qualname__', '')}"
    return "polars" in text and text.endswith("DataFrame")


def short_fit_settings(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A short fit's ``@train`` keyword arguments split into bindings and settings (see
    :func:`gwenlake_hpc.transforms.train`), its loop fixed at one step and its declared resources checked.

    Raises:
        TrainDefinitionError: an unknown keyword, a loop setting, a bad declared resource.
    """
    no_loop = "a short fit has no loop; use gwenlake_hpc.train for a training of many steps"
    bindings, defaults = split_train_kwargs(kwargs, tuple(k for k in DEFAULTS if k not in _LOOP_SETTINGS),
                                            refused=dict.fromkeys(_LOOP_SETTINGS, no_loop))
    defaults.update(steps=1, epochs=None, eval_every=1)
    parse_resources(defaults)  # declared resources checked here too, at import
    return bindings, defaults
