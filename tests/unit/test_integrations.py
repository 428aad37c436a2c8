"""The integrations' pieces that need no job: the Run driven one step at a time (DrivenLoop), the translators
of a framework's refusals into exit 2 (base.errors), the HF Trainer's argument checks."""

from __future__ import annotations

import pytest

from gwenlake_hpc.base import errors
from gwenlake_hpc.base.errors import ConfigError, as_config_error, recognise_config_errors
from gwenlake_hpc.integrations.loop import DrivenLoop
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker


def _run(tmp_path, steps, eval_every=10**9, stop=None):
    return Run(run_dir=tmp_path / "run", run_key="k", steps=steps, epochs=None, eval_every=eval_every, seed=0,
               tracker=NullTracker(), stop=stop or StopRequest(), progress="off")


def test_driven_loop_turns_the_runs_steps_one_call_a_step(tmp_path):
    run = _run(tmp_path, steps=100, eval_every=3)
    loop = DrivenLoop(run, total=5, framework="f")  # the framework's length replaces job.steps
    seen = []
    while loop.advance():
        seen.append((run.step, run.at_eval))
        loop.check_step(run.step)
    assert seen == [(1, False), (2, False), (3, True), (4, False), (5, True)]
    assert run.total_steps == 5 and loop.ended and not loop.advance()


def test_driven_loop_refuses_a_framework_step_counter_other_than_the_runs(tmp_path):
    run = _run(tmp_path, steps=10)
    loop = DrivenLoop(run, total=10, framework="the Trainer")
    assert loop.advance() and loop.advance()
    with pytest.raises(RuntimeError, match="its step counter is 3 where the Run's is 2"):
        loop.check_step(3)


def test_driven_loop_ends_after_a_stop_request_at_the_next_boundary(tmp_path):
    stop = StopRequest()
    run = _run(tmp_path, steps=10, stop=stop)
    loop = DrivenLoop(run, total=10, framework="f")
    assert loop.advance() and loop.advance()
    stop.request("SIGTERM")
    steps = []
    while loop.advance():
        steps.append((run.step, run.stopping, run.at_eval))
    # the step after the request is the last, and it is an evaluation step (its checkpoint is the resume point)
    assert steps == [(3, True, True)] and run.evicted


def test_a_registered_translator_turns_a_framework_error_into_a_config_error(monkeypatch):
    monkeypatch.setattr(errors, "_TRANSLATORS", [])

    def broken(exc):
        raise KeyError("a translator that fails is skipped")

    def mine(exc):
        return ConfigError(f"setting x: {exc}") if isinstance(exc, RuntimeError) else None

    recognise_config_errors(broken)
    recognise_config_errors(mine)
    recognise_config_errors(mine)  # kept once
    assert errors._TRANSLATORS == [broken, mine]
    found = as_config_error(RuntimeError("needs wandb"))
    assert isinstance(found, ConfigError) and str(found) == "setting x: needs wandb"
    assert as_config_error(ValueError("other")) is None


def test_hf_argument_checks_name_the_setting():
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from gwenlake_hpc.integrations.transformers import _check_arguments

    def args(**kw):
        return TrainingArguments(**{"output_dir": "/nonexistent/unused", "report_to": "none", "use_cpu": True, **kw})

    assert _check_arguments(args(), keep=2) == 2
    assert _check_arguments(args(save_total_limit=3), keep=None) == 3
    for kw, named in [({"report_to": "tensorboard"}, "report_to"), ({"save_only_model": True}, "save_only_model"),
                      ({"save_total_limit": 3}, "save_total_limit=3"), ({"push_to_hub": True}, "push_to_hub")]:
        with pytest.raises(ConfigError, match=named):
            _check_arguments(args(**kw), keep=2)


def test_lightning_skips_the_callbacks_unused_batch_hooks_and_each_step_is_a_run_step(tmp_path):
    """The hooks GwenlakeCallback leaves None are skipped by Lightning's dispatcher (a cost of every batch
    spared); a short fit still turns the Run once a step, one point a step, and checks the step counter."""
    L = pytest.importorskip("lightning")
    import torch

    from gwenlake_hpc.integrations.lightning import GwenlakeCallback, fit_trainer

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for hook in ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                 "on_before_zero_grad"):
        assert getattr(GwenlakeCallback, hook) is None
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path / "lt"))
    run = _run(tmp_path, steps=6)
    logged = []
    real_log = run.log
    run.log = lambda values, step=None, tags=None: (logged.append((step, sorted(values))), real_log(values, step, tags))
    fit_trainer(trainer, Tiny(), run, train_dataloaders=loader)
    assert run.step == 6 and trainer.global_step == 6 and not run.evicted
    # step 6, the last, writes a checkpoint: its point goes to run.log before the seal, and again when Lightning
    # logs it after the hook (the tracker keeps one point a step: the second is at no newer step)
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6, 6] and all("loss" in keys for _, keys in logged)
