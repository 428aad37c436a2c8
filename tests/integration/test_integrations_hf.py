"""The Hugging Face Trainer as a job's loop (gwenlake_hpc.integrations.transformers), in real processes with real
signals: examples/hf_trainer.py's tiny GPT-2 through tests/project/hf_hooks.py (the same training, with the
tests' signal hooks)."""

from __future__ import annotations

import json
import signal

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers.integrations import (checkpoints, history, make_framework_project, the_run,  # noqa: E402
                                  version_line, weights)

pytestmark = pytest.mark.slow

JOB = "target: hf_hooks:fit\nsteps: 30\neval_every: 10\nseed: 0\nparams:\n  sequences: 512\n"
# The Trainer's own checkpoints as a user sets them: an output_dir of its own, save_steps, save_total_limit
OWN_SAVES = {"output_dir": "mine", "save_strategy": "steps", "save_steps": 7, "save_total_limit": 2}
WEIGHTS = "lm/tiny/model.safetensors"


def _project(root):
    return make_framework_project(root, "hf_hooks.py", "hf_t", JOB)


def _version(proc) -> str:
    return version_line(proc, "lm.tiny")


def _checkpoints(project) -> list[str]:
    return checkpoints(project, "lm.tiny")


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

    # a byte of the sealed step 17's weights flipped on disk: verified before the resume, set aside for step 14
    (ck17,) = (p.root / "runs" / "lm.tiny").glob("*/checkpoints/step-000000017")
    raw = bytearray((ck17 / "model.safetensors").read_bytes())
    raw[-100] ^= 0xFF
    (ck17 / "model.safetensors").write_bytes(bytes(raw))
    last = p.run("+job=hf_t", env=env, check=0)
    out = last.stderr + last.stdout
    assert "step-000000017 is damaged" in out and "resuming from step 14" in out, out
    assert _checkpoints(p) == ["step-000000028", "step-000000030"]
    v = _version(last)
    # the checkpoints' and the Output's files have a plain open()'s mode (safetensors writes 0600): readable by
    # teammates on the shared filesystem (the adversarial pass found model.safetensors 0600)
    (run_dir,) = (p.root / "runs" / "lm.tiny").iterdir()
    files = [f for f in (run_dir / "checkpoints" / "step-000000030").rglob("*") if f.is_file()]
    files += [f for f in (run_dir / "output").rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"model.safetensors", "optimizer.pt", "config.json"}
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files if f.stat().st_mode & 0o044 != 0o044} == {}

    # the Trainer restores data order (skip_first_batches) and RNG (rng_state.pth, dropout): the same weights
    a, b = weights(straight, v_straight, WEIGHTS), weights(p, v, WEIGHTS)
    assert sorted(a) == sorted(b) and len(a) > 5
    for name in a:
        assert (a[name] == b[name]).all(), name

    # one MLflow run across the three starts, `loss` one point per step 1..30 (15..19 were logged two or three times), the
    # same losses as the uninterrupted run's, step by step
    client, _ = the_run(p, "lm.tiny")
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "lm.tiny"]
    losses = history(p, "lm.tiny", "loss")
    assert sorted(losses) == list(range(1, 31))
    assert losses == history(straight, "lm.tiny", "loss")

    # the version opens with from_pretrained, and predicts what the training's last weights predict
    import torch
    from transformers import AutoModelForCausalLM

    from gwenlake_hpc import load_model
    loaded = load_model("lm.tiny", v, repo=p.root)
    model = AutoModelForCausalLM.from_pretrained(str(loaded.path))
    assert torch.equal(model.state_dict()["transformer.wte.weight"], b["transformer.wte.weight"])
    assert loaded.metrics["eval_loss"] < 4.0  # from ~5.5 (uniform over 256 bytes) at step 0


@pytest.mark.parametrize("arguments, named", [
    ({"report_to": "wandb"}, "report_to"),  # wandb is not installed here: the Trainer's constructor raises
    ({"save_total_limit": 3}, "save_total_limit=3"),  # run_trainer's keep=2
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"}, "load_best_model_at_end"),
    # the adversarial pass's input: the Trainer's constructor contacts the Hub (no network here) before run_trainer
    ({"push_to_hub": True}, "push_to_hub=True"),
])
def test_settings_that_cannot_work_exit_2_naming_the_setting(tmp_path, arguments, named):
    p = _project(tmp_path / "p")
    proc = p.run("+job=hf_t", env={"GWL_TEST_HF_ARGS": json.dumps(arguments)}, check=2)
    out = proc.stdout + proc.stderr
    assert named in out and "Traceback" not in out, out
    assert not list((p.root / "runs" / "lm.tiny").glob("*/checkpoints/step-*"))
