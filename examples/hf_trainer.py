"""A tiny causal language model trained by the Hugging Face ``Trainer`` (no download: the model is built from a
config, the text is made here, the tokenizer is one byte a token).

    python -m gwenlake_hpc +job=hf_trainer

The Trainer's loop is the job's loop through ``gwenlake_hpc.integrations.transformers.run_trainer``: an eviction
ends it after a sealed checkpoint (exit 75), the next start resumes from it, its logs go to the job's MLflow run
and the saved model is the version. Returns the held-out loss as ``eval_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gwenlake_hpc import Output, train
from gwenlake_hpc.integrations.transformers import SCRATCH, run_trainer, save_model

VOCAB = 256  # one byte a token


@dataclass
class LMParams:
    """Hyperparameters (``job.params`` in conf/job/hf_trainer.yaml)."""

    context: int = 32
    batch_size: int = 16
    lr: float = 3e-3
    layers: int = 2
    width: int = 32
    heads: int = 2
    sequences: int = 2048


def make_text(n: int, seed: int) -> list[str]:
    """``n`` sentences of sums, ``"12 + 7 = 19."``: a language whose next token is learnable."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, 100, (2, n), generator=g)
    return [f"{x} + {y} = {x + y}." for x, y in zip(a.tolist(), b.tolist())]


class ByteSequences(torch.utils.data.Dataset):
    """Fixed-length windows of the text's bytes: ``input_ids`` and ``labels`` int64 [context]."""

    def __init__(self, text: list[str], context: int):
        data = torch.tensor(list(" ".join(text).encode()), dtype=torch.long)
        self.windows = data[: len(data) // context * context].view(-1, context)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def make_model(p: LMParams) -> GPT2LMHeadModel:
    """GPT-2 architecture, ``layers`` blocks of width ``width``: token ids [batch, context] -> logits [batch,
    context, 256]."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=p.context, n_embd=p.width, n_layer=p.layers,
                                      n_head=p.heads, bos_token_id=0, eos_token_id=0))


def make_trainer(run, config: LMParams, **arguments) -> Trainer:
    """The Trainer of this example: seeded by the run (``job.seed``), logging every step, no checkpoints of its
    own (``run_trainer`` writes them into the run's store); ``arguments`` override its ``TrainingArguments``."""
    torch.manual_seed(run.seed)
    # output_dir: run_trainer's scratch folder in the run directory (a folder of the working directory would stay
    # there when a setting is refused)
    args = TrainingArguments(**{"output_dir": str(run.run_dir / SCRATCH),
                                "per_device_train_batch_size": config.batch_size, "learning_rate": config.lr,
                                "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": run.seed, "use_cpu": not torch.cuda.is_available(),
                                "dataloader_num_workers": 0, "disable_tqdm": True, **arguments})
    return Trainer(model=make_model(config), args=args,
                   train_dataset=ByteSequences(make_text(config.sequences, run.seed), config.context),
                   eval_dataset=ByteSequences(make_text(256, run.seed + 1), config.context))


@train(output=Output("lm.tiny"), steps=200, eval_every=50)
def fit(output, run, config: LMParams):
    trainer = make_trainer(run, config)
    run_trainer(trainer, run, keep=2)
    if run.evicted:
        return None
    save_model(trainer, output)
    return {"eval_loss": float(trainer.evaluate()["eval_loss"])}
