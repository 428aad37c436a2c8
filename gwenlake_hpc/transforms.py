"""Short fits: a training that holds its data in memory and lasts minutes, without a ``Run``.

    from gwenlake_hpc.transforms import train, Input, Output, Model

    @train(training_set=Input("crm.churn-train"), output=Output("crm.churn", predict="...", inputs=[...]))
    def fit(training_set, output, config: Params):      # training_set: a pandas DataFrame
        model = fit_something(training_set)
        joblib.dump(model, output.file("model.joblib"))
        return {"test_auc": ...}                          # the version's metrics

Each ``Input`` arrives as a pandas DataFrame (a Polars DataFrame when the parameter is annotated with
``polars.DataFrame``); a column of shape ``[rows, k]`` becomes ``k`` columns ``<name>_0 .. <name>_<k-1>``.
``Output`` and ``Model`` are the same bindings as a long training's. The result is versioned exactly like one
(commit on the model branch, lineage, registry, ``candidate`` alias, release gate) and runs the same ways:
``python -m gwenlake_hpc +job=NAME``, ``gwenlake-train``, ``launcher=slurm``, sweeps, ``fit.local()``.

Inside, the job runs it as a training of one step: the MLflow run gets the params and the returned metrics,
no checkpoint is written, and an interruption (preemption, time limit) starts it over on the next start.
"""

from __future__ import annotations

from typing import Any, Callable

from .authoring.api import decorator
from .authoring.short_fit import Input, Model, Output, ShortFit, short_fit_settings, to_frame
from .decorator import Launchable

__all__ = ["train", "Input", "Output", "Model", "ShortFit", "ShortTraining", "to_frame"]


class ShortTraining(Launchable, ShortFit):
    """A function decorated with ``gwenlake_hpc.authoring.short_fit.train``: a :class:`ShortFit` with ``.local()`` and
    ``.submit()``."""


def train(*, prepare: Callable[..., Any] | None = None, **kwargs: Any) -> Callable[[Callable[..., Any]], ShortTraining]:
    """Declare a short fit (see the module docstring).

    Keyword arguments: bindings (``Input``, ``Output``, ``Model`` by parameter name, exactly one Output) and the
    settings of :func:`gwenlake_hpc.train` except ``steps``, ``epochs`` and ``eval_every`` (``seed``,
    ``tracking``, ``model``/``name``, ``cpu``, ``memory``, ``gpu``, ``env``, ``secrets``, ``metadata``,
    ``max_retries``). ``prepare`` as for a long training.

    Raises:
        TrainDefinitionError: an unknown keyword, a loop setting, a binding without a parameter, a ``run``
            parameter, not exactly one Output, a bad declared resource.
    """
    bindings, defaults = short_fit_settings(kwargs)
    return decorator(ShortTraining, bindings, defaults, prepare)
