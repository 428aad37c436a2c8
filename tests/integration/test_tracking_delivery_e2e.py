"""The delivery process and the spool: MLflow out of the training process, kills of either side, restarts.

Real MLflow (SQLite stores), real processes and signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking import Tracker, default_uri
from gwenlake_hpc.stores.tracking.delivery.spool import segment_paths
from helpers.tracking_delivery import alive, child_env, steps_of, TRAINING, wait_for


# ------------------------------------------------------------------------------------------
# the spool


# ------------------------------------------------------------------------------------------
# the delivery process


def kill_training_at_its_first_line(uri: str, state: Path, mode: str, attached: bool | None = None) -> str:
    """Start TRAINING in ``mode``, SIGKILL it once it printed its first line (``attached=False``: check that the
    run was not attached yet), wait for the orphaned delivery process to end; returns the stderr of both."""
    proc = subprocess.Popen([sys.executable, "-c", TRAINING, uri, str(state), mode], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(proc.stdout.readline())
    if attached is False:
        assert not (state / "run_id").exists()
    proc.kill()
    _, stderr = proc.communicate(timeout=120)  # until the orphaned delivery process closes stderr too
    # The delivery process delivers what the training had written, then exits on its own.
    wait_for(lambda: not alive(first["child"]), 120, "the orphaned delivery process to end")
    return stderr


@pytest.mark.slow
def test_a_sigkilled_training_leaves_its_points_delivered_by_the_orphaned_delivery(tmp_path: Path) -> None:
    uri = default_uri(tmp_path)
    state = tmp_path / "tracking"
    kill_training_at_its_first_line(uri, state, "die")
    client = MlflowClient(uri)
    run_id = (state / "run_id").read_text().strip()
    steps = steps_of(client, run_id)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 200  # no gap, no point twice
    assert client.get_run(run_id).info.status == "RUNNING"  # killed: no status
    assert segment_paths(state) == []  # all delivered, and the dead writer's segment removed

    # The next start reattaches and goes on, each step once.
    again = Tracker(uri, "exp", "r", state, flush_interval_s=0.2)
    for step in range(len(steps) - 50, 401):  # replays after its "checkpoint"
        again.log_metrics({"loss": 1.0 / step}, step)
    assert again.finish("FINISHED", timeout_s=120) is True
    assert again.run_id == run_id and steps_of(client, run_id) == list(range(1, 401))


@pytest.mark.slow
def test_a_training_killed_before_the_attach_is_not_reported_as_an_mlflow_outage(tmp_path: Path) -> None:
    # The delivery process's events then have no reader: that is no reason to call MLflow unreachable.
    uri = default_uri(tmp_path)
    state = tmp_path / "tracking"
    stderr = kill_training_at_its_first_line(uri, state, "die-early", attached=False)
    client = MlflowClient(uri)
    run_id = (state / "run_id").read_text().strip()
    assert steps_of(client, run_id) == list(range(1, 11))
    assert "not answering" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_a_delivery_process_killed_just_before_the_end_is_started_again_by_finish(tmp_path: Path) -> None:
    """The restart of a dead delivery process waits 30 s during the loop; at the end it is immediate."""
    uri = default_uri(tmp_path)
    tracker = Tracker(uri, "exp", "r", tmp_path / "tracking", flush_interval_s=0.2)
    for step in range(1, 101):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    assert tracker.wait_attached(120)
    os.kill(tracker._delivery.proc.pid, signal.SIGKILL)
    tracker._delivery.proc.wait(30)
    for step in range(101, 201):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    assert tracker.finish("FINISHED", timeout_s=120) is True
    client = MlflowClient(uri)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert steps_of(client, tracker.run_id) == list(range(1, 201))
    assert segment_paths(tmp_path / "tracking") == [] and not (tmp_path / "tracking" / "pending_status").exists()
