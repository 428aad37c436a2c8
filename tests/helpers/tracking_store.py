"""What the tests of test_tracking_store.py share across their tiers (unit/, integration/, cluster/)."""

from __future__ import annotations

CREATE = ("import sys; from gwenlake_hpc.stores.tracking import ensure_sqlite_store as e; from mlflow import MlflowClient;"
          "e(sys.argv[1]); c = MlflowClient(sys.argv[1]);"
          "x = c.create_experiment(sys.argv[2]); c.create_run(x); print('ok')")
