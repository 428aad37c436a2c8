"""Short fits (gwenlake_hpc.transforms): DataFrames in, a version out, through the same job as a long training."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient


@pytest.mark.slow
def test_a_short_fit_is_a_version_with_its_mlflow_run_and_runs_locally(project):
    done = project.run("job.target=trainer.py:short", "+job.params.lr=0.5", check=0)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "short fit: 200 rows, columns ['x_0', 'x_1', 'x_2', 'x_3', 'y'], lr 0.5" in out
    version = done.stdout.strip().splitlines()[-1].split()[-1]
    metrics = json.loads(project.git("show", f"{version}:t/model/metrics.json"))
    lineage = json.loads(project.git("show", f"{version}:t/model/lineage.json"))
    assert metrics["mse"] < 0.05 and lineage["final_step"] == 1 and lineage["target"].endswith(":short")
    assert "t/model/w.npy" in project.git("ls-tree", "-r", "--name-only", version)
    client = MlflowClient(tracking_uri=f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    run = client.get_run((run_dir / "tracking" / "run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.data.metrics["mse"] == metrics["mse"]
    assert run.data.params["params.lr"] == "0.5"
    again = project.run("job.target=trainer.py:short", "+job.params.lr=0.5", check=0)
    assert again.stdout.strip().splitlines()[-1].split()[-1] == version  # finished: nothing trained twice

    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("trainer_short_local", project.root / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    local = module.short.local(data_root=project.root / "data")
    assert local["mse"] == pytest.approx(metrics["mse"])


@pytest.mark.slow
def test_a_stop_signal_ends_a_short_fit_at_once_and_the_next_start_fits_again(project, tmp_path):
    """SIGTERM in the middle of a short fit: exit 75 without waiting for its end, nothing committed; a stale
    output file of the stopped start is not committed by the next one."""
    import signal

    from helpers.concurrency import wait_until

    reached, go = tmp_path / "reached", tmp_path / "go"
    proc = project.popen("job.target=trainer.py:short", env={"GWL_TEST_SHORT_WAIT": f"{reached}:{go}"})
    wait_until(reached.exists, timeout_s=300, what="the short fit to start")
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    (run_dir / "output" / "stale.txt").write_text("from the stopped start")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)  # `go` never appears: only the signal can end it
    assert proc.returncode == 75, out + err
    assert "short fit stopped (SIGTERM)" in out + err
    assert project.git("branch", "--list", "models/t.model") == ""
    again = project.run("job.target=trainer.py:short", check=0)
    assert again.returncode == 0, again.stdout + again.stderr
    version = again.stdout.strip().splitlines()[-1].split()[-1]
    assert "t/model/stale.txt" not in project.git("ls-tree", "-r", "--name-only", version)


