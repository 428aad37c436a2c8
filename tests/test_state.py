"""save_state / load_state: exact round trips of what safetensors refuses on its own."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gwenlake_hpc import CheckpointError, load_state, save_state


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied weights share storage


def _train_a_bit(model, opt, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        loss = model.head(model.emb(torch.randint(0, 7, (5,)))).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_tied_model_optimizer_scheduler_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    _train_a_bit(model, opt)
    sched.step()
    path = save_state(tmp_path / "s.safetensors", model=model, optimizer=opt, scheduler=sched,
                      extra={"epoch": 3, "best": 0.25, "nan": float("nan"), "pair": (1, "a"), "ids": np.arange(4)})

    torch.manual_seed(99)
    model2 = Tied()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=9, gamma=0.1)
    extra = load_state(path, model=model2, optimizer=opt2, scheduler=sched2)

    assert torch.equal(model2.emb.weight, model.emb.weight)
    assert model2.head.weight is model2.emb.weight  # still tied after loading
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    assert isinstance(sd2["param_groups"][0]["betas"], tuple)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(sd2["state"][0][k], sd["state"][0][k])
    assert sched2.state_dict() == sched.state_dict()
    assert extra["epoch"] == 3 and extra["best"] == 0.25 and math.isnan(extra["nan"])
    assert extra["pair"] == (1, "a")
    np.testing.assert_array_equal(extra["ids"], np.arange(4))

    # Continuing both gives bit-identical weights: the optimizer state is exact.
    _train_a_bit(model, opt, 2)
    _train_a_bit(model2, opt2, 2)
    assert torch.equal(model.emb.weight, model2.emb.weight)


def test_refuses_values_it_cannot_restore(tmp_path):
    with pytest.raises(CheckpointError, match="extra.bad"):
        save_state(tmp_path / "x.safetensors", extra={"bad": object()})
    assert not (tmp_path / "x.safetensors").exists()


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state(tmp_path / "missing.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(CheckpointError, match="not written by gwenlake_hpc.save_state"):
        load_state(foreign)
    only_model = save_state(tmp_path / "m.safetensors", model=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_state(only_model, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
