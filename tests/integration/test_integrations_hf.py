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
    # SIGTERM during step 16: the loop ends after step 16 (the step in progress), whose checkpoint is sealed; the
    # job exits 75
    first = p.run("+job=hf_t", env={**env, "GWL_TEST_SIGTERM_AT": "16"}, check=75)
    assert "loop ended after step 16" in first.stderr + first.stdout, first.stderr
    # the Trainer's own save_steps=7 (step 14) and the eviction's (step 16), save_total_limit=2 as keep
    assert _checkpoints(p) == ["step-000000014", "step-000000016"]
    assert not (p.root / "mine").exists()  # output_dir is a scratch folder of the run directory

    # SIGKILL halfway through moving step 20's files into its checkpoint: never sealed, never resumed from
    second = p.run("+job=hf_t", env={**env, "GWL_TEST_SIGKILL_IN_SAVE": "20"}, check=-signal.SIGKILL)
    assert "resuming from step 16" in second.stderr + second.stdout, second.stderr
    assert _checkpoints(p) == ["step-000000014", "step-000000016"]

    # a byte of the sealed step 16's weights flipped on disk: verified before the resume, set aside for step 14
    (ck16,) = (p.root / "runs" / "lm.tiny").glob("*/checkpoints/step-000000016")
    raw = bytearray((ck16 / "model.safetensors").read_bytes())
    raw[-100] ^= 0xFF
    (ck16 / "model.safetensors").write_bytes(bytes(raw))
    last = p.run("+job=hf_t", env=env, check=0)
    out = last.stderr + last.stdout
    assert "step-000000016 is damaged" in out and "resuming from step 14" in out, out
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

    # one MLflow run across the three starts, `loss` one point per step 1..30 (15 and 16 were logged by all three
    # starts, 17..19 by two), the same losses as the uninterrupted run's, step by step
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
    # TrainingArguments' own check (a ValueError in its constructor): its message, exit 2, no traceback
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"}, "load_best_model_at_end"),
    ({"save_strategy": "best", "metric_for_best_model": "loss"}, "save_strategy='best'"),
    # the adversarial pass's input: the Trainer's constructor contacts the Hub (no network here) before run_trainer
    ({"push_to_hub": True}, "push_to_hub=True"),
])
def test_settings_that_cannot_work_exit_2_naming_the_setting(tmp_path, arguments, named):
    p = _project(tmp_path / "p")
    proc = p.run("+job=hf_t", env={"GWL_TEST_HF_ARGS": json.dumps(arguments)}, check=2)
    out = proc.stdout + proc.stderr
    assert named in out and "Traceback" not in out, out
    assert not list((p.root / "runs" / "lm.tiny").glob("*/checkpoints/step-*"))


# The reported input of issue 41: 2 gloo ranks under torchrun, TRL's SFTTrainer (num_tokens), the Trainer's own
# sampler shuffling with a loader worker, an FSDP-like DCP model folder written by every rank, the best checkpoints
# by a metric with load_best_model_at_end, evicted by SIGTERM on one rank, rerun
RANKS_JOB = "target: hf_hooks:fit\nsteps: 30\neval_every: 10\nseed: 0\nparams:\n  sequences: 512\n  batch_size: 8\n"
RANKS_ARGS = {"dataloader_num_workers": 1, "save_strategy": "steps", "save_steps": 5, "eval_strategy": "steps",
              "eval_steps": 5, "save_total_limit": 2, "metric_for_best_model": "eval_loss",
              # the worst loss is the "best": the first evaluation's (step 5) stays best, so the model loaded at
              # the end is not the last one, and it was named before the eviction
              "greater_is_better": True, "load_best_model_at_end": True}


def _torchrun(project, *args, env=None, timeout=600):
    """``python -m gwenlake_hpc.launch.torchrun --standalone --nproc-per-node 2 -m gwenlake_hpc ARGS``."""
    import os
    import subprocess
    import sys
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GWENLAKE_DIST_TIMEOUT_S": "120",
            **(env or {})}
    full.pop("GWENLAKE_CONF", None)
    return subprocess.run([sys.executable, "-m", "gwenlake_hpc.launch.torchrun", "--standalone", "--nproc-per-node",
                           "2", "-m", "gwenlake_hpc", *args], cwd=project.root, env=full, capture_output=True,
                          text=True, timeout=timeout)


def _run_dir(project):
    """The one run directory of lm.tiny (beside the model's named checkpoints' folder)."""
    (run_dir,) = (d for d in (project.root / "runs" / "lm.tiny").iterdir() if d.name != "named")
    return run_dir


def _sealed(project) -> list[str]:
    return sorted(d.name for d in (_run_dir(project) / "checkpoints").iterdir() if d.name.startswith("step-"))


def test_ranks_under_torchrun_trl_best_checkpoints_and_a_dcp_folder_resume_to_the_uninterrupted_run(tmp_path):
    pytest.importorskip("trl")
    from safetensors.torch import load_file

    env = {"GWL_TEST_TRL": "1", "GWL_TEST_HF_ARGS": json.dumps(RANKS_ARGS)}
    straight = make_framework_project(tmp_path / "straight", "hf_hooks.py", "hf_r", RANKS_JOB)
    whole = _torchrun(straight, "+job=hf_r", env={**env, "GWL_TEST_COUNTS": str(straight.root / "counts")})
    assert whole.returncode == 0, whole.stderr[-4000:]
    v_straight = _version(whole)

    p = make_framework_project(tmp_path / "interrupted", "hf_hooks.py", "hf_r", RANKS_JOB)
    env = {**env, "GWL_TEST_COUNTS": str(p.root / "counts")}
    # SIGTERM on rank 1 during step 13: every rank ends after step 13 (not 14), its checkpoint sealed; torchrun
    # alone exits 1 here (its agent counts rank 0's 75 as a failure and stops rank 1): the wrapper exits 75
    first = _torchrun(p, "+job=hf_r", env={**env, "GWL_TEST_SIGTERM_AT": "13", "GWL_TEST_SIGTERM_RANK": "1"})
    out = first.stdout + first.stderr
    assert first.returncode == 75, out[-4000:]
    assert "stop requested (SIGTERM on rank 1): loop ended after step 13" in out, out[-4000:]
    assert "stop requested (SIGTERM): loop ended after step 13" in out
    assert "ChildFailedError" in out and "evicted, exit 75" in out
    assert _sealed(p) == ["step-000000010", "step-000000013"]  # save_steps=5, save_total_limit=2, the stop's
    run_dir = _run_dir(p)
    ck13 = run_dir / "checkpoints" / "step-000000013"
    files = json.loads((ck13 / "MANIFEST.json").read_text())["files"]
    # every file the Trainer's ranks wrote, nested ones too: the DCP folder's shards of both ranks, both RNGs
    assert {"pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
            "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "optimizer.pt",
            "gwenlake_trainer.pt"} <= set(files)
    # the best so far (step 5) is a named checkpoint with its metric, and the sealed state points at it
    best = p.root / "runs" / "lm.tiny" / "named" / f"{run_dir.name}.best-000000005"
    info = json.loads((best / "checkpoint.json").read_text())
    assert info["metadata"]["metric"] == "eval_loss" and info["step"] == 5
    assert json.loads((ck13 / "trainer_state.json").read_text())["best_model_checkpoint"] == str(best)

    # a byte of rank 1's shard of step 13's DCP folder flipped: verified before the resume, step 10 resumed from
    shard = ck13 / "pytorch_model_fsdp_0" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    last = _torchrun(p, "+job=hf_r", env=env)
    out = last.stdout + last.stderr
    assert last.returncode == 0, out[-4000:]
    assert "step-000000013 is damaged" in out and "resuming from step 10" in out, out[-4000:]
    v = _version(last)

    # the training's last weights (the sealed step 30) equal the uninterrupted run's: the Trainer's sampler
    # (shuffled, a loader worker) resumed in its order by skip_first_batches, RNGs by rank
    a = load_file(str(_run_dir(straight) / "checkpoints" / "step-000000030" / "model.safetensors"))
    b = load_file(str(run_dir / "checkpoints" / "step-000000030" / "model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) > 5
    assert all((a[k] == b[k]).all() for k in a)
    # load_best_model_at_end: the version is step 5's model, read from the named checkpoint after two evictions
    # of the runs' own checkpoints (step 5 is long pruned), and it is the uninterrupted run's version
    va, vb = weights(straight, v_straight, WEIGHTS), weights(p, v, WEIGHTS)
    named = load_file(str(best / "model.safetensors"))
    assert sorted(va) == sorted(vb) == sorted(named)
    assert all((va[k] == vb[k]).all() and (vb[k] == named[k]).all() for k in va)
    assert not (vb["transformer.wte.weight"] == b["transformer.wte.weight"]).all()

    # one MLflow run, each step once: loss as the uninterrupted run's; TRL's num_tokens goes on counting across
    # the resume (it restarted from 0 in the reported input); the evaluations at 5, 10, ..., 30
    losses, tokens = history(p, "lm.tiny", "loss"), history(p, "lm.tiny", "num_tokens")
    assert sorted(losses) == sorted(tokens) == list(range(1, 31))
    assert losses == history(straight, "lm.tiny", "loss")
    assert tokens == history(straight, "lm.tiny", "num_tokens")
    assert [tokens[s] for s in range(1, 31)] == [512.0 * s for s in range(1, 31)]  # 2 ranks x 8 rows x 32 tokens
    assert sorted(history(p, "lm.tiny", "eval_loss")) == [5, 10, 15, 20, 25, 30]
    assert info["metadata"]["value"] == pytest.approx(history(straight, "lm.tiny", "eval_loss")[5])
    # the callbacks' own states: an ExportableState (TrainerState.stateful_callbacks) and a state_dict one
    assert (p.root / "counts.exportable").read_text() == "30"
    assert (p.root / "counts.state_dict").read_text() == "30"
