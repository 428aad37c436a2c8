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
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gwenlake_hpc.stores.tracking import Tracker, default_uri
from gwenlake_hpc.stores.tracking.delivery import spool as spool_mod
from gwenlake_hpc.stores.tracking.delivery.spool import SpoolReader, SpoolWriter, encode, points_of, read_all, segment_paths
from helpers.tracking_delivery import alive, child_env, steps_of, TRAINING, wait_for


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


def test_the_delivery_process_ignores_sigterm_and_is_restarted_when_it_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
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
    assert any(f"delivery process (pid {pid}) died while the training runs (killed by signal SIGKILL)"
               in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


