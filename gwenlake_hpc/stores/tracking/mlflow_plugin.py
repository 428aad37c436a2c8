"""The MLflow plug-ins' path before the tracking sub-packages: forwards to :mod:`.user_mlflow.mlflow_plugin`.

An install made before the move (``pip install -e .`` not run again) declares ``mlflow.tracking_store`` and
``mlflow.artifact_repository`` entry points that name ``gwenlake_hpc.stores.tracking.mlflow_plugin``; MLflow
loads them by that name, and the training function's MLflow calls must keep working there. ``pyproject.toml``
names the new path; this module can go once every environment has been installed again.
"""

from .user_mlflow.mlflow_plugin import JobArtifactRepository, JobStore

__all__ = ["JobArtifactRepository", "JobStore"]
