"""A Python program, run in subprocesses, that creates a SQLite MLflow store, an experiment and a run."""

from __future__ import annotations

CREATE = ("import sys; from gwenlake_hpc.stores.tracking import ensure_sqlite_store as e; from mlflow import MlflowClient;"
          "e(sys.argv[1]); c = MlflowClient(sys.argv[1]);"
          "x = c.create_experiment(sys.argv[2]); c.create_run(x); print('ok')")
