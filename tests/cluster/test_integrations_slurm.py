"""A Lightning Trainer's job (examples/lightning_churn.py, gwenlake_hpc.integrations.lightning) on the real local
cluster, preempted by a `high` job and requeued by SLURM: Lightning detects SLURM (its SLURMEnvironment, with
auto_requeue) but its SIGTERM and requeue handlers stay out of the way; ours stop the loop at a step boundary after
a sealed checkpoint, SLURM requeues once, the next start resumes there and finishes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from helpers.integrations import history, make_framework_project, the_run  # noqa: E402
from helpers.slurm_cluster import finish, job_fields, require_cluster, sh, wait_until  # noqa: E402

pytestmark = pytest.mark.slurm

MODEL = "crm.churn-lightning"


def test_lightning_job_preempted_requeued_once_and_resumed(tmp_path):
    require_cluster()
    p = make_framework_project(tmp_path / "p")  # the example itself, its job config, on the whole of node n1
    steps = 20000  # a few ms a step: a minute or more, so the preemption comes mid-training
    proc = p.run("+job=lightning_churn", f"job.steps={steps}", "job.eval_every=2000", "launcher=slurm",
                 "launcher.timeout_min=10", "launcher.signal_delay_s=60", "launcher.cpus_per_task=2",
                 "+launcher.additional_parameters.nodelist=n1", "launcher.progress_every_s=5", check=0, timeout=600)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = Path(re.search(r"run directory (\S+)", proc.stdout).group(1))
    wait_until(lambda: list(run_dir.glob("checkpoints/step-*")), timeout=300, what="a first checkpoint")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")
    assert finish(job, timeout=900) == "COMPLETED"

    text = "".join(f.read_text(errors="replace") for f in sorted((run_dir / "slurm" / job).glob("*_log.*")))
    assert "stop requested (SIGTERM)" in text and "resuming from step" in text, text[-4000:]
    # Lightning's own handlers did nothing: no SIGTERMException, no requeue of its own, no hpc_ckpt file
    assert "SIGTERMException" not in text and "requeing job" not in text and "Requeued SLURM job" not in text
    assert not list(p.root.rglob("hpc_ckpt_*.ckpt"))
    assert job_fields(job).get("Restarts") == "1"  # SLURM's requeue, none on top
    evicted = int(re.search(r"loop ended after step (\d+)", text).group(1))
    assert f"resuming from step {evicted} " in text  # zero steps lost: the eviction's checkpoint is the resume

    client, run = the_run(p, MODEL)
    assert run.info.status == "FINISHED"
    assert sorted(history(p, MODEL, "loss")) == list(range(1, steps + 1))
    info = json.loads((run_dir / "run.json").read_text())
    version = info["completed"]["version"]
    metrics = json.loads(p.git("show", f"{version}:crm/churn-lightning/metrics.json"))
    assert metrics["test_auc"] > 0.8
