"""The Hugging Face Trainer as a job's loop (gwenlake_hpc.integrations.transformers), in real processes with real
signals: examples/hf_trainer.py's tiny GPT-2 through tests/project/hf_hooks.py (the same training, with the
tests' signal hooks)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mlflow import MlflowClient  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from helpers.project import REPO, TESTS, Project, git  # noqa: E402

pytestmark = pytest.mark.slow

JOB = "target: hf_hooks:fit\nsteps: 30\neval_every: 10\nseed: 0\nparams:\n  sequences: 512\n"
# The Trainer's own checkpoints as a user sets them: an output_dir of its own, save_steps, save_total_limit
OWN_SAVES = {"output_dir": "mine", "save_strategy": "steps", "save_steps": 7, "save_total_limit": 2}


def _project(root) -> Project:
    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(TESTS / "project" / "hf_hooks.py", root / "hf_hooks.py")
    (root / "conf" / "job" / "hf_t.yaml").write_text(JOB)
    (root / ".gitignore").write_text("runs/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "code")
    return Project(root)


def _version(proc) -> str:
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("model lm.tiny version "), proc.stdout + proc.stderr
    return last.split()[-1]


def _checkpoints(project) -> list[str]:
    (run_dir,) = (project.root / "runs" / "lm.tiny").iterdir()
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def _weights(project, sha) -> dict:
    path = project.root / f"w-{sha[:8]}.safetensors"
    path.write_bytes(subprocess.run(["git", "cat-file", "blob", f"{sha}:lm/tiny/model.safetensors"],
                                    cwd=project.root, capture_output=True, check=True).stdout)
    return load_file(str(path))


def test_sigterm_then_sigkill_in_the_checkpoint_write_resume_to_the_uninterrupted_weights(tmp_path):
    straight = _project(tmp_path / "straight")
    whole = straight.run("+job=hf_t", env={"GWL_TEST_HF_ARGS": json.dumps(OWN_SAVES)}, check=0)
    v_straight = _version(whole)

    p = _project(tmp_path / "interrupted")
    env = {"GWL_TEST_HF_ARGS": json.dumps(OWN_SAVES)}
    # SIGTERM during step 16: the loop ends after step 17, whose checkpoint is sealed; the job exits 75
    first = p.run("+job=hf_t", env={**env, "GWL_TEST_SIGTERM_AT": "16"}, check=75)
    assert "loop ended after step 17" in first.stderr + first.stdout, first.stderr
    # the Trainer's own save_steps=7 (step 14) and the eviction's (step 17), save_total_limit=2 as keep
    assert _checkpoints(p) == ["step-000000014", "step-000000017"]
    assert not (p.root / "mine").exists()  # output_dir is a scratch folder of the run directory

    # SIGKILL halfway through moving step 20's files into its checkpoint: never sealed, never resumed from
    second = p.run("+job=hf_t", env={**env, "GWL_TEST_SIGKILL_IN_SAVE": "20"}, check=-signal.SIGKILL)
    assert "resuming from step 17" in second.stderr + second.stdout, second.stderr
    assert _checkpoints(p) == ["step-000000014", "step-000000017"]

    last = p.run("+job=hf_t", env=env, check=0)
    assert "resuming from step 17" in last.stderr + last.stdout, last.stderr
    assert _checkpoints(p) == ["step-000000028", "step-000000030"]
    v = _version(last)

    # the Trainer restores data order (skip_first_batches) and RNG (rng_state.pth, dropout): the same weights
    a, b = _weights(straight, v_straight), _weights(p, v)
    assert sorted(a) == sorted(b) and len(a) > 5
    for name in a:
        assert (a[name] == b[name]).all(), name

    # one MLflow run across the three starts, `loss` one point per step 1..30 (18..19 were logged twice)
    client = MlflowClient(f"sqlite:///{p.root / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("lm.tiny")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "lm.tiny"]
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 31))
    # the same losses as the uninterrupted run's, step by step
    assert {m.step: m.value for m in history} == _losses(straight)

    # the version opens with from_pretrained, and predicts what the training's last weights predict
    import torch
    from transformers import AutoModelForCausalLM

    from gwenlake_hpc import load_model
    loaded = load_model("lm.tiny", v, repo=p.root)
    model = AutoModelForCausalLM.from_pretrained(str(loaded.path))
    assert torch.equal(model.state_dict()["transformer.wte.weight"], b["transformer.wte.weight"])
    assert loaded.metrics["eval_loss"] < 4.0  # from ~5.5 (uniform over 256 bytes) at step 0


def _losses(project) -> dict[int, float]:
    client = MlflowClient(f"sqlite:///{project.root / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lm.tiny").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}


@pytest.mark.parametrize("arguments, named", [
    ({"report_to": "wandb"}, "report_to"),  # wandb is not installed here: the Trainer's constructor raises
    ({"save_total_limit": 3}, "save_total_limit=3"),  # run_trainer's keep=2
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "load_best_model_at_end"),
])
def test_settings_that_cannot_work_exit_2_naming_the_setting(tmp_path, arguments, named):
    p = _project(tmp_path / "p")
    proc = p.run("+job=hf_t", env={"GWL_TEST_HF_ARGS": json.dumps(arguments)}, check=2)
    out = proc.stdout + proc.stderr
    assert named in out and "Traceback" not in out, out
    assert not list((p.root / "runs" / "lm.tiny").glob("*/checkpoints/step-*"))
