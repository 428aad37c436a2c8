"""An FSDP1 training (``FullyShardedDataParallel`` on gloo, the CPU) for tests/integration/test_sharded_fsdp1.py,
copied into the tests' project beside trainer.py (job ``t``: ``job.target=fsdp1.py:fit_fsdp1``).

Test hooks come from environment variables, never from params, so they do not change the run key:
  GWL_TEST_SIGTERM_AT=k       every rank sends itself SIGTERM during step k (a real signal: an eviction)
  GWL_TEST_ORIG_PARAMS=1      FSDP(..., use_orig_params=True) (default False: one flat parameter a unit)
  GWL_TEST_NESTED=1           each linear layer is an FSDP1 unit of its own inside the root's (auto_wrap_policy)
  GWL_TEST_SD_TYPE=FULL_STATE_DICT|SHARDED_STATE_DICT|LOCAL_STATE_DICT  the user's own state_dict_type, set on
                              the model before the loop (FSDP.set_state_dict_type)
  GWL_TEST_DUMP=dir           rank 0 torch.saves the full model and optimizer state after each checkpoint
                              (``saved-<step>.pt``) and after the resume's load_state (``loaded-<step>-world-<n>.pt``)
  GWL_TEST_STRAY_PARAM=1      the optimizer also steps a parameter that is not the model's
  GWL_TEST_NAMED=name         at the end every rank saves the model as a named checkpoint (gwenlake_hpc.checkpoint)
One process (world size 1) trains the plain model, without FSDP: what a checkpoint of 2 ranks resumes on.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import gwenlake_hpc
from gwenlake_hpc import Input, Output, load_state, save_state, train


@dataclass
class Params:
    batch_size: int = 16
    lr: float = 0.01
    hidden: int = 8


def _full_state(model, opt):
    """The full (unsharded) model and optimizer state on every rank (a collective under FSDP1; not cpu_offload,
    whose rank0_only gather fails when FSDP1's parameters are on the CPU, torch 2.13)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


@train(data=Input("t.rows"), output=Output("t.model"), steps=40, eval_every=5)
def fit_fsdp1(data, output, run, config: Params):
    """Two linear layers under one FSDP1 unit (or one each: GWL_TEST_NESTED) over the ranks, AdamW, ``save_state``
    of the model and the optimizer in every checkpoint (every 5 steps), the final model saved with
    ``save_state(output.file(...))``."""
    torch.manual_seed(1234)  # the same initial weights on every rank and world size
    model = nn.Sequential(nn.Linear(4, config.hidden), nn.ReLU(), nn.Linear(config.hidden, 1))
    if run.world_size > 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Linear}) if os.environ.get("GWL_TEST_NESTED") == "1" else None
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                                         use_orig_params=os.environ.get("GWL_TEST_ORIG_PARAMS") == "1")
        if os.environ.get("GWL_TEST_SD_TYPE"):
            FullyShardedDataParallel.set_state_dict_type(model, StateDictType[os.environ["GWL_TEST_SD_TYPE"]])
    params = list(model.parameters())
    if os.environ.get("GWL_TEST_STRAY_PARAM"):
        params.append(nn.Parameter(torch.zeros(3)))
    opt = torch.optim.AdamW(params, lr=config.lr)
    dump = Path(os.environ["GWL_TEST_DUMP"]) if os.environ.get("GWL_TEST_DUMP") else None
    if run.resumed:
        extra = load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
        assert extra["step"] == run.start_step, extra
        full = _full_state(model, opt)
        if dump is not None and run.is_main:
            torch.save(full, dump / f"loaded-{run.start_step}-world-{run.world_size}.pt")
    sigterm_at = int(os.environ.get("GWL_TEST_SIGTERM_AT", "-1"))
    for step, batch in run.steps(data.batches(config.batch_size)):
        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if run.at_eval:
            with run.checkpoint(keep=3) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt, extra={"step": step})
            if dump is not None:
                full = _full_state(model, opt)
                if run.is_main:
                    torch.save(full, dump / f"saved-{step}.pt")
    if run.evicted:
        return None
    if os.environ.get("GWL_TEST_NAMED"):
        gwenlake_hpc.checkpoint(model, path=os.environ["GWL_TEST_NAMED"], metadata={"lr": config.lr})
    save_state(output.file("model.safetensors"), model=model)  # one full file
    return {"final_loss": run.summary()["loss"]}
