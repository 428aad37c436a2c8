"""The real SLURM test cluster (scripts/slurm-cluster.sh): partitions, accounting, GPUs, preemption.

Skipped where no cluster runs (``bash scripts/slurm-cluster.sh up`` as root brings one up). About a minute.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.slurm_cluster import (job_restarts, release, require_cluster, sacct_history, sacct_state, sbatch, scancel,
                           show_job, squeue_state, wait_state)

pytestmark = pytest.mark.slurm  # runs in the cluster half of scripts/test.sh


@pytest.fixture
def jobs():
    """Ids of the jobs a test submits: any still queued or running at its end is cancelled."""
    require_cluster()
    ids: list[int] = []
    yield ids
    scancel(*ids)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(poll_s)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("partition", ["low", "high"])
def test_batch_job_completes_and_is_accounted(partition, jobs, tmp_path):
    out = tmp_path / "out"
    jobs.append(job := sbatch("-p", partition, "-J", f"test-slurm-{partition}", "--time=2", "-o", str(out),
                              "--wrap", "echo partition=$SLURM_JOB_PARTITION node=$SLURMD_NODENAME"))
    assert wait_state(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"], 90) == "COMPLETED"
    # Accounting (slurmdbd) records the job too, a moment after the controller.
    wait_for(lambda: sacct_state(job) == "COMPLETED", 30, f"sacct shows job {job} COMPLETED")
    assert f"partition={partition} node=n" in read(out)


def test_gpu_job_sees_its_gpu(jobs, tmp_path):
    out = tmp_path / "out"
    jobs.append(job := sbatch("--gres=gpu:1", "-J", "test-slurm-gpu", "--time=2", "-o", str(out), "--wrap",
                              'echo "gpus=$SLURM_GPUS_ON_NODE cuda=${CUDA_VISIBLE_DEVICES-unset}"'))
    assert wait_state(job, ["COMPLETED", "FAILED", "CANCELLED"], 90) == "COMPLETED"
    assert "gpus=1 " in read(out), read(out)
    assert "gres/gpu=1" in show_job(job).get("TRES", ""), show_job(job)


def test_scancel_sends_sigterm(jobs, tmp_path):
    events = tmp_path / "events"
    script = f"""#!/bin/bash
trap 'echo SIGTERM >> {events}; exit 143' TERM
echo started >> {events}
sleep 300 & wait $!
"""
    jobs.append(job := sbatch("-J", "test-slurm-scancel", "--time=5", "-o", str(tmp_path / "out"), script=script))
    wait_for(lambda: "started" in read(events), 60, f"job {job} started")
    scancel(job)
    assert wait_state(job, ["CANCELLED", "COMPLETED", "FAILED"], 60).startswith("CANCELLED")
    wait_for(lambda: "SIGTERM" in read(events), 15, f"job {job} recorded SIGTERM")


def test_high_job_preempts_and_requeues_low_job(jobs, tmp_path):
    """A job on `high` that needs the whole node preempts a `low` job there: SIGTERM, requeue (same id,
    Restarts=1, SLURM_RESTART_COUNT=1), and the low job completes on its second run."""
    events = tmp_path / "events"
    low_script = f"""#!/bin/bash
echo "start restart=${{SLURM_RESTART_COUNT:-0}}" >> {events}
if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then echo done >> {events}; exit 0; fi
trap 'echo SIGTERM >> {events}; exit 143' TERM
sleep 300 & wait $!
"""
    jobs.append(low := sbatch("-p", "low", "--requeue", "-w", "n1", "-c", "1", "--time=5", "-J", "test-slurm-low",
                              "-o", str(tmp_path / "low.out"), "--open-mode=append", script=low_script))
    wait_for(lambda: "start restart=0" in read(events), 60, f"low job {low} started")
    # Both CPUs of n1: the low job must go.
    jobs.append(high := sbatch("-p", "high", "-w", "n1", "-c", "2", "--time=2", "-J", "test-slurm-high",
                               "-o", str(tmp_path / "high.out"), "--wrap", "sleep 3"))
    wait_for(lambda: "SIGTERM" in read(events), 30, f"low job {low} got SIGTERM")
    wait_for(lambda: job_restarts(low) >= 1, 30, f"low job {low} requeued")
    wait_state(low, "PENDING", 30)
    # Requeued jobs wait ~2 minutes (BeginTime) unless released.
    assert show_job(low).get("Reason") in ("BeginTime", "Resources", "Priority", "None")
    assert wait_state(high, ["COMPLETED", "FAILED", "CANCELLED"], 60) == "COMPLETED"
    release(low)
    assert wait_state(low, ["COMPLETED", "FAILED", "CANCELLED"], 60) == "COMPLETED"
    assert read(events).split("\n")[:4] == ["start restart=0", "SIGTERM", "start restart=1", "done"], read(events)
    assert job_restarts(low) == 1
    wait_for(lambda: sacct_history(low) == ["PREEMPTED", "COMPLETED"], 30,
             f"sacct -D shows the two runs of job {low}")
    assert squeue_state(low) in (None, "COMPLETED")
