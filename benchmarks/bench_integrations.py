"""Benchmark of the framework integrations (issue 26; a script, not a test): a framework's step time with the
integration and without, on the same tiny model, side by side in one run.

- ``hf``: examples/hf_trainer.py's tiny GPT-2 (2 blocks of width 32, batches of 16 x 32 tokens), the Hugging Face
  ``Trainer.train()`` alone vs ``run_trainer`` (a Run of the same length: the callback, ``run.log`` of every
  step's logs, the Run's loop);
- ``lightning``: examples/lightning_churn.py's MLP on random features [128, 40], ``trainer.fit`` alone (with
  Lightning's default logger, as a user has it: CSV or TensorBoard files) vs ``fit_trainer`` (whose logger into the
  job's run replaces it).

The Run has no tracker behind ``run.log`` (``NullTracker``: the delivery to MLflow runs in its own thread in a
job, measured by bench_tracking.py) and checkpoints only after its last step, which is not timed: the figures are
the seconds between the ends of steps ``--warmup`` and ``--steps - 1``, medians of ``--repeat`` interleaved
rounds whose order turns each round. ``ratio`` is plain / integrated, the median of the rounds' own ratios (1.0: no
cost; the issue's goal is >= 0.98); for Lightning ``ratio_nologger`` is against a plain run without any logger.

Prints one ``name value`` line per figure.
Usage: ``python benchmarks/bench_integrations.py [--steps 300] [--warmup 20] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _run(tmp: Path, name: str, steps: int):
    from gwenlake_hpc.runtime.run import Run
    from gwenlake_hpc.runtime.signals import StopRequest
    from gwenlake_hpc.stores.tracking import NullTracker

    return Run(run_dir=tmp / name, run_key=name, steps=steps, epochs=None, eval_every=10**9, seed=0,
               tracker=NullTracker(), stop=StopRequest(), progress="off")


class _Clock:
    """The time at the end of each optimizer step (``ends[k]``: after step k+1)."""

    def __init__(self):
        self.ends: list[float] = []

    def span(self, warmup: int, steps: int) -> float:
        return self.ends[steps - 2] - self.ends[warmup - 1]


def hf_round(tmp: Path, name: str, steps: int, integrated: bool) -> _Clock:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from examples.hf_trainer import ByteSequences, LMParams, make_model, make_text
    from gwenlake_hpc.integrations.transformers import run_trainer

    clock = _Clock()

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.ends.append(time.perf_counter())

    p = LMParams()
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp / name / "out"), per_device_train_batch_size=p.batch_size,
                             learning_rate=p.lr, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                             use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True,
                             max_steps=steps, log_level="error")
    trainer = Trainer(model=make_model(p), args=args, train_dataset=ByteSequences(make_text(p.sequences, 0),
                                                                                    p.context),
                      callbacks=[Tick()])
    if integrated:
        run_trainer(trainer, _run(tmp, name, steps), keep=None)
    else:
        trainer.train()
    return clock


def lightning_round(tmp: Path, name: str, steps: int, integrated: bool, logger: bool = True) -> _Clock:
    import lightning as L
    import torch

    from examples.lightning_churn import ChurnModule
    from gwenlake_hpc.integrations.lightning import fit_trainer

    clock = _Clock()

    class Tick(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.ends.append(time.perf_counter())

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128 * 64, 40), torch.randint(0, 2, (128 * 64,)).float())
    loader = torch.utils.data.DataLoader(data, batch_size=128, shuffle=True)
    module = ChurnModule(40, 32, 0.1, 3e-3, 1e-4)
    trainer = L.Trainer(accelerator="auto", devices=1, max_steps=steps, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[Tick()], default_root_dir=str(tmp / name), logger=logger)
    if integrated:
        fit_trainer(trainer, module, _run(tmp, name, steps), train_dataloaders=loader)
    else:
        trainer.fit(module, train_dataloaders=loader)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--frameworks", nargs="+", default=["hf", "lightning"])
    a = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.disable(logging.WARNING)
    # name -> (round, integrated): the plain run as a user has it, and Lightning's also without any logger (its
    # default CSV/TensorBoard logger writes a file at every logged step: a stricter baseline than a user's)
    variants = {"hf": {"plain": (hf_round, False), "integrated": (hf_round, True)},
                "lightning": {"plain": (lightning_round, False), "integrated": (lightning_round, True),
                              "plain_nologger": (lambda t, n, s, i: lightning_round(t, n, s, i, logger=False), False)}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for fw in a.frameworks:
            names = list(variants[fw])
            times: dict[str, list[float]] = {n: [] for n in names}
            for r in range(a.repeat):  # interleaved, the order turned each round: a slow moment hits all alike
                for name in (names if r % 2 == 0 else names[::-1]):
                    fn, with_it = variants[fw][name]
                    clock = fn(tmp, f"{fw}-{r}-{name}", a.steps, with_it)
                    times[name].append(clock.span(a.warmup, a.steps) / (a.steps - 1 - a.warmup) * 1e3)
            for name in names:
                print(f"{fw}_{name}_ms_per_step {statistics.median(times[name]):.3f}")
            for base in (n for n in names if n.startswith("plain")):
                # the median of each round's own ratio (paired rounds), 1.0: no cost
                ratios = [b / i for b, i in zip(times[base], times["integrated"])]
                suffix = base[len("plain"):]
                print(f"{fw}_ratio{suffix} {statistics.median(ratios):.3f}")

if __name__ == "__main__":
    main()
