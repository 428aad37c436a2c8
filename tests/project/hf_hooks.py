"""examples/hf_trainer.py's training with the tests' hooks (real signals, sent by the process to itself):

  GWL_TEST_SIGTERM_AT=k      SIGTERM during step k (from the Trainer's on_step_begin)
  GWL_TEST_SIGTERM_RANK=r    ... on rank r only (default: every rank)
  GWL_TEST_TRL=1             TRL's SFTTrainer (counts num_tokens itself), subclassed to write and resume its model
                             from a DCP folder pytorch_model_fsdp_0/ (all ranks write it: Accelerate's FSDP layout,
                             which Accelerate does not use on CPU), with two counting callbacks (an
                             ExportableState one and a state_dict one) that write their counts into
                             GWL_TEST_COUNTS.<kind> at the training's end
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
    def __init__(self, sigterm_at: int, rank: int | None = None):
        self.sigterm_at, self.rank = sigterm_at, rank

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.sigterm_at and self.rank in (None, int(os.environ.get("RANK", "0"))):
            os.kill(os.getpid(), signal.SIGTERM)


class _Count(TrainerCallback):
    """Counts optimizer steps; writes the count into GWL_TEST_COUNTS.<kind> at the training's end (rank 0)."""

    kind = "state_dict"

    def __init__(self, count: int = 0):
        self.count = count

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and os.environ.get("GWL_TEST_COUNTS"):
            with open(f"{os.environ['GWL_TEST_COUNTS']}.{self.kind}", "w") as fh:
                fh.write(str(self.count))

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _exportable():
    from transformers.trainer_callback import ExportableState

    class ExportableCount(_Count, ExportableState):
        kind = "exportable"
        state_dict = load_state_dict = None  # HF's own mechanism only: TrainerState.stateful_callbacks

        def state(self):
            return {"args": {"count": self.count}, "attributes": {}}

    return ExportableCount()


class _DcpLayout:
    """The model of each checkpoint also in a DCP folder written by every rank (pytorch_model_fsdp_0/, as
    Accelerate's save_fsdp_model writes an FSDP model's SHARDED_STATE_DICT), and resumed from it alone."""

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)
        if _internal_call:
            import torch.distributed.checkpoint as dcp
            dcp.save(self.model.state_dict(), checkpoint_id=os.path.join(output_dir, "pytorch_model_fsdp_0"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        import torch.distributed.checkpoint as dcp
        model = model if model is not None else self.model
        state = model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(resume_from_checkpoint, "pytorch_model_fsdp_0"))
        model.load_state_dict(state)


def _sft_trainer(run, config: LMParams, **arguments):
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from examples.hf_trainer import ByteSequences, make_model, make_text
    from gwenlake_hpc.integrations.transformers import SCRATCH

    class Sft(_DcpLayout, SFTTrainer):
        pass

    vocab = {("<pad>" if i == 0 else chr(i)): i for i in range(256)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="<pad>")
    rows = {n: Dataset.from_dict({"input_ids": ByteSequences(make_text(k, s), config.context).windows.tolist()})
            for n, k, s in (("train", config.sequences, run.seed), ("eval", 64, run.seed + 1))}
    torch.manual_seed(run.seed)
    args = SFTConfig(**{"output_dir": str(run.run_dir / SCRATCH), "per_device_train_batch_size": config.batch_size,
                        "learning_rate": config.lr, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                        "seed": run.seed, "use_cpu": True, "disable_tqdm": True, "max_length": None, **arguments})
    trainer = Sft(model=make_model(config), args=args, train_dataset=rows["train"], eval_dataset=rows["eval"],
                  processing_class=tok)
    trainer.add_callback(_Count())
    trainer.add_callback(_exportable())
    return trainer


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
    build = _sft_trainer if os.environ.get("GWL_TEST_TRL") else make_trainer
    trainer = build(run, config, **json.loads(os.environ.get("GWL_TEST_HF_ARGS", "{}")))
    rank = os.environ.get("GWL_TEST_SIGTERM_RANK")
    trainer.add_callback(_Signals(int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1")), int(rank) if rank else None))
    gwl_hf.run_trainer(trainer, run, keep=2)
    if run.evicted:
        return None
    gwl_hf.save_model(trainer, output)
    return {"eval_loss": float(trainer.evaluate()["eval_loss"])}
