"""``@train``, the public decorator: a training function becomes a :class:`Training`, the decorator's data
(:class:`~gwenlake_hpc.authoring.api.TrainFunction`) plus ``.local()`` and ``.submit()``.

    @train(training_set=Input("crm.churn-train"), output=Output("crm.churn"), steps=30_000, eval_every=1_000)
    def fit(training_set, output, run, config): ...

This module sits on top of the layers: ``.local()`` and ``.submit()`` import the job and the SLURM launcher when
they are called (a real import inside the method), so decorating a function loads neither.
"""

from __future__ import annotations

from typing import Any, Callable

from .authoring.api import TrainFunction, decorator, split_train_kwargs
from .authoring.bindings import Input, Model, Output

__all__ = ["train", "Training", "Launchable", "Input", "Output", "Model", "TrainFunction"]


class Launchable:
    """``.local()`` and ``.submit()`` of a decorated function (mixed into a :class:`TrainFunction`)."""

    target: str

    def local(self, config: Any = None, **kwargs: Any) -> Any:
        """Run this training in this process, for a quick try: no tracking, no commit, a temporary run
        directory; returns what the function returned. ``fit.local(steps=50)`` is a smoke run.

        Keyword arguments: ``steps``, ``epochs``, ``seed``, ``eval_every``, ``data_root`` (default ``data``),
        ``run_dir`` (keep the run directory there), ``progress`` and bindings by name (see
        :func:`gwenlake_hpc.job.local.run_local`).

        Raises:
            ConfigError: an unknown binding or bad setting; whatever the function raises.
        """
        from .job.local import run_local

        return run_local(self, config, **kwargs)  # type: ignore[arg-type]

    def submit(self, *overrides: str, job: str | None = None):  # type: ignore[no-untyped-def]
        """Submit this training to SLURM (``launcher=slurm``) and return a handle.

        Args:
            overrides: Hydra overrides, e.g. ``"job.steps=5000"``, ``"launcher.partition=gpu"``.
            job: a job config name (``conf/job/<job>.yaml``) to start from; default: this function alone.

        Returns:
            :class:`gwenlake_hpc.launch.status.JobHandle` with ``job_id``, ``run_id``, ``status()``,
            ``wait(timeout=None)``, ``latest_checkpoint()``, ``cancel()``.

        Raises:
            ConfigError: a bad override or launcher value.
            GwenlakeError: sbatch failed.
        """
        from .launch.slurm import submit_training

        return submit_training(self.target, overrides, job)


class Training(Launchable, TrainFunction):
    """A function decorated with ``@train``: a :class:`TrainFunction` with ``.local()`` and ``.submit()``."""


def train(*, prepare: Callable[..., Any] | None = None, **kwargs: Any) -> Callable[[Callable[..., Any]], Training]:
    """Declare a training function.

    Keyword arguments are either bindings (``Input``, ``Output``, ``Model`` instances, by parameter name) or
    settings that the job config and command line override: ``steps`` (int, total optimisation steps),
    ``epochs`` (int, alternative to steps: epochs over the batches given to ``run.steps``), ``eval_every``
    (int, steps between ``run.at_eval``), ``seed`` (int), ``model`` (str, the run's name within the model),
    ``tracking`` (bool), ``name`` (str, same as ``model``), and for the SLURM launcher (defaults that
    ``launcher.*`` overrides; see :mod:`gwenlake_hpc.authoring.resources`): ``cpu`` (``"8"``), ``memory`` (``"32Gi"``,
    ``"500Mi"``, ``"2T"``, or a number of GiB), ``gpu`` (``"1"`` or ``"nvidia-a10g:1"``), ``env`` (dict),
    ``secrets`` (names of environment variables), ``max_retries`` (int), ``image`` (the container image the job
    runs in: ``launcher.container.image``); ``metadata`` (dict) becomes tags of the
    MLflow run.
    ``prepare`` is an optional ``callable(catalog, config)`` called before inputs are opened.

    The function must accept every binding by name and a ``run`` parameter (a :class:`gwenlake_hpc.runtime.run.Run`);
    a ``config`` parameter, if declared, receives the job's hyperparameters (an instance of its annotated
    dataclass, else a mapping). Its return value (a dict of metrics, or None for ``run.summary()``) becomes the
    model's metrics.

    Raises:
        TypeError: an unknown keyword, a binding without a parameter, not exactly one Output.
    """
    bindings, defaults = split_train_kwargs(kwargs)
    return decorator(Training, bindings, defaults, prepare)
