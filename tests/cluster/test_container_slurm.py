"""launcher.container on the real local cluster: SLURM's --container with runc (scripts/slurm-cluster.sh writes
oci.conf), an OCI bundle made from this machine's own directories (tests/helpers/oci_bundle.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.oci_bundle import MARKER, make_bundle
from helpers.slurm_cluster import release, require_cluster
from helpers.slurm_cluster import job_fields, sh, wait_until

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _cluster():
    require_cluster()


def newest_step(root: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in root.glob("runs/crm.churn/*/checkpoints/step-*")]
    return max(steps) if steps else 0


@pytest.mark.slow
def test_churn_in_a_container_is_preempted_resumes_and_its_version_names_the_image(tmp_path):
    """The churn job inside an OCI bundle: preempted once (SIGTERM reaches the training inside, one checkpoint,
    SLURM requeues), the image rebuilt while it waits (the next start warns), resumed, committed; every start and
    the lineage name the image's digest."""
    from helpers.project import make_churn_project

    project = make_churn_project(tmp_path / "churn")
    bundle = make_bundle(tmp_path / "bundle", marker="one")
    proc = project.run("+job=churn", "job.steps=40000", "job.eval_every=1000", "launcher=slurm",
                       f"launcher.container.image={bundle}", f"launcher.container.python={sys.executable}",
                       "launcher.timeout_min=10", "launcher.cpus_per_task=2",
                       "+launcher.additional_parameters.nodelist=n1", "launcher.progress_every_s=5",
                       check=0, timeout=600)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = Path(re.search(r"run directory (\S+)", proc.stdout).group(1))
    wait_until(lambda: newest_step(project.root) >= 2000, timeout=300, what="a checkpoint at step 2000")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")

    def requeued():
        f = job_fields(job)
        return f.get("Restarts") == "1" and f.get("JobState") == "PENDING" and f.get("Reason") == "BeginTime"

    wait_until(requeued, timeout=300, what="the preempted job waiting for its requeue")
    (bundle / "rootfs" / MARKER).write_text("two: the image was rebuilt\n")
    release(int(job))

    def ended():
        f = job_fields(job)
        if f.get("JobState") == "PENDING" and f.get("Reason") == "BeginTime":
            release(int(job))
        return f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") and f.get("JobState")

    assert wait_until(ended, timeout=900, what=f"job {job} to end") == "COMPLETED"
    text = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm" / job).glob("*_log.*")))
    # The training inside got SLURM's SIGTERM and sealed a checkpoint at the step it stopped (not an evaluation
    # step); its own last log lines may be cut, as SLURM stops relaying a preempted step's output.
    resumed = int(re.search(r"resuming from step (\d+)", text).group(1))
    assert resumed >= 2000 and ("stop requested (SIGTERM)" in text or resumed % 1000 != 0), resumed
    assert "container image changed since the previous start" in text
    info = json.loads((run_dir / "run.json").read_text())
    containers = [s["container"] for s in info["starts"]]
    assert len(containers) == 2 and all(c["runtime"] == "oci" and c["image"] == str(bundle) for c in containers)
    assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", c["digest"]) for c in containers)
    assert containers[0]["digest"] != containers[1]["digest"]
    assert "runc version" in containers[0]["runtime_version"] and "slurm" in containers[0]["runtime_version"]
    version = re.findall(r"model crm.churn version ([0-9a-f]{40})", text)[-1]
    lineage = json.loads(project.git("show", f"{version}:crm/churn/lineage.json"))
    assert lineage["container"] == containers[1]
    assert [s["container"]["digest"] for s in lineage["starts"]] == [c["digest"] for c in containers]
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("crm.churn").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["gwenlake.container.digest"] == containers[1]["digest"]
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")) == list(range(1, 40001))
    assert not json.loads((bundle / "config.json").read_text()).get("hooks")  # the user's bundle untouched


def test_a_pinned_job_refuses_a_changed_image_and_keeps_its_checkpoints(project, tmp_path):
    bundle = make_bundle(tmp_path / "bundle", marker="one")
    proc = project.run("+job=t", "job.steps=300", "launcher=slurm", f"launcher.container.image={bundle}",
                       f"launcher.container.python={sys.executable}", "launcher.container.pin=true",
                       "launcher.timeout_min=10", "launcher.cpus_per_task=2",
                       "+launcher.additional_parameters.nodelist=n1", "+launcher.env.GWL_TEST_SLEEP=0.05",
                       check=0)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = Path(re.search(r"run directory (\S+)", proc.stdout).group(1))
    wait_until(lambda: list(run_dir.glob("checkpoints/step-*")), timeout=300, what="a checkpoint")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")
    wait_until(lambda: job_fields(job).get("Reason") == "BeginTime", timeout=300, what="the requeue")
    kept = sorted(p.name for p in run_dir.glob("checkpoints/step-*"))
    (bundle / "rootfs" / MARKER).write_text("two\n")
    release(int(job))
    wait_until(lambda: job_fields(job).get("JobState") in ("FAILED", "COMPLETED"), timeout=300, what="the end")
    assert job_fields(job)["JobState"] == "FAILED"
    text = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm" / job).glob("*_log.*")))
    assert "launcher.container.pin=true: the container image changed" in text
    assert sorted(p.name for p in run_dir.glob("checkpoints/step-*")) == kept
    assert len(json.loads((run_dir / "run.json").read_text())["starts"]) == 1  # the refused start wrote nothing


def test_a_sweep_in_a_container_is_one_array_and_every_task_records_the_image(project, tmp_path):
    bundle = make_bundle(tmp_path / "bundle")
    proc = project.run("-m", "+job=t", "launcher=slurm", "launcher.timeout_min=5", "launcher.partition=high",
                       "launcher.wait=true", f"launcher.container.image={bundle}",
                       f"launcher.container.python={sys.executable}", "+launcher.container.env.GWL_TEST_NOTE=1",
                       "job.params.lr=0.1,0.2", check=0, timeout=600)
    assert len(re.findall(r"COMPLETED", proc.stdout)) >= 2, proc.stdout + proc.stderr
    infos = [json.loads(p.read_text()) for p in (project.root / "runs" / "t.model").glob("*/run.json")]
    assert len(infos) == 2
    # launcher.container.env reached the training inside the container: GWL_TEST_NOTE makes it write note.txt
    assert len(list((project.root / "runs" / "t.model").glob("*/output/note.txt"))) == 2
    digests = {s["container"]["digest"] for info in infos for s in info["starts"]}
    assert len(digests) == 1 and next(iter(digests)).startswith("sha256:")
