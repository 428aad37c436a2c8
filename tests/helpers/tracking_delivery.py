"""The delivery process's tests: a training program run in a subprocess, its environment, polling."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from mlflow import MlflowClient

from helpers.concurrency import wait_until


def steps_of(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def wait_for(pred, timeout_s: float = 120.0, what: str = "") -> None:
    wait_until(pred, timeout_s, what)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


TRAINING = textwrap.dedent("""
    import json, sys, time
    from gwenlake_hpc.stores.tracking import Tracker
    uri, state, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    t = Tracker(uri, "exp", "r", state, flush_interval_s=0.2)
    if mode == "die-early":  # killed before the delivery process has attached the run (it imports MLflow first)
        for step in range(1, 11):
            t.log_metrics({"loss": 1.0 / step}, step)
        assert t.make_durable()
        print(json.dumps({"durable": 10, "child": t._delivery.proc.pid}), flush=True)
        time.sleep(600)
    for step in range(1, 201):
        t.log_metrics({"loss": 1.0 / step}, step)
    assert t.make_durable()
    print(json.dumps({"durable": 200, "child": t._delivery.proc.pid}), flush=True)
    if mode == "finish":
        ok = t.finish("FINISHED", timeout_s=120)
        print(json.dumps({"result": ok, "mlflow_imported": "mlflow" in sys.modules}), flush=True)
    else:
        for step in range(201, 301):
            t.log_metrics({"loss": 1.0 / step}, step)
        time.sleep(600)
""")
