"""A training that calls MLflow's own API each step (issue 15), for tests/*/test_user_mlflow*.py.

GWL_TEST_SIGTERM_AT=k  the process sends itself SIGTERM during step k (a real signal).
GWL_TEST_SHORT_WAIT=r:g  the short fit, after its third point, creates file r and waits for file g.
Each start appends ``mlflow.active_run().info.run_id`` (seen at its first step) to ./active_runs, and a forked
child process logs ``from_child`` at that step.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import mlflow
import numpy as np

from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.transforms import train as train_short


def _child_logs(step: int) -> None:
    mlflow.log_metric("from_child", float(step), step=step)


@train(data=Input("t.rows"), output=Output("u.model"), steps=40, eval_every=10)
def fit(data, output, run):
    w = np.zeros(4)
    if run.resumed:
        w = np.array(json.loads((run.resume_path / "w.json").read_text()))
    sigterm_at = int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1"))
    mlflow.log_param("user.lr", 0.05)
    mlflow.set_tag("user.tag", "hello")
    for step, batch in run.steps(data.batches(16, columns=["x", "y"])):
        if step == run.start_step + 1:
            active = mlflow.active_run()
            with open("active_runs", "a") as fh:
                fh.write(f"{active.info.run_id if active else None}\n")
            # a process forked from the training (as a DataLoader worker is) logs into the same run
            child = multiprocessing.get_context("fork").Process(target=_child_logs, args=(step,))
            child.start()
            child.join()
        x, y = batch["x"].numpy(), batch["y"].numpy()
        err = x @ w - y
        w -= 0.05 * x.T @ err / len(y)
        loss = float((err ** 2).mean())
        run.log({"loss": loss})
        mlflow.log_metric("custom", loss * 2, step=step)
        mlflow.log_metrics({"custom_a": float(step), "custom_b": -float(step)}, step=step)
        mlflow.log_metric("custom_nostep", 1.0)
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if run.at_eval:
            with run.checkpoint(keep=2) as ck:
                ck.path("w.json").write_text(json.dumps(w.tolist()))
    if run.evicted:
        return None
    with mlflow.start_run():  # the usual idiom: the job's run again
        mlflow.log_params({"user.final": "yes", "user.rows": data.rows})
        mlflow.set_tags({"user.done": "1"})
        mlflow.log_dict({"w": w.tolist()}, "notes/weights.json")
    Path("note.txt").write_text("a note\n")
    mlflow.log_artifact("note.txt", "notes")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3])
    mlflow.log_figure(fig, "figures/plot.png")
    output.file("w.json").write_text(json.dumps(w.tolist()))
    return {"loss": loss}


@train_short(data=Input("t.rows"), output=Output("u.short"))
def fit_short(data, output):
    mlflow.log_param("user.kind", "short")
    wait = os.environ.get("GWL_TEST_SHORT_WAIT")  # "reached:go": after step 3, create reached, wait for go
    for i in range(5):
        mlflow.log_metric("short_metric", float(i), step=i + 1)
        if wait and i == 2:
            reached, go = map(Path, wait.split(":"))
            reached.touch()
            while not go.exists():
                time.sleep(0.05)
    mlflow.log_dict({"kind": "short"}, "short.json")
    _autolog_fits(data)
    (output.path / "model.json").write_text(json.dumps({"rows": len(data)}))
    return {"rows": float(len(data))}


def _autolog_fits(data) -> None:
    """Plain ``mlflow.sklearn.autolog()``: its model is refused (the message names the fix); numpy features with a
    pandas target trip MLflow's own dataset logging (twice: reported once); a DataFrame is a dataset input."""
    import mlflow.sklearn
    from sklearn.linear_model import LinearRegression

    mlflow.sklearn.autolog()
    features = data[[f"x_{i}" for i in range(4)]]
    for _ in range(2):
        LinearRegression().fit(features.to_numpy(), data["y"])
    LinearRegression().fit(features, data["y"])
    mlflow.sklearn.autolog(disable=True)


@train(data=Input("t.rows"), output=Output("u.inner"), steps=5, eval_every=5)
def fit_inner(data, output, run):
    """Imports MLflow in its body and leaves the run it starts active when it returns."""
    import mlflow as ml

    for step, _ in run.steps(data.batches(16, columns=["x"])):
        ml.log_metric("inner", float(step), step=step)
    output.file("done.txt").write_text("done")
