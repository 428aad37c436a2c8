"""A sharded (FSDP2, gloo) training on the local SLURM cluster (issue 23): two nodes, preempted, requeued and
resumed; then the same run resubmitted on one node continues from its newest checkpoint (DCP reshards 2 -> 1)
in the same run directory and the same MLflow run, and commits one full model file that ``load_model`` opens and
a plain model runs. Skipped with a reason when no cluster answers (scripts/slurm-cluster.sh up)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from helpers.slurm_cluster import job_fields, release, require_cluster, sh, wait_until

pytestmark = pytest.mark.slurm

FSDP = ["+job=t", "job.target=trainer.py:fit_fsdp", "job.steps=80", "launcher=slurm", "launcher.timeout_min=5",
        "launcher.cpus_per_task=2", "launcher.progress_every_s=1", "+launcher.env.GWL_TEST_SLEEP=0.25"]
SHARDS = ("state.safetensors/.metadata", "state.safetensors/__0_0.distcp", "state.safetensors/__1_0.distcp")


@pytest.fixture(autouse=True)
def _cluster():
    require_cluster()


def _submit(project, *overrides) -> str:
    proc = project.run(*FSDP, *overrides, check=0)
    m = re.search(r"submitted job (\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return m.group(1)


def _state(job_id) -> str:
    state = job_fields(job_id).get("JobState")
    if state:
        return state
    out = sh("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State").splitlines()
    return out[-1].split()[0] if out else "UNKNOWN"


def _released(job_id) -> None:
    """A requeued job waits ~2 minutes (its BeginTime) before it may start: let it start now."""
    if _state(job_id) == "PENDING" and job_fields(job_id).get("Reason") == "BeginTime":
        release(int(job_id))


def _finish(job_id, timeout=400) -> str:
    def done():
        _released(job_id)
        st = _state(job_id)
        return st if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") else None
    return wait_until(done, timeout, f"job {job_id} to end")


def _log(project, job_id) -> str:
    files = sorted(project.root.glob(f"runs/t.model/*/slurm/{job_id}/*_log.*"))
    return "".join(p.read_text(errors="replace") for p in files)


def _sealed(checkpoints) -> dict[int, dict]:
    """{step: manifest} of the sealed ``step-N`` folders in ``checkpoints``."""
    return {int(p.name[5:]): json.loads((p / "MANIFEST.json").read_text()) for p in checkpoints.glob("step-*")
            if re.fullmatch(r"step-\d{9}", p.name) and (p / "MANIFEST.json").is_file()}


def test_fsdp_on_two_nodes_is_preempted_resumes_and_continues_on_one_node(project):
    job = _submit(project, "launcher.nodes=2", "launcher.tasks_per_node=1")
    wait_until(lambda: list(project.root.glob("runs/t.model/*/checkpoints/step-*")), what="a first checkpoint")
    run_dirs = list((project.root / "runs" / "t.model").iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    checkpoints = run_dir / "checkpoints"
    run_id = wait_until(lambda: (run_dir / "tracking" / "run_id").is_file()
                        and (run_dir / "tracking" / "run_id").read_text().strip(), what="the MLflow run id")

    # A high-priority job on n1 preempts the two-node job: SLURM requeues all of it, the new start resumes on
    # both nodes from the newest sealed checkpoint.
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")

    def resumed_twice():
        _released(job)
        return len(re.findall(r"resuming from step (\d+)", _log(project, job))) >= 2
    wait_until(resumed_twice, timeout=300, what="the requeued job resumed on both ranks")
    assert job_fields(job).get("Restarts") == "1"
    text = _log(project, job)
    first_resume = {int(s) for s in re.findall(r"resuming from step (\d+)", text)}
    assert len(first_resume) == 1, first_resume
    resumed = first_resume.pop()
    # Progress after the resume (a newer checkpoint), then the job is cancelled: its eviction checkpoint is
    # sealed and it is not requeued.
    wait_until(lambda: max(_sealed(checkpoints), default=0) >= resumed + 10, timeout=300,
               what="a checkpoint 10 steps after the resume")
    project.run("cancel", job, check=0)
    assert _finish(job).startswith("CANCELLED")
    text = _log(project, job)
    assert "n[1-2]" in sh("sacct", "-n", "-X", "-j", job, "-o", "NodeList")
    assert "model t.model version" not in text, text[-3000:]  # it did not finish on two nodes

    sealed = _sealed(checkpoints)
    newest = max(sealed)
    assert resumed + 10 <= newest < 80, sorted(sealed)
    for step, manifest in sealed.items():  # every rank's shard in every sealed checkpoint
        assert set(SHARDS) <= set(manifest["files"]), (step, sorted(manifest["files"]))

    # The same run on one node, one task: same run key and directory, resumes from the newest checkpoint (a
    # checkpoint of 2 ranks read by 1: DCP reshards), and finishes.
    again = _submit(project, "launcher.nodes=1", "launcher.tasks_per_node=1")
    assert _finish(again) == "COMPLETED", _log(project, again)[-4000:]
    assert list((project.root / "runs" / "t.model").iterdir()) == [run_dir]
    text = _log(project, again)
    assert f"resuming from step {newest}" in text, text[-4000:]
    assert "written by 2 rank(s), this run has 1" in text, text[-4000:]
    assert (run_dir / "tracking" / "run_id").read_text().strip() == run_id

    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one MLflow run across the three starts
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["gwenlake.run_key"] == run_dir.name
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 81))
    info = json.loads((run_dir / "run.json").read_text())
    # A start of one process records no world_size
    assert [s.get("world_size", 1) for s in info["starts"]] == [2, 2, 1], info["starts"]

    print(f"two nodes: preempted, resumed from step {resumed}, cancelled; one node: resumed from step {newest}, "
          f"finished at 80; MLflow run {run_id}", flush=True)

    # The version: one full safetensors file, opened by load_model and run by a plain (unsharded) model.
    from safetensors.torch import load_model as load_safetensors

    from gwenlake_hpc import load_model, load_state

    version = re.findall(r"model t.model version ([0-9a-f]{40})", text)[-1]
    loaded = load_model("t.model", version, repo=project.root)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    load_safetensors(plain, str(loaded.path / "model.safetensors"))
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    load_state(loaded.path / "model.safetensors", model=other)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32))
    with torch.no_grad():
        scores = plain(x).squeeze(-1)
        assert scores.shape == (5,) and torch.isfinite(scores).all()
        assert torch.equal(scores, other(x).squeeze(-1))
