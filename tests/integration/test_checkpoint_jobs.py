"""Asynchronous checkpoints in whole jobs (subprocesses, real signals, real OS errors)."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers.jobs import run_dir_of, version_of, weights_at

pytestmark = pytest.mark.slow


def same_weights(project, a, b):
    wa, wb = weights_at(project, a), weights_at(project, b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def sealed_steps(project):
    if not (project.root / "runs" / "t.model").is_dir():
        return []
    ck = run_dir_of(project) / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in ck.glob("step-*")) if ck.is_dir() else []


def resume_step(log):
    return int(log.split("resuming from step ")[1].split()[0]) if "resuming from step " in log else None


def test_sigkill_at_random_moments_with_async_checkpoints_resumes_bit_identical(project):
    """SIGKILL during background writes and at random moments; every resume uses the newest sealed checkpoint."""
    ref = version_of(project.run("+job=t", "paths.runs_root=ref", check=0))
    env = {"GWL_TEST_EXTRA_MB": "48", "GWL_TEST_SLEEP": "0.03"}  # 48 MiB a checkpoint: writes take a while
    ck_root = project.root / "runs" / "t.model"
    rng = random.Random()
    left_partial = 0
    for trial in range(4):
        before = sealed_steps(project)
        remaining = [s for s in range(10, 61, 10) if s > max(before or [0])]
        if not remaining:  # every checkpoint is sealed (a kill landed in the final commit): on to the end
            break
        target = rng.choice(remaining)
        tmp_glob = f"*/checkpoints/.partial-{target:09d}-*/.state.safetensors.*.tmp"
        old = set(ck_root.glob("*/checkpoints/.partial-*/*")) | set(ck_root.glob("*/checkpoints/.partial-*"))

        def new(pattern):
            return set(ck_root.glob(pattern)) - old

        proc = project.popen("+job=t", env=env)
        deadline = time.time() + 180
        if trial % 2 == 0:  # the moment the background writer is writing the state file of step `target`
            while time.time() < deadline and proc.poll() is None and not new(tmp_glob):
                time.sleep(0.002)
        else:  # a random moment after this process began its first checkpoint
            first = f"*/checkpoints/.partial-{min(remaining):09d}-*"
            while time.time() < deadline and proc.poll() is None and not new(first) \
                    and sealed_steps(project) == before:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.5))
        proc.kill()
        out, err = proc.communicate(timeout=60)
        step = resume_step(out + err)
        if before and step is not None:
            assert step == max(before), out + err  # the newest sealed checkpoint, never a partial one
        partials = [p.name for p in ck_root.glob("*/checkpoints/.partial-*")]
        left_partial += bool(partials)
        print(f"trial {trial}: sealed before {before}, resumed from {step}, exit {proc.returncode}, "
              f"partial left {partials}")
        if proc.returncode == 0:
            break
    before = sealed_steps(project)
    final = project.run("+job=t", env=env, check=0)
    log = final.stdout + final.stderr
    if before and "nothing to train" not in log:  # a kill after the run recorded its version: nothing left
        assert resume_step(log) == max(before), log
    assert same_weights(project, ref, version_of(final))
    assert not list((run_dir_of(project) / "checkpoints").glob(".partial-*"))
    print(f"{left_partial} kill(s) left a partial checkpoint behind")


def test_background_write_error_fails_the_run_and_keeps_the_previous(project):
    """A real EFBIG (RLIMIT_FSIZE) in the writer thread: exit 1 naming path and errno; step 10 stays usable."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (6 << 20, 6 << 20))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GWL_TEST_EXTRA_MB": "8:20"}
    proc = subprocess.run([sys.executable, "-m", "gwenlake_hpc", "+job=t", "job.tracking=false"], cwd=project.root,
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    assert "the checkpoint of step 20 could not be written" in log, log
    assert "File too large" in log and f"(errno {27})" in log and "state.safetensors" in log, log
    assert "step-000000010" in log  # names the newest usable checkpoint
    ck = run_dir_of(project) / "checkpoints"
    assert sealed_steps(project) == [10]
    assert not list(ck.glob(".partial-*"))
    resumed = project.run("+job=t", "job.tracking=false", check=0)
    assert "resuming from step 10" in resumed.stdout + resumed.stderr


def test_damaged_state_found_while_loading_falls_back_to_previous(project):
    ref = version_of(project.run("+job=t", "paths.runs_root=ref", check=0))
    project.run("+job=t", env={"GWL_TEST_SIGTERM_AT": "25"}, check=75)
    assert sealed_steps(project) == [10, 20, 26]
    state = run_dir_of(project) / "checkpoints" / "step-000000026" / "state.safetensors"
    raw = bytearray(state.read_bytes())
    raw[-5] ^= 0x01  # bit rot: same size, so only the digest can tell
    state.write_bytes(bytes(raw))
    resumed = project.run("+job=t", check=0)
    log = resumed.stdout + resumed.stderr
    assert "does not match its xxh3_128 digest" in log and "starting the training function again" in log, log
    assert "resuming from step 20" in log
    starts = json.loads((run_dir_of(project) / "run.json").read_text())["starts"]
    assert [s["first_step"] for s in starts] == [1, 21]  # the loop began after the checkpoint it fell back to
    assert same_weights(project, ref, version_of(resumed))
    assert list((run_dir_of(project) / "checkpoints").glob(".damaged-step-000000026-*"))


def test_checkpoint_of_a_newer_format_is_refused_with_exit_2(project):
    project.run("+job=t", env={"GWL_TEST_SIGTERM_AT": "15"}, check=75)
    ck = run_dir_of(project) / "checkpoints" / "step-000000016"
    manifest = json.loads((ck / "MANIFEST.json").read_text())
    manifest.update(format=3, writer="gwenlake_hpc 9.9.0")
    (ck / "MANIFEST.json").write_text(json.dumps(manifest))
    again = project.run("+job=t")
    log = again.stdout + again.stderr
    assert again.returncode == 2, log
    assert "format 3, written by gwenlake_hpc 9.9.0" in log and "Traceback" not in log, log
    assert sealed_steps(project) == [10, 16]  # nothing deleted or set aside


def test_sigkill_right_after_a_seal_loses_no_tracking_point(project):
    """Points up to a checkpoint are on disk before it is sealed: a SIGKILL the moment it appears loses none."""
    from helpers.jobs import assert_one_point_per_step, mlflow_runs

    proc = project.popen("+job=t", env={"GWL_TEST_SLEEP": "0.05"})
    sealed = project.root / "runs" / "t.model"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None \
            and not list(sealed.glob("*/checkpoints/step-000000020/MANIFEST.json")):
        time.sleep(0.002)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    resumed = project.run("+job=t", check=0)
    assert "resuming from step 20" in resumed.stdout + resumed.stderr
    client, runs = mlflow_runs(project)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert_one_point_per_step(client, runs[0].info.run_id, "loss", range(1, 61))
    assert_one_point_per_step(client, runs[0].info.run_id, "train_loss", range(10, 61, 10))


def test_mlflow_system_metrics_continue_across_a_restart(project):
    """MLflow's own switch turns its system metrics on; they land in the job's run, steps increasing across
    an eviction and resume (no step twice)."""
    from helpers.jobs import mlflow_runs

    from helpers.concurrency import wait_until

    env = {"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5",
           "GWL_TEST_SLEEP": "0.05"}
    # The first process waits at step 10 until the delivery process attached the run (MLflow's import takes
    # seconds on a loaded machine) and its monitor, started then, had several sampling intervals; it then stops
    # itself at step 12, and the monitor's last samples are flushed as the delivery process ends.
    reached, go = project.root / "reached", project.root / "go"
    proc = project.popen("+job=t", env={**env, "GWL_TEST_PAUSE": f"10:{reached}:{go}", "GWL_TEST_SIGTERM_AT": "12"})
    try:
        wait_until(reached.exists, 300, "the first process at step 10")
        wait_until(lambda: any(project.root.glob("runs/t.model/*/tracking/run_id")), 300, "the run attached")
        time.sleep(3)  # six sampling intervals of 0.5 s
    finally:
        go.touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, out + err
    client, runs = mlflow_runs(project)
    first = [m.step for m in client.get_metric_history(runs[0].info.run_id, "system/cpu_utilization_percentage")]
    assert first, "no system metrics from the first process"
    # The second process waits at step 30 until its own monitor has added points (it failed once in CI, the
    # machine loaded: the delivery process attached after the short rerun had ended), then finishes.
    reached, go = project.root / "reached-2", project.root / "go-2"
    second = project.popen("+job=t", env={**env, "GWL_TEST_PAUSE": f"30:{reached}:{go}"})
    try:
        wait_until(reached.exists, 300, "the second process at step 30")
        wait_until(lambda: len(client.get_metric_history(runs[0].info.run_id, "system/cpu_utilization_percentage"))
                   > len(first), 300, "system metrics from the second process")
    finally:
        go.touch()
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, (out + err)[-3000:]
    client, runs = mlflow_runs(project)
    assert len(runs) == 1
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "system/cpu_utilization_percentage")]
    assert len(steps) > len(first) and len(set(steps)) == len(steps)  # more points, no step twice
    assert min(s for s in steps if s not in first) > max(first)  # the second process continued the steps


def test_time_breakdown_is_logged_at_each_evaluation_and_drawn(project):
    from helpers.jobs import mlflow_runs

    project.run("+job=t", env={"GWL_TEST_SLEEP": "0.02"}, check=0)
    client, runs = mlflow_runs(project)
    rid = runs[0].info.run_id
    hist = {k: {m.step: m.value for m in client.get_metric_history(rid, f"time/{k}")}
            for k in ("input", "compute", "checkpoint", "tracking")}
    assert all(sorted(h) == list(range(10, 61, 10)) for h in hist.values()), hist
    assert all(v >= 0.02 for v in hist["compute"].values())  # each step sleeps 20 ms in the user's code
    assert all(v > 0 for v in hist["checkpoint"].values()) and all(v >= 0 for v in hist["input"].values())
    out = project.run("report", str(run_dir_of(project)), check=0)
    assert (run_dir_of(project) / "report.png").read_bytes()[:4] == b"\x89PNG", out.stdout + out.stderr
