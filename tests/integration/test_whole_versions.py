"""Whole versions and safe reruns (issue 40, items 1 and 2): what a kill leaves in the Output never reaches a
version, and a rerun with no step left (killed after its last checkpoint, before the commit) commits, for the test
trainer, every example and the docs' tested snippet, with tracking on and off."""

from __future__ import annotations

import json
import signal

import pytest

from helpers.integrations import make_framework_project, version_line
from helpers.jobs import run_dir_of, version_of
from helpers.killing import kill_before_commit_env

pytestmark = pytest.mark.slow


def test_a_kill_while_writing_the_output_leaves_nothing_in_the_version(project):
    """The reported input: a plain open() file half written, then a SIGKILL while save_state writes a 128 MiB
    Linear(4096, 8192) into the Output (its temporary file cut at 50 MiB); the rerun commits neither."""
    project.run("+job=t", env={"GWL_TEST_SIGKILL_IN_OUTPUT": "1"}, check=-signal.SIGKILL)
    out = run_dir_of(project) / "output"
    left = {p.name: p.stat().st_size for p in out.iterdir()}
    tmp = [n for n in left if n.startswith(".model.safetensors.") and n.endswith(".tmp")]
    assert len(tmp) == 1 and left[tmp[0]] == 50 * 2**20 and "notes.txt" in left, left
    proc = project.run("+job=t", check=0)
    version = version_of(proc)
    files = project.git("show", "--stat=200", "--format=", version)
    names = project.git("ls-tree", "-r", "--name-only", version).splitlines()
    assert "t/model/model.safetensors" in names, names
    assert not any(".tmp" in n or n.endswith("notes.txt") for n in names), files
    assert "removed what an unfinished start left" in proc.stdout + proc.stderr and tmp[0] in proc.stdout + proc.stderr
    # what the version holds is this start's model (a few KiB), not the 128 MiB one
    size = int(project.git("cat-file", "-s", f"{version}:t/model/model.safetensors"))
    assert size < 2**20, size


@pytest.mark.parametrize("tracking", ["true", "false"])
def test_a_rerun_with_no_step_left_commits_the_trainers_version(project, tracking):
    """Killed after the last seal (step 60 of 60), before the commit: the rerun trains nothing and commits, with
    the function's own result (final_loss) and the summary's loss restored from the checkpoint."""
    env = kill_before_commit_env()
    project.run("+job=t", f"job.tracking={tracking}", env=env, check=-signal.SIGKILL)
    assert (run_dir_of(project) / "checkpoints" / "step-000000060").is_dir()
    proc = project.run("+job=t", f"job.tracking={tracking}", check=0)
    assert "resuming from step 60" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    version = version_of(proc)
    metrics = json.loads(project.git("show", f"{version}:t/model/metrics.json"))
    assert metrics["final_loss"] > 0


#: The examples a user copies, each killed before its commit and run again: (job, overrides, model, metric).
EXAMPLES = [
    ("noise", ["job.steps=60", "job.eval_every=30"], "demo.noise", "final_loss"),
    ("churn", ["job.steps=40", "job.eval_every=20"], "crm.churn", "test_auc"),
    ("hf_trainer", ["job.steps=8", "job.eval_every=4", "job.params.sequences=256"], "lm.tiny", "eval_loss"),
    ("lightning_churn", ["job.steps=20", "job.eval_every=10"], "crm.churn-lightning", "test_auc"),
]


@pytest.mark.parametrize("job,overrides,model,metric", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_example_reruns_after_a_kill_before_its_commit(tmp_path, job, overrides, model, metric):
    """examples/*.py as written, tracking off (the summary has no MLflow run to fall back on): exit 0 and a
    version on the rerun, its metrics those the killed start computed."""
    p = make_framework_project(tmp_path / "p")
    args = [f"+job={job}", "job.tracking=false", *overrides]
    p.run(*args, env=kill_before_commit_env(), check=-signal.SIGKILL, timeout=900)
    proc = p.run(*args, check=0, timeout=900)
    version = version_line(proc, model)
    if metric:
        metrics = json.loads(p.git("show", f"{version}:{model.replace('.', '/')}/metrics.json"))
        assert metrics[metric] == metrics[metric] and metrics[metric] > 0, metrics
