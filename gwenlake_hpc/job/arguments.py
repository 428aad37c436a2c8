"""The training function's arguments from its bindings: one resolution for the job and for ``fit.local()``.

Each declared binding becomes the argument of its parameter: an ``Output`` its folder, an ``Input`` its opened
dataset, a ``Model`` its files' folder and version. Where the datasets and the models' files come from is the
caller's: the job opens the plan's revisions (:func:`gwenlake_hpc.job.plan.open_inputs`) and exports the planned
model versions (:mod:`gwenlake_hpc.job.execute`); ``fit.local()`` takes what the user gave, else the catalog and
the registry (:mod:`gwenlake_hpc.job.local`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..authoring.bindings import Input, Model, Output

if TYPE_CHECKING:
    from ..authoring.api import TrainFunction


def bind_arguments(tf: TrainFunction, output: Path, datasets: Mapping[str, Any],
                   model_files: Callable[[str, Model], tuple[Path, str]]) -> dict[str, Any]:
    """``{parameter name: argument}`` for every binding of ``tf`` (``run`` and ``config`` are not bindings).

    Args:
        output: the folder every ``Output`` binds to (created by the binding).
        datasets: the opened dataset of every ``Input``, by parameter name.
        model_files: ``(parameter name, Model) -> (folder of the model's files, version)`` for every ``Model``.

    Raises:
        KeyError: an ``Input`` missing from ``datasets`` (the caller opens every one).
    """
    kwargs: dict[str, Any] = {}
    for name, b in tf.bindings.items():
        if isinstance(b, Output):
            kwargs[name] = b.bind(output)
        elif isinstance(b, Input):
            kwargs[name] = datasets[name]
        elif isinstance(b, Model):
            kwargs[name] = b.bind(*model_files(name, b))
    return kwargs
