"""End-to-end: whole jobs in subprocesses, with real signals, a real SQLite MLflow store and real git."""

from __future__ import annotations

import json
import random
import signal
import time

import torch
from mlflow import MlflowClient

import pytest

from helpers.jobs import VERSION_PREFIX, assert_one_point_per_step, mlflow_runs, run_dir_of, version_of, weights_at


@pytest.mark.slow
def test_sigterm_at_random_step_resumes_bit_identical(project):
    ref = project.run("+job=t", "paths.runs_root=ref", check=0)
    ref_version = version_of(ref)

    k = random.Random().randint(3, 57)
    print("SIGTERM during step", k)
    evicted = project.run("+job=t", env={"GWL_TEST_SIGTERM_AT": str(k)}, check=75)
    assert VERSION_PREFIX not in evicted.stdout
    run_dir = run_dir_of(project)
    newest = sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1]
    # the step in progress had a checkpoint (k multiple of 10) or one more step was made to write one
    evict_step = k if k % 10 == 0 else k + 1
    assert newest == f"step-{evict_step:09d}"
    client, runs = mlflow_runs(project)
    assert [r.info.status for r in runs] == ["KILLED"]
    assert runs[0].data.tags["gwenlake.evicted_at_step"] == str(evict_step)

    # the second start runs on a host whose clock is an hour behind: its restart mark still is its first step
    resumed = project.run("+job=t", env={"GWL_TEST_CLOCK_SHIFT_S": "-3600"}, check=0)
    assert "resuming from step" in resumed.stdout + resumed.stderr
    version = version_of(resumed)
    starts = json.loads((run_dir / "run.json").read_text())["starts"]
    assert [s["first_step"] for s in starts] == [1, evict_step + 1] and starts[1]["time"] < starts[0]["time"]
    a, b = weights_at(project, ref_version), weights_at(project, version)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    client, runs = mlflow_runs(project)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["gwenlake.version"] == version
    # a finished run is not "evicted": the last eviction is kept as history under another name
    assert "gwenlake.evicted_at_step" not in runs[0].data.tags
    assert runs[0].data.tags["gwenlake.last_evicted_at_step"] == str(evict_step)
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 61))
    # checkpoint metrics: every eval step, plus the checkpoint written on eviction
    assert_one_point_per_step(client, runs[0].info.run_id, "train_loss", sorted({*range(10, 61, 10), evict_step}))

    lineage = json.loads(project.git("show", f"{version}:t/model/lineage.json"))
    assert lineage["final_step"] == 60 and len(lineage["starts"]) == 2
    assert lineage["code"]["commit"] == project.git("rev-parse", "HEAD")
    assert lineage["tracking"]["run_id"] == runs[0].info.run_id
    metrics = json.loads(project.git("show", f"{version}:t/model/metrics.json"))
    assert set(metrics) == {"final_loss"}
    # the version is built on the code commit: checking it out gives the code and the model
    assert project.git("show", f"{version}:trainer.py") == (project.root / "trainer.py").read_text().strip()

    again = project.run("+job=t", check=0)
    assert version_of(again) == version
    assert "nothing to train" in again.stdout + again.stderr

    report = project.run("report", str(run_dir), "--smoothing", "0.9", check=0)
    assert f"restart(s) marked at steps [{evict_step + 1}]; smoothing 0.9" in report.stdout
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    facts = json.loads((run_dir / "report.json").read_text())
    assert (facts["restarts_at_step"], facts["smoothing"]) == ([evict_step + 1], 0.9)
    # the goodput ledger's two starts (the rerun that found nothing to train made none)
    assert [(s["start"], s["end"], s["first_step"]) for s in facts["starts"]] == [
        (0, "evicted", 1), (1, "finished", evict_step + 1)]
    assert facts["goodput"]["starts"] == 2 and facts["goodput"]["lost_steps"] == 0
    assert 0 < facts["goodput"]["goodput"] < 1


@pytest.mark.slow
def test_external_sigterm_during_run(project):
    proc = project.popen("+job=t", "job.steps=400", env={"GWL_TEST_SLEEP": "0.01"})
    ck_dir = project.root / "runs" / "t.model"
    deadline = time.time() + 120
    while time.time() < deadline and not list(ck_dir.glob("*/checkpoints/step-000000020")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, out + err
    assert "evicted at step" in out + err
    resumed = project.run("+job=t", "job.steps=400", check=0)
    assert "resuming from step" in resumed.stdout + resumed.stderr
    client, runs = mlflow_runs(project)
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 401))


@pytest.mark.slow
def test_sigkill_while_writing_checkpoint_uses_previous(project):
    ref_version = version_of(project.run("+job=t", "paths.runs_root=ref", check=0))
    killed = project.run("+job=t", env={"GWL_TEST_SIGKILL_IN_CKPT": "30"})
    assert killed.returncode == -signal.SIGKILL
    ck = run_dir_of(project) / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert "step-000000020" in names and "step-000000030" not in names
    assert any(n.startswith(".partial-000000030") for n in names)  # the torn one, never loaded

    resumed = project.run("+job=t", check=0)
    log = resumed.stdout + resumed.stderr
    assert "resuming from step 20" in log
    assert not any(p.name.startswith(".partial") for p in ck.iterdir())
    a, b = weights_at(project, ref_version), weights_at(project, version_of(resumed))
    assert all(torch.equal(a[n], b[n]) for n in a)
    client, runs = mlflow_runs(project)
    assert len(runs) == 1
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 61))


@pytest.mark.slow
def test_longer_steps_extends_finished_run_and_params_start_new(project):
    v1 = version_of(project.run("+job=t", check=0))
    v2 = version_of(project.run("+job=t", "job.steps=80", check=0))
    assert v2 != v1
    assert project.git("rev-parse", f"{v2}^") == v1  # versions form the branch's history
    assert project.git("rev-parse", "models/t.model") == v2
    client, runs = mlflow_runs(project)
    assert len(runs) == 1
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 81))
    assert version_of(project.run("+job=t", check=0)) == v1  # back to 60 steps: the version of 60 steps
    shorter = project.run("+job=t", "job.steps=50")
    assert shorter.returncode == 2 and "below step 80" in shorter.stdout + shorter.stderr
    project.run("+job=t", "job.params.lr=0.02", check=0)
    assert len(list((project.root / "runs" / "t.model").iterdir())) == 2
    # the user's working tree, index and branch were never touched
    assert project.git("rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert project.git("status", "--porcelain", "--untracked-files=no") == ""


@pytest.mark.slow
def test_changed_tracking_uri_does_not_repoint_the_first_run(project):
    project.run("+job=t", check=0)
    rd = run_dir_of(project)
    first_id = (rd / "tracking" / "run_id").read_text().strip()
    other = f"sqlite:///{project.root / 'other.db'}"
    moved = project.run("+job=t", "job.steps=80", f"tracking.uri={other}", check=0)
    assert "differs from the one this run first reported to" in moved.stdout + moved.stderr
    assert (rd / "tracking" / "run_id").read_text().strip() == first_id
    project.run("+job=t", "job.steps=100", check=0)  # back on the first store: the same MLflow run
    client, runs = mlflow_runs(project)
    assert [r.info.run_id for r in runs] == [first_id]
    steps = sorted(m.step for m in client.get_metric_history(first_id, "loss"))
    assert steps == [*range(1, 61), *range(81, 101)]
    other_runs = MlflowClient(other).search_runs([MlflowClient(other).get_experiment_by_name("t.model").experiment_id])
    assert len(other_runs) == 1


@pytest.mark.slow
def test_tracking_false_touches_no_store(project):
    project.run("+job=t", "job.tracking=false", check=0)
    assert not (project.root / "runs" / "mlflow.db").exists()
    assert not (run_dir_of(project) / "tracking").exists()


@pytest.mark.slow
def test_second_process_on_the_same_run_is_refused(project):
    f = project.root
    first = project.popen("+job=t", "job.tracking=false", env={"GWL_TEST_PAUSE": f"10:{f}/reached:{f}/go"})
    deadline = time.time() + 120
    while not (f / "reached").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    second = project.run("+job=t", "job.tracking=false")
    assert second.returncode == 2 and "is being trained by pid" in second.stdout + second.stderr
    (f / "go").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err


@pytest.mark.slow
def test_a_start_that_fails_before_its_loop_is_no_restart_in_the_report(project):
    """The adversarial pass's input: a first start with a missing column (exit 2, no step trained), then the
    whole training in one start: the report marks no restart (it marked one at step 1)."""
    bad = project.run("+job=t", env={"GWL_TEST_BAD": "column"}, check=2)
    assert "nope" in bad.stdout + bad.stderr
    project.run("+job=t", check=0)
    run_dir = run_dir_of(project)
    assert [s["first_step"] for s in json.loads((run_dir / "run.json").read_text())["starts"]] == [None, 1]
    report = project.run("report", str(run_dir), check=0)
    assert "0 restart(s) marked at steps []" in report.stdout
