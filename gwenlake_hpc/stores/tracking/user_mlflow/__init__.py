"""MLflow's own API inside a training function, reporting into the job's run.

The user's side of tracking: a training function that calls ``mlflow.log_metric``, ``mlflow.autolog()``... reports
into the job's one MLflow run, through the same spool as the package's own points, with nothing to configure.

- :mod:`.fluent`: :func:`reporting`, the context in which the job routes MLflow's fluent API of the process to
  the ``gwenlake-job:`` URI (environment, MLflow's own URI, the fluent run, autolog's dataset warnings), and the
  plug-ins' registration where the package's entry points are missing.
- :mod:`.sink`: where those calls go: the job's Tracker in the training process, a spool segment of its own in a
  forked process (a DataLoader worker), or nowhere when tracking is off. Imports no MLflow.
- :mod:`.mlflow_plugin`: the tracking store (``JobStore``) and artifact repository (``JobArtifactRepository``)
  MLflow loads for the ``gwenlake-job:`` schemes through the entry points in ``pyproject.toml``; the only module
  here that imports MLflow, loaded only by a process whose code calls MLflow.

Writes go to the delivery side (:mod:`..delivery.spool`); nothing of the delivery side imports this package.
"""

from .fluent import reporting

__all__ = ["reporting"]
