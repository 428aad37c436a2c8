"""examples/hf_trainer.py's training with the tests' hooks (real signals, sent by the process to itself):

  GWL_TEST_SIGTERM_AT=k      SIGTERM during step k (from the Trainer's on_step_begin)
  GWL_TEST_SIGKILL_IN_SAVE=k SIGKILL halfway through step k's checkpoint: the Trainer's files are written and
                             some of them are moved into the run's store, the block is not sealed
  GWL_TEST_HF_ARGS=json      TrainingArguments of the Trainer, over the example's (e.g. {"report_to": "wandb"})

Job config: conf/job/hf_t.yaml (written by tests/integration/test_integrations_hf.py).
"""

from __future__ import annotations

import json
import os
import signal

from transformers import TrainerCallback

import gwenlake_hpc.integrations.transformers as gwl_hf
from examples.hf_trainer import LMParams, make_trainer
from gwenlake_hpc import Output, train


class _Signals(TrainerCallback):
    def __init__(self, sigterm_at: int):
        self.sigterm_at = sigterm_at

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _kill_halfway_through_the_move(step: int) -> None:
    """SIGKILL at the second file moved into step ``step``'s checkpoint block."""
    real, moved = os.replace, []

    def replace(src, dst):
        if f"checkpoint-{step}" in str(src):
            moved.append(src)
            if len(moved) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)

    class _Os:  # the integration's os module, with this replace
        def __getattr__(self, name):
            return replace if name == "replace" else getattr(os, name)

    gwl_hf.os = _Os()


@train(output=Output("lm.tiny"), steps=200, eval_every=50)
def fit(output, run, config: LMParams):
    kill_at = int(os.environ.get("GWL_TEST_SIGKILL_IN_SAVE", "-1"))
    if kill_at > 0:
        _kill_halfway_through_the_move(kill_at)
    trainer = make_trainer(run, config, **json.loads(os.environ.get("GWL_TEST_HF_ARGS", "{}")))
    trainer.add_callback(_Signals(int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1"))))
    gwl_hf.run_trainer(trainer, run, keep=2)
    if run.evicted:
        return None
    gwl_hf.save_model(trainer, output)
    return {"eval_loss": float(trainer.evaluate()["eval_loss"])}
