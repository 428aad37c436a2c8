"""A training on random noise: regress the sum of a random vector. Runs anywhere, needs no data.

    python -m gwenlake_hpc +job=noise
    gwenlake-train --steps 500 fit
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from gwenlake_hpc import Output, default_device, load_state, save_state, train


@dataclass
class NoiseParams:
    dim: int = 16
    lr: float = 0.01
    sleep_s: float = 0.0  # pretend each step is slower (cluster tests)


@train(output=Output("demo.noise"), steps=200, eval_every=50)
def fit(output, run, config: NoiseParams):
    device = default_device()
    model = nn.Sequential(nn.Linear(config.dim, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    for step, _ in run.steps():
        x = torch.randn(64, config.dim)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.log({"loss": loss.item()})
        if config.sleep_s:
            time.sleep(config.sleep_s)
        if run.at_eval:
            with run.checkpoint(keep=2) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
    if run.evicted:
        return None
    save_state(output.file("model.safetensors"), model=model)
    return {"final_loss": run.summary()["loss"]}
