"""The delivery process and the spool: MLflow out of the training process, kills of either side, restarts.

Real MLflow (SQLite stores), real processes and signals.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.concurrency import wait_until
from gwenlake_hpc.stores.tracking import Tracker, default_uri
from gwenlake_hpc.stores.tracking import spool as spool_mod
from gwenlake_hpc.stores.tracking import delivery_process
from gwenlake_hpc.stores.tracking.spool import SpoolReader, SpoolWriter, encode, points_of, read_all, segment_paths


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


# ------------------------------------------------------------------------------------------
# the spool


def test_spool_segments_locks_rotation_and_torn_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "ROTATE_BYTES", 4000)
    writer = SpoolWriter(tmp_path)
    points = [("loss", 1.0 / s, s, 1_700_000_000_000 + s) for s in range(1, 301)]
    for i in range(0, 300, 10):
        writer.append(encode(points[i:i + 10]))
    writer.append(encode([{"tags": {"k": "v"}}, ("nan", float("nan"), 1, 5), ("inf", float("-inf"), 1, 5)]))
    segments = segment_paths(tmp_path)
    assert len(segments) > 3 and segments == sorted(segments)
    entries = read_all(tmp_path)
    assert points_of(entries)[:300] == points
    assert {"tags": {"k": "v"}} in entries
    nan, inf = points_of(entries)[300:]
    assert nan[1] != nan[1] and inf[1] == float("-inf")

    reader = SpoolReader(tmp_path)
    for path in segments:
        while True:
            got, end = reader.read(path, 50)
            if end == reader.offsets.get(path, 0):
                break
            reader.advance(path, end)
    # The writer is alive: its current segment stays; the ones it rotated away from go.
    assert [reader.try_remove(p) for p in segments] == [True] * (len(segments) - 1) + [False]
    assert segment_paths(tmp_path) == [writer.path]
    writer.append(b'{"key": "loss", "val')  # killed in the middle of a line
    writer.close()
    assert reader.try_remove(writer.path) is True and reader.malformed == 1
    assert segment_paths(tmp_path) == []

    again = SpoolWriter(tmp_path)  # a later start numbers on from nothing left
    assert again.path.name == "00000001.jsonl"
    again.close()


# ------------------------------------------------------------------------------------------
# the delivery process


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


def test_the_training_process_never_imports_mlflow(tmp_path: Path) -> None:
    uri = default_uri(tmp_path)
    out = subprocess.run([sys.executable, "-c", TRAINING, uri, str(tmp_path / "tracking"), "finish"],
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, last = (json.loads(line) for line in out.stdout.splitlines())
    assert last == {"result": True, "mlflow_imported": False}
    assert not alive(first["child"])
    client = MlflowClient(uri)
    run_id = (tmp_path / "tracking" / "run_id").read_text().strip()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert steps_of(client, run_id) == list(range(1, 201))


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


def test_the_delivery_process_ignores_sigterm_and_is_restarted_when_it_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(delivery_process, "RESTART_EVERY_S", 0.5)
    uri = default_uri(tmp_path)
    tracker = Tracker(uri, "exp", "r", tmp_path / "tracking", flush_interval_s=0.2)
    for step in range(1, 101):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    assert tracker.wait_attached(120)
    pid = tracker._delivery.proc.pid
    os.kill(pid, signal.SIGTERM)  # SLURM's eviction signal reaches every process of the job step
    for step in range(101, 201):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    client = MlflowClient(uri)
    wait_for(lambda: len(steps_of(client, tracker.run_id)) == 200, what="200 points after a SIGTERM")
    assert alive(pid)

    os.kill(pid, signal.SIGKILL)  # the OOM killer
    for step in range(201, 301):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    wait_for(lambda: tracker._delivery.proc is not None and tracker._delivery.proc.pid != pid, what="a new delivery process")
    assert tracker.finish("FINISHED", timeout_s=120) is True
    assert steps_of(client, tracker.run_id) == list(range(1, 301))
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert any("delivery process exited" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)


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
