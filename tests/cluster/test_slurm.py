"""The SLURM launcher on a real local cluster (scripts/slurm-cluster.sh up): preemption, time limit, scancel,
a SIGKILLed job step, an exception. Skipped with a reason when no cluster answers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from helpers.project import files_under
from helpers.slurm_cluster import (finish, job_fields, log_text_any, release, require_cluster, sh, state_of, submit,
                                  wait_until)

pytestmark = pytest.mark.slurm

# A 300-step training of ~20 s on the whole of node n1 (2 CPUs), so a `high` job on n1 preempts it.
SLOW = ["job.steps=300", "launcher=slurm", "launcher.timeout_min=10", "launcher.signal_delay_s=60",
        "launcher.cpus_per_task=2", "+launcher.additional_parameters.nodelist=n1", "launcher.progress_every_s=2"]


@pytest.fixture(autouse=True)
def _cluster():
    require_cluster()


def run_dir(project) -> Path:
    dirs = list((project.root / "runs" / "t.model").iterdir())
    assert len(dirs) == 1
    return dirs[0]


def checkpoint_at_least(project, step):
    def check():
        for p in project.root.glob("runs/t.model/*/checkpoints/step-*"):
            if int(p.name.split("-")[1]) >= step:
                return True
        return False
    return check


def log_text(project, job_id) -> str:
    d = run_dir(project) / "slurm" / job_id
    return "".join(p.read_text(errors="replace") for p in sorted(d.glob("*_log.*")))


def one_point_per_step(project, steps):
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t.model")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    hist = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in hist) == list(range(1, steps + 1))
    return runs[0]


def test_completes_and_status_lists_it(project):
    job = submit(project, "launcher=slurm", "launcher.timeout_min=5")
    assert finish(job) == "COMPLETED"
    status = project.run("status", check=0).stdout
    assert re.search(rf"{job}\s+COMPLETED\s+0\s+60", status), status
    assert "model t.model version" in log_text(project, job)
    logs = project.run("logs", job, check=0).stdout
    assert "model t.model version" in logs


def test_preemption_requeued_by_slurm_once_and_resumes(project):
    job = submit(project, *SLOW, env_vars={"GWL_TEST_SLEEP": "0.05"})
    wait_until(checkpoint_at_least(project, 50), what="a checkpoint at step 50")
    # `status` of the running job: its last step and how long ago it ended (rank 0's progress.json)
    line = next(ln for ln in project.run("status", check=0).stdout.splitlines() if ln.split()[:1] == [job])
    assert re.search(r"RUNNING .* last step \d+ \d+ s ago", line), line
    high = sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 3")
    assert high
    assert finish(job) == "COMPLETED"
    text = log_text(project, job)
    # The training itself stopped at a step boundary (srun did not SIGKILL it) and the teardown left the
    # requeue to SLURM.
    assert "stop requested (SIGTERM)" in text and "SLURM is ending it" in text
    assert "resuming from step" in text
    assert "gwenlake_hpc: hang" not in text  # a preemption is an eviction (the watchdog is on by default)
    assert job_fields(job).get("Restarts") == "1"  # SLURM's requeue, none of ours on top
    run = one_point_per_step(project, 300)
    assert run.info.status == "FINISHED"
    info = json.loads((run_dir(project) / "run.json").read_text())
    assert [s.get("SLURM_RESTART_COUNT", "0") for s in info["starts"]] == ["0", "1"]
    # The goodput ledger: the preempted start ended as an eviction (SIGTERM, drained), its last step kept by
    # its final checkpoint; SLURM's controller gave each start's queue wait.
    from gwenlake_hpc.runtime.ledger import read_ledger

    recs = read_ledger(run_dir(project))
    assert [r["end"] for r in recs] == ["evicted", "finished"], recs
    assert recs[0]["stop_signal"] == "SIGTERM" and recs[0]["drain_s"] > 0, recs[0]
    assert recs[0]["sealed_step"] == recs[0]["last_step"] == recs[1]["first_step"] - 1, recs
    assert all(r["queue_s"] >= 0 for r in recs) and recs[1]["last_step"] == 300, recs
    status = next(ln for ln in project.run("status", check=0).stdout.splitlines() if ln.split()[:1] == [job])
    assert re.search(r"goodput 0\.\d\d of ", status), status
    assert 0 < run.data.metrics["goodput/goodput"] < 1 and run.data.metrics["goodput/starts"] == 2


def test_preemption_with_a_large_state_seals_its_final_checkpoint_and_resumes(project):
    """A 320 MiB state, checkpointed asynchronously: the eviction checkpoint is sealed before the process exits,
    well inside KillWait (10 s on the local cluster), and the requeued job resumes from exactly that step."""
    job = submit(project, *SLOW, "job.eval_every=50", env_vars={"GWL_TEST_SLEEP": "0.05", "GWL_TEST_EXTRA_MB": "320"})
    wait_until(checkpoint_at_least(project, 50), what="a checkpoint at step 50")
    high = sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 3")
    assert high
    assert finish(job) == "COMPLETED"
    text = log_text(project, job)
    evicted = re.search(r"loop ended after step (\d+)", text)
    assert evicted and "stop requested (SIGTERM)" in text, text
    assert f"resuming from step {evicted.group(1)}" in text, text  # the final checkpoint was sealed in time
    ck = run_dir(project) / "checkpoints" / "step-000000300"
    assert json.loads((ck / "MANIFEST.json").read_text())["files"]["state.safetensors"]["size"] > 320 << 20
    one_point_per_step(project, 300)


def test_scancel_keeps_checkpoint_and_resubmission_resumes(project):
    # A 2-minute limit with a 30 s warning: the whole job lies in the window where an eviction counts as a
    # time limit; a scancel must still never be requeued.
    near_limit = [o for o in SLOW if not o.startswith(("launcher.timeout_min", "launcher.signal_delay_s"))]
    job = submit(project, *near_limit, "launcher.timeout_min=2", "launcher.signal_delay_s=30",
                 "launcher.secrets=[GWL_TEST_TOKEN]", env_vars={"GWL_TEST_SLEEP": "0.05"},
                 env={"GWL_TEST_TOKEN": "s3cr3t-value"})
    wait_until(checkpoint_at_least(project, 30), what="a checkpoint at step 30")
    secrets = list((run_dir(project) / "slurm").glob("secrets-*.env"))
    assert len(secrets) == 1
    project.run("cancel", job, check=0)
    assert not secrets[0].exists()  # removed by `cancel` at once: a cancelled job's teardown may be killed
    assert finish(job).startswith("CANCELLED")
    text = log_text(project, job)
    assert "stop requested (SIGTERM)" in text and "SLURM is ending it" in text
    time.sleep(3)
    assert state_of(job).startswith("CANCELLED")  # not requeued
    assert list((run_dir(project) / "checkpoints").glob("step-*"))
    again = submit(project, *SLOW)
    assert finish(again) == "COMPLETED"
    assert "resuming from step" in log_text(project, again)
    # status: the cancelled job shows its own step and no version, not what the later job of its run did
    lines = {ln.split()[0]: ln for ln in project.run("status", check=0).stdout.splitlines()[1:]}
    assert 30 <= int(lines[job].split()[3]) < 300 and "version" not in lines[job], lines[job]
    assert re.search(rf"{again}\s+COMPLETED\s+0\s+300\s", lines[again]) and "version" in lines[again]


def test_sigkilled_step_is_requeued_and_resumes(project):
    """A killed step is requeued by the teardown. launcher.max_retries counts the starts in a row that sealed no
    newer checkpoint: a start that advanced is requeued even with max_retries=0; a job whose starts seal nothing
    new ends FAILED after max_retries of them, and `status` names the rule."""
    job = submit(project, *SLOW, "launcher.max_retries=0", env_vars={"GWL_TEST_SLEEP": "0.05"})
    wait_until(checkpoint_at_least(project, 50), what="a checkpoint at step 50")
    pattern = f"^{re.escape(sys.executable)} -m gwenlake_hpc.launch.boot -u -m submitit.core._submit {re.escape(str(run_dir(project)))}"
    pids = sh("pgrep", "-f", pattern).split()
    assert len(pids) == 1, pids
    subprocess.run(["kill", "-9", pids[0]], check=True)
    assert finish(job) == "COMPLETED"
    text = log_text(project, job)
    assert "killed by signal" in text and "requeue, start 2/100 (this start sealed a newer checkpoint" in text
    assert "resuming from step" in text
    one_point_per_step(project, 300)

    # Every start dies in the checkpoint of step 30 (left torn, never sealed): the first sealed 10 and 20 before,
    # the next ones nothing newer. max_retries=1: the second start is requeued, the third ends the job.
    stuck = submit(project, "launcher=slurm", "launcher.timeout_min=5", "launcher.max_retries=1", "job.seed=1",
                   env_vars={"GWL_TEST_SIGKILL_IN_CKPT": "30"})
    assert finish(stuck) == "FAILED"
    assert job_fields(stuck).get("Restarts") == "2"
    record = json.loads(next(project.root.glob(f"runs/t.model/*/slurm/{stuck}/teardown.json")).read_text())
    assert [(s["newest_step"], s["progressed"], s["action"]) for s in record["starts"]] == [
        (20, True, "requeue"), (20, False, "requeue"), (20, False, "fail")]
    assert "2 start(s) in a row sealed no newer checkpoint" in log_text_any(project, stuck)
    line = next(ln for ln in project.run("status", check=0).stdout.splitlines() if ln.split()[:1] == [stuck])
    assert "FAILED" in line and "ended by launcher.max_retries" in line, line


def test_a_requeue_by_slurm_past_max_starts_is_refused_and_names_the_rule(project):
    """launcher.max_starts caps every start, SLURM's own requeues included (a preemption, `scontrol requeue`):
    with max_starts=1 the second start trains nothing, the job ends FAILED naming the rule, its secrets go."""
    job = submit(project, *SLOW, "launcher.max_starts=1", "launcher.secrets=[GWL_TEST_TOKEN]",
                 env_vars={"GWL_TEST_SLEEP": "0.05"}, env={"GWL_TEST_TOKEN": "s3cr3t-value"})
    wait_until(checkpoint_at_least(project, 20), what="a checkpoint at step 20")
    assert list((run_dir(project) / "slurm").glob("secrets-*.env"))
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
    assert finish(job) == "FAILED"
    text = log_text(project, job)
    assert "this is start 2 of SLURM job" in text and "launcher.max_starts=1 caps all starts" in text, text
    info = json.loads((run_dir(project) / "run.json").read_text())
    assert len(info["starts"]) == 1  # the second start wrote nothing
    record = json.loads((run_dir(project) / "slurm" / job / "teardown.json").read_text())
    assert [(s["restart"], s["action"], s["rule"]) for s in record["starts"]][-1] == (1, "fail", "launcher.max_starts")
    line = next(ln for ln in project.run("status", check=0).stdout.splitlines() if ln.split()[:1] == [job])
    assert "FAILED" in line and "ended by launcher.max_starts" in line, line
    assert not list((run_dir(project) / "slurm").glob("secrets-*.env"))


def test_cancel_without_the_runs_root_finds_the_secrets_file_in_the_batch_script(project, tmp_path):
    """A pending job (its teardown never runs) submitted with another paths.runs_root, cancelled from a directory
    whose index does not know it: the secrets file its batch script sources is removed all the same."""
    elsewhere = tmp_path / "elsewhere"
    job = submit(project, "launcher=slurm", f"paths.runs_root={elsewhere}", "launcher.secrets=[GWL_TEST_TOKEN]",
                 "+launcher.additional_parameters.begin=now+1hour", env={"GWL_TEST_TOKEN": "s3cr3t-value"})
    secrets = list(elsewhere.glob("t.model/*/slurm/secrets-*.env"))
    assert len(secrets) == 1 and state_of(job) == "PENDING"
    proc = project.run("cancel", job, check=0)
    assert f"cancelled {job}" in proc.stdout and "warning" not in proc.stderr, proc.stderr
    assert not secrets[0].exists()


def test_exception_fails_the_job_with_traceback(project):
    job = submit(project, "launcher=slurm", "launcher.timeout_min=5", env_vars={"GWL_TEST_BAD": "raise"})
    assert finish(job) == "FAILED"
    text = log_text(project, job)
    assert "RuntimeError: boom at step 5" in text and "Traceback" in text
    assert "the training failed with exit status 1" in text  # the teardown's decision: no requeue


def test_time_limit_requeues_itself_and_completes(project):
    job = submit(project, "job.steps=160", "launcher=slurm", "launcher.timeout_min=1", "launcher.signal_delay_s=30",
                 "launcher.max_retries=6", "launcher.progress_every_s=2", env_vars={"GWL_TEST_SLEEP": "0.25"})
    assert finish(job, timeout=900) == "COMPLETED"
    text = log_text(project, job)
    assert "SIGUSR2" in text and re.search(r"time limit \(\d+ s left\): requeue, start 2/100", text)
    one_point_per_step(project, 160)


def test_dry_run_quotes_values_and_refuses_newlines(project, tmp_path):
    marker = tmp_path / "pwned"
    proc = project.run("+job=t", "launcher=slurm", "launcher.dry_run=true",
                       f"+launcher.env.EVIL='$(touch {marker})\"; touch {marker}'", check=0)
    script = proc.stdout
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR2@120" in script
    export = next(line for line in script.splitlines() if line.startswith("export EVIL="))
    out = subprocess.run(["bash", "-c", export + '; printf %s "$EVIL"'], capture_output=True, text=True).stdout
    assert out == f'$(touch {marker})"; touch {marker}' and not marker.exists()
    runs_before = files_under(project.root / "runs")
    bad = project.run("+job=t", "launcher=slurm", "launcher.dry_run=true", "launcher.partition='low\nrm -rf x'")
    assert bad.returncode == 2 and "launcher.partition" in bad.stderr + bad.stdout
    assert files_under(project.root / "runs") == runs_before  # refused before anything was written


def test_a_submission_sbatch_refuses_leaves_no_run_directory_behind(project):
    proc = project.run("+job=t", "launcher=slurm", "launcher.partition=no-such-partition")
    assert proc.returncode == 1 and "sbatch failed" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "invalid partition" in (proc.stdout + proc.stderr).lower()
    assert not (project.root / "runs" / "t.model").exists()  # no empty run directory, no slurm/ folder
    assert not (project.root / "runs" / ".gwenlake-jobs.jsonl").exists()  # nothing recorded


def test_sweep_is_one_job_array_and_every_task_completes(project):
    proc = project.run("-m", "+job=t", "launcher=slurm", "launcher.timeout_min=5", "launcher.partition=high",
                       "job.params.lr=0.01,0.02,0.03", check=0, timeout=600)
    m = re.search(r"submitted job array (\d+) \(3 tasks, one sbatch\)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    array = m.group(1)
    states = [finish(f"{array}_{i}") for i in range(3)]
    assert states == ["COMPLETED"] * 3
    run_dirs = sorted(p.name for p in (project.root / "runs" / "t.model").iterdir())
    assert len(run_dirs) == 3  # one run directory per config, keyed by it, not by job id
    versions = project.git("log", "--format=%H", "models/t.model").splitlines()
    lineages = [json.loads(project.git("show", f"{v}:t/model/lineage.json")) for v in versions[:3]]
    assert sorted(lin["config"]["params"]["lr"] for lin in lineages) == [0.01, 0.02, 0.03]


def test_a_waited_sweep_with_a_failed_task_exits_1_and_says_which(project):
    """launcher.wait=true: the task with batch_size=0 fails in the job (its batches refuse it), the other
    completes; the command exits 1 and names the failed task, and Hydra's report is FAILED for it."""
    proc = project.run("-m", "+job=t", "launcher=slurm", "launcher.timeout_min=5", "launcher.partition=high",
                       "launcher.wait=true", "job.steps=20", "job.params.batch_size=16,0", timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    array = re.search(r"submitted job array (\d+) \(2 tasks, one sbatch\)", proc.stdout).group(1)
    assert re.search(rf"{array}_0\s+COMPLETED", proc.stdout) and re.search(rf"{array}_1\s+FAILED", proc.stdout), log
    assert f"1 of 2 task(s) did not complete: {array}_1" in log


def committed_model(project, job):
    """The model.safetensors committed by ``job`` (its log's last line names the version)."""
    from safetensors.torch import load_file

    text = log_text_any(project, job)
    version = re.findall(r"model t.model version ([0-9a-f]{40})", text)[-1]
    path = project.root / f"model-{job}.safetensors"
    path.write_bytes(subprocess.run(["git", "show", f"{version}:t/model/model.safetensors"], cwd=project.root,
                                    capture_output=True, check=True).stdout)
    return load_file(str(path))


def test_multi_task_runs_agree_on_stop_and_resume_bit_identical(project):
    """Two tasks on one node, and two nodes: gloo process group from the SLURM environment, one stop for all."""
    two = ["launcher=slurm", "launcher.timeout_min=5", "launcher.tasks_per_node=2", "launcher.cpus_per_task=1",
           "+launcher.additional_parameters.nodelist=n2"]
    ref_job = submit(project, *two, "paths.runs_root=runs-ref")
    assert finish(ref_job) == "COMPLETED"
    reference = committed_model(project, ref_job)

    # Rank 1 alone gets SIGTERM during step 23: both ranks stop after step 24 (the stop is agreed), exit 75,
    # and no requeue (nothing says it was a time limit); the same submission again resumes.
    job = submit(project, *two, env_vars={"GWL_TEST_SIGTERM_AT": "23", "GWL_TEST_SIGTERM_RANK": "1"})
    finish(job)
    text = log_text_any(project, job)
    assert text.count("loop ended after step 24") == 2, text[-4000:]
    ck = next(project.root.glob("runs/t.model/*/checkpoints/step-000000024"))
    assert (ck / "gwenlake-ranks" / "rank-00001.json").is_file()
    again = submit(project, *two)
    assert finish(again) == "COMPLETED"
    assert log_text_any(project, again).count("resuming from step 24") == 2
    resumed = committed_model(project, again)
    assert all((resumed[k] == reference[k]).all() for k in reference)

    # Two nodes, one task each, preempted by a high-priority job on n1: SLURM requeues the whole job, the
    # new start resumes on both nodes and ends with the same weights.
    nodes = ["launcher=slurm", "launcher.timeout_min=5", "launcher.nodes=2", "launcher.cpus_per_task=2",
             "paths.runs_root=runs-2n", "launcher.progress_every_s=1"]
    job2 = submit(project, *nodes, env_vars={"GWL_TEST_SLEEP": "0.25"})
    wait_until(lambda: list(project.root.glob("runs-2n/t.model/*/checkpoints/step-*")), what="a first checkpoint")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")
    assert finish(job2) == "COMPLETED"
    assert job_fields(job2).get("Restarts") == "1"
    text = log_text_any(project, job2)
    assert text.count("resuming from step") == 2 and "n[1-2]" in sh("sacct", "-n", "-X", "-j", job2, "-o", "NodeList")
    two_nodes = committed_model(project, job2)
    assert all((two_nodes[k] == reference[k]).all() for k in reference)
    client = MlflowClient(f"sqlite:///{project.root / 'runs-2n' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t.model").experiment_id])
    assert len(runs) == 1
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")) == list(range(1, 61))


def newest_step(root, pattern):
    steps = [int(p.name.split("-")[1]) for p in root.glob(pattern)]
    return max(steps) if steps else 0


@pytest.mark.slow
def test_churn_survives_preemption_time_limit_and_sigkill(tmp_path):
    """The issue's done-when: the churn job on the cluster, preempted, past its time limit, its step SIGKILLed,
    then finished. One event per start, each made to happen (not waited for by chance): the preemption by a
    `high` job, the time limit by lowering the requeued job's TimeLimit to 1 minute before its start (restored
    once it is requeued again), the SIGKILL once the next start has trained 1,000 steps."""
    from gwenlake_hpc.runtime.ledger import lost_steps, read_ledger
    from helpers.project import make_churn_project

    project = make_churn_project(tmp_path / "churn")
    pattern = "runs/crm.churn/*/checkpoints/step-*"
    # 60k steps: at ~1,000 steps/s the time-limited start (it trains 30 s at most: SLURM warns 30 to 60 s before
    # its 1-minute limit) cannot reach the end, whatever the speed of the machine.
    proc = project.run("+job=churn", "job.steps=60000", "job.eval_every=5000", "launcher=slurm",
                       "launcher.timeout_min=10", "launcher.signal_delay_s=30", "launcher.max_retries=12",
                       "launcher.cpus_per_task=2", "+launcher.additional_parameters.nodelist=n1",
                       "launcher.progress_every_s=5", check=0, timeout=600)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = Path(re.search(r"run directory (\S+)", proc.stdout).group(1))

    def requeued_after(before):  # held in SLURM's start delay, not released: the test changes it first
        f = job_fields(job)
        return (int(f.get("Restarts", "0")) > before and f.get("JobState") == "PENDING"
                and f.get("Reason") == "BeginTime")

    def set_time_limit(minutes):
        out = subprocess.run(["scontrol", "update", f"jobid={job}", f"TimeLimit={minutes}"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    def log_text():
        return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm" / job).glob("*_log.*")))

    # Start 1: preempted once a checkpoint exists.
    wait_until(lambda: newest_step(project.root, pattern) >= 5000, what="a checkpoint at step 5000")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")
    wait_until(lambda: requeued_after(0), what="the preempted job requeued")
    # Start 2: a time limit that ends within a minute, set once the start is in its loop. SLURM may send the
    # warning signal as soon as a start begins (up to 60 s before --signal's delay): set at the release, a start
    # slow to import (a loaded machine) was stopped in its start-up, a path of its own (test_a_rank_sleeping_at_import_ends_at_once_on_sigterm).
    release(int(job))
    wait_until(lambda: len(read_ledger(run_dir)) == 2 and read_ledger(run_dir)[1].get("first_step") is not None,
               what="start 2 in its loop")
    elapsed_s = sum(int(x) * m for x, m in zip(reversed(job_fields(job)["RunTime"].replace("-", ":").split(":")),
                                                  (1, 60, 3600, 86400)))
    set_time_limit(elapsed_s // 60 + 1)  # under a minute left: the warning comes at once or within 30 s
    wait_until(lambda: requeued_after(1), timeout=300, what="the time-limited start requeued")
    set_time_limit(10)
    release(int(job))
    # Start 3: SIGKILLed after 1,000 steps of its own (the ledger records its steps as it goes).
    def trained_in_start_3():
        recs = read_ledger(run_dir)
        return (len(recs) == 3 and recs[2].get("first_step") is not None and recs[2].get("last_step") is not None
                and recs[2]["last_step"] >= recs[2]["first_step"] + 1000)
    wait_until(trained_in_start_3, what="start 3 training 1,000 steps")
    step_proc = f"^{re.escape(sys.executable)} -m gwenlake_hpc.launch.boot -u -m submitit.core._submit {re.escape(str(run_dir))}"
    pids = wait_until(lambda: sh("pgrep", "-f", step_proc).split(), what="the job step's process")
    subprocess.run(["kill", "-9", *pids], check=True)
    # Start 4 finishes.
    assert finish(job, timeout=900) == "COMPLETED"

    text = log_text()
    assert "(SIGTERM)" in text and "killed by signal" in text and re.search(r"time limit \(\d+ s left\): requeue", text)
    recs = read_ledger(run_dir)
    assert [r["end"] for r in recs] == ["evicted", "time limit", "killed", "finished"], recs
    # the time-limited start sealed its last step; the last start resumed from the killed start's newest sealed
    # checkpoint (most often none of its own: it was killed 1,000 steps in), and the killed start's steps after
    # it were lost
    assert recs[1]["sealed_step"] == recs[1]["last_step"]
    resumed = recs[3]["first_step"] - 1
    assert resumed == (recs[2]["sealed_step"] or recs[1]["last_step"]), recs
    assert lost_steps(recs[2]) == recs[2]["last_step"] - resumed > 0
    version = re.findall(r"model crm.churn version ([0-9a-f]{40})", text)[-1]
    metrics = json.loads(project.git("show", f"{version}:crm/churn/metrics.json"))
    assert metrics["test_auc"] > 0.8
    lineage = json.loads(project.git("show", f"{version}:crm/churn/lineage.json"))
    assert {s["SLURM_JOB_ID"] for s in lineage["starts"]} == {job} and len(lineage["starts"]) == 4
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("crm.churn").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")) == list(range(1, 60001))


def test_lost_node_requeues_and_resumes_from_newest_checkpoint(project):
    """The node under the job dies (slurmd and the job's processes SIGKILLed, node set DOWN): SLURM requeues
    the --requeue job elsewhere, and the new start finds the newest complete checkpoint."""
    from helpers.slurm_cluster import lose_node, revive_node

    job = submit(project, "job.steps=300", "launcher=slurm", "launcher.timeout_min=10", "launcher.cpus_per_task=2",
                 "launcher.progress_every_s=2", env_vars={"GWL_TEST_SLEEP": "0.05"})
    wait_until(checkpoint_at_least(project, 50), what="a checkpoint at step 50")
    node = job_fields(job)["NodeList"]
    assert node in ("n1", "n2")
    try:
        lose_node(node, int(job))
        newest = max(int(p.name.split("-")[1]) for p in (run_dir(project) / "checkpoints").glob("step-*"))
        assert finish(job, timeout=400) == "COMPLETED"
    finally:
        revive_node(node)
    assert job_fields(job).get("Restarts") == "1"
    assert job_fields(job)["NodeList"] != node
    text = log_text(project, job)
    assert f"resuming from step {newest}" in text
    one_point_per_step(project, 300)
    # the goodput ledger: the first start wrote no end (its processes were SIGKILLed); sacct's NODE_FAIL for
    # that run of the job names it a lost node, not a kill
    from gwenlake_hpc.launch.status import lost_node_starts
    from gwenlake_hpc.runtime.ledger import read_ledger

    assert [r["end"] for r in read_ledger(run_dir(project))] == ["killed", "finished"]
    lost = lost_node_starts(job, run_dir(project))
    assert lost == {0}, sh("sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "State")
    assert [r["end"] for r in read_ledger(run_dir(project), lost_nodes=lost)] == ["lost node", "finished"]


HANDLE_SCRIPT = r'''
import json, sys
from gwenlake_hpc import GwenlakeError
from gwenlake_hpc.job.plan import load_target

fit = load_target("trainer.py:fit")
out = {}
ok = fit.submit("launcher.timeout_min=5", job="t")
out["ok_job"] = ok.job_id
st = ok.wait(timeout=300)
out.update(ok_state=st.state, ok_run_id=ok.run_id, ok_checkpoint=str(ok.latest_checkpoint()))
bad = fit.submit("launcher.timeout_min=5", "+launcher.env.GWL_TEST_BAD=raise", "job.seed=1", job="t")
try:
    bad.wait(timeout=300)
    out["bad"] = "no error"
except GwenlakeError as exc:
    out["bad"] = str(exc)
slow = fit.submit("launcher.timeout_min=5", "+launcher.env.GWL_TEST_SLEEP=0.5", "job.seed=2", job="t")
try:
    slow.wait(timeout=1)
    out["slow"] = "no timeout"
except TimeoutError as exc:
    out["slow"] = "TimeoutError: " + str(exc)
slow.cancel()
try:
    slow.wait(timeout=120)
except GwenlakeError as exc:
    out["cancelled"] = str(exc)
print(json.dumps(out))
'''


def test_python_handle_submit_wait_status_cancel(project):
    proc = subprocess.run([sys.executable, "-c", HANDLE_SCRIPT], cwd=project.root, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok_state"] == "COMPLETED"
    assert out["ok_checkpoint"].endswith("checkpoints/step-000000060")
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    assert client.get_run(out["ok_run_id"]).info.status == "FINISHED"
    assert "FAILED" in out["bad"] and out["slow"].startswith("TimeoutError")
    assert "CANCELLED" in out["cancelled"]


def test_sbatch_template_by_hand_survives_preemption(project):
    """sbatch/train.sbatch as a person submits it: overrides after the script, the same requeue and resume."""
    import os
    import shutil

    from helpers.project import REPO

    shutil.copy(REPO / "sbatch" / "train.sbatch", project.root / "train.sbatch")
    env = {**os.environ, "GWENLAKE_PYTHON": sys.executable, "GWL_TEST_SLEEP": "0.05", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["sbatch", "--parsable", "--time=00:05:00", "--cpus-per-task=2", "-w", "n1",
                           "train.sbatch", "+job=t", "job.steps=300", "launcher.progress_every_s=2"],
                          cwd=project.root, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    wait_until(checkpoint_at_least(project, 50), what="a checkpoint at step 50")
    assert sh("sbatch", "--parsable", "-o", "/dev/null", "-p", "high", "-w", "n1", "-c", "2", "--wrap", "sleep 2")
    assert finish(job) == "COMPLETED"
    text = (project.root / f"slurm-gwenlake-train-{job}.out").read_text()
    assert "stop requested (SIGTERM)" in text and "resuming from step" in text and "model t.model version" in text
    assert job_fields(job).get("Restarts") == "1"
    one_point_per_step(project, 300)


def test_a_time_limit_warning_during_start_up_is_a_stop_not_a_kill(project):
    """SIGUSR2 sent to the job step as soon as the job runs (SLURM may send --signal up to 60 s early): the step
    is not killed by it (no exit by signal 12); the training records the stop and ends at a step boundary."""
    # A loop of ~12 s (0.2 s a step): a signal that SLURM delivers late under load still lands before the loop's
    # end (in CI8 a 0.5 s loop was over before the signals arrived, and the job completed without a stop).
    proc = project.run("+job=t", "launcher=slurm", "launcher.timeout_min=5", "launcher.partition=high",
                       "launcher.max_retries=0", "+launcher.env.GWL_TEST_SLEEP=0.2", check=0)
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    run_dir = re.search(r"run directory (\S+)", proc.stdout).group(1)
    pattern = f"^{re.escape(sys.executable)} -m gwenlake_hpc.launch.boot -u -m submitit.core._submit {re.escape(run_dir)}"

    def step_catches_usr2():
        """The step's interpreter (the cluster's nodes are this machine) has run boot's first lines: SIGUSR2 is
        caught (bit 12 of SigCgt in /proc/PID/status) while submitit, torch and the trainer are still loading."""
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        for pid in found:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
            if caught and int(caught.group(1), 16) & (1 << (12 - 1)):
                return True
        return False

    wait_until(step_catches_usr2, timeout=300, what="the job step catching SIGUSR2", poll=0.01)
    sent = 0
    for _ in range(20):
        sent += subprocess.run(["scancel", "--signal=USR2", job], capture_output=True).returncode == 0
        time.sleep(0.05)
    finish(job)
    exit_codes = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode"], capture_output=True,
                                text=True).stdout
    assert ":12" not in exit_codes and sent, exit_codes
    text = log_text_any(project, job)
    assert "stop requested (SIGUSR2)" in text, text[-3000:]


def test_resources_declared_on_train_reach_the_job(project):
    """@train(cpu="2", memory="500Mi", gpu="1", env=, secrets=, metadata=) on the real cluster: SLURM allocates
    them, the job sees the env and the secret (not in its script), the MLflow run carries the metadata. The
    secrets file outlives a requeue (the step SIGKILLed at step 15) and goes when the job has COMPLETED."""
    reached, go = project.root / "reached", project.root / "go"
    proc = project.run("job.target=trainer.py:fit_declared", "launcher=slurm", "launcher.timeout_min=5",
                       "launcher.partition=high", env={"GWL_TEST_TOKEN": "s3cr3t-value",
                                                       "GWL_TEST_PAUSE": f"15:{reached}:{go}"}, check=0)
    job = re.search(r"submitted job (\d+)", proc.stdout + proc.stderr).group(1)
    fields = job_fields(job)
    assert fields.get("MinMemoryNode") == "500M" and fields.get("NumCPUs") == "2", fields
    assert fields.get("TresPerNode") in ("gres:gpu:1", "gres/gpu:1"), fields  # the spelling depends on the version
    wait_until(reached.exists, what="the first start at step 15")
    secrets_file, = (run_dir(project) / "slurm").glob("secrets-*.env")
    assert secrets_file.stat().st_mode & 0o777 == 0o600
    step_proc = f"^{re.escape(sys.executable)} -m gwenlake_hpc.launch.boot -u -m submitit.core._submit {re.escape(str(run_dir(project)))}"
    reached.unlink()
    subprocess.run(["kill", "-9", *wait_until(lambda: sh("pgrep", "-f", step_proc).split(), what="the step")],
                   check=True)

    def second_start_paused():  # releasing the requeued job from SLURM's start delay
        if state_of(job) == "PENDING" and job_fields(job).get("Reason") == "BeginTime":
            release(int(job))
        return reached.exists()

    wait_until(second_start_paused, what="the requeued start at step 15")
    assert secrets_file.exists()  # kept across the requeue: this start sourced it
    go.touch()
    assert finish(job) == "COMPLETED"
    text = log_text(project, job)
    assert "killed by signal" in text and "No such file" not in text
    assert "GWL_DECLARED=from the decorator" in text and text.count("token present: True") == 2
    assert not secrets_file.exists()  # the job ended for good: its teardown removed it
    leaks = [p for p in project.root.rglob("*") if p.is_file() and b"s3cr3t-value" in p.read_bytes()]
    assert leaks == []  # not in the script, the logs, the spool, the store, the model repository
    run = one_point_per_step(project, 20)
    assert run.data.tags["team"] == "crm" and run.data.tags["purpose"] == "resources test"
    assert "s3cr3t-value" not in str(run.data.params) + str(run.data.tags)


def test_a_sweep_of_short_fits_is_one_job_array_of_versions(project):
    """A short fit (gwenlake_hpc.transforms) through launcher=slurm and a sweep: one job array, every task a
    version with its own metrics."""
    proc = project.run("-m", "job.target=trainer.py:short", "launcher=slurm", "launcher.timeout_min=5",
                       "launcher.partition=high", "+job.params.lr=0.1,0.2", check=0, timeout=600)
    m = re.search(r"submitted job array (\d+) \(2 tasks, one sbatch\)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert [finish(f"{m.group(1)}_{i}") for i in range(2)] == ["COMPLETED", "COMPLETED"]
    from gwenlake_hpc.stores.versioning import list_versions

    versions = list_versions(project.root, "t.model")
    assert len(versions) == 2
    assert all("mse" in json.loads(project.git("show", f"{v['version']}:t/model/metrics.json")) for v in versions)
    lrs = sorted(json.loads(project.git("show", f"{v['version']}:t/model/lineage.json"))["config"]["params"]["lr"]
                 for v in versions)
    assert lrs == [0.1, 0.2]
