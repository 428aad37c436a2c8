"""The hang watchdog on the local SLURM cluster (issue 24): a hung rank of a 2-task job is caught, the job is
requeued by its teardown and finishes; a hang that recurs at the same step ends the job FAILED, naming the
stacks, with no third start, and its MLflow run FAILED. Skipped with a reason when no cluster answers."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from helpers.project import expect_hangs
from helpers.slurm_cluster import finish, job_fields, log_text_any, require_cluster, submit

pytestmark = pytest.mark.slurm

HANG = {"GWL_TEST_HANG": "'25:gil'"}  # step 25 blocks in libc's sleep, the GIL held (checkpoints at 10, 20)


@pytest.fixture(autouse=True)
def _cluster():
    require_cluster()


def _mlflow_run(project, runs):
    client = MlflowClient(f"sqlite:///{project.root / runs / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    return run


def test_a_hung_rank_is_requeued_and_finishes_and_the_same_hang_twice_fails(project):
    # Two jobs at once, one per node: rank 1 of a 2-task job hangs on its first start only; a 1-task job hangs
    # at step 25 on every start.
    expect_hangs(project)  # these runs hang on purpose (the suite's check for false alarms)
    marker = project.root / "hung-once"
    two = ["launcher=slurm", "launcher.timeout_min=5", "launcher.tasks_per_node=2", "launcher.cpus_per_task=1",
           "+launcher.additional_parameters.nodelist=n2", "job.hang_timeout_s=8", "launcher.max_retries=3"]
    once = submit(project, *two, env_vars={**HANG, "GWL_TEST_HANG_RANK": "1", "GWL_TEST_HANG_ONCE": str(marker)})
    always = submit(project, "launcher=slurm", "launcher.timeout_min=5", "+launcher.additional_parameters.nodelist=n1",
                    "job.hang_timeout_s=8", "launcher.max_retries=3", "paths.runs_root=runs-always", env_vars=HANG)

    assert finish(once, timeout=600) == "COMPLETED"
    text = log_text_any(project, once)
    [line] = [ln for ln in text.splitlines() if ln.startswith("gwenlake_hpc: hang: ")]
    assert line.startswith("gwenlake_hpc: hang: rank 1 on n2 made no progress for ") and "(it stopped first)" in line \
        and "the others wait: rank 0 on n2 in step 25, collective" in line, line
    assert "hang at step 25 (stacks: " in text and "requeue, start 2/100" in text, text[-4000:]
    assert text.count("resuming from step 20") == 2, text[-4000:]  # both ranks of the requeued start
    [folder] = [p for p in next(project.root.glob("runs/t.model/*")).joinpath("hangs").iterdir() if p.is_dir()]
    assert sorted(p.name for p in folder.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
    tags = _mlflow_run(project, "runs").data.tags
    assert tags["gwenlake.hang.first_ranks"] == "1" and tags["gwenlake.hang"] == line, tags

    assert finish(always, timeout=600) == "FAILED"
    assert job_fields(always).get("Restarts") == "1"  # two starts, no third
    text = log_text_any(project, always)
    assert text.count("gwenlake_hpc: hang: rank 0 on n1 made no progress") == 2, text[-4000:]
    assert "the start before hung at the same step, so the hang recurs there: not requeued" in text, text[-4000:]
    record = json.loads(next(project.root.glob(f"runs-always/t.model/*/slurm/{always}/teardown.json")).read_text())
    assert [(s["hang"] or {}).get("step") for s in record["starts"]] == [25, 25], record
    assert [s["action"] for s in record["starts"]] == ["requeue", "fail"] and record["starts"][1]["rule"] == \
        "job.hang_timeout_s"
    assert record["starts"][1]["hang"]["folder"] in text  # the stacks named in the job's log
    assert _mlflow_run(project, "runs-always").info.status == "FAILED"
