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


# --- a model-only file is the state dict as safetensors itself writes it (issue 21) ----------------------------

class WithView(torch.nn.Module):
    """A buffer that is a partial view of a parameter (shares its storage without being an exact alias)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6))
        self.register_buffer("row", self.w.data[1])


def _tensor_section(path) -> tuple[dict, bytes]:
    """The header's tensor entries (no metadata) and the data bytes of a safetensors file."""
    import json
    import struct

    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return header, raw[8 + n:]


def _sequential():
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2), torch.nn.BatchNorm1d(2))


@pytest.mark.parametrize("make, dropped", [(_sequential, []), (Tied, ["head.weight"]), (WithView, ["row"])],
                         ids=["sequential", "tied", "view"])
def test_a_model_only_file_is_what_safetensors_save_model_writes(tmp_path, make, dropped):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model, save_model

    torch.manual_seed(0)
    model = make()
    path = save_state(tmp_path / "model.safetensors", model=model)
    save_model(model, str(tmp_path / "ref.safetensors"))
    # The same tensor names, dtypes, shapes, offsets and bytes as the library's own save_model, and its metadata
    # (dropped name -> kept name) among ours.
    assert _tensor_section(path) == _tensor_section(tmp_path / "ref.safetensors")
    with safe_open(str(path), "pt") as f, safe_open(str(tmp_path / "ref.safetensors"), "pt") as ref:
        assert (ref.metadata() or {}).items() <= f.metadata().items()
        assert sorted(f.keys()) == sorted(set(model.state_dict()) - set(dropped))

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    plain, by_lib, by_us = make(), make(), make()
    # Any safetensors consumer: only the names safetensors drops as duplicates are missing, and their values
    # arrive through the tensor they share storage with.
    result = plain.load_state_dict(load_file(str(path)), strict=not dropped)
    assert (result.missing_keys, result.unexpected_keys) == (dropped, [])
    load_model(by_lib, str(path))  # strict
    load_state(path, model=by_us)  # strict
    for loaded in (plain, by_lib, by_us):
        got = loaded.state_dict()
        assert list(got) == list(expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
    if make is Tied:
        assert by_us.head.weight is by_us.emb.weight and by_lib.head.weight is by_lib.emb.weight


def test_model_files_of_the_old_prefixed_layout_still_load(tmp_path):
    """A model-only file as gwenlake_hpc wrote it before issue 21: tensors named ``model.<key>``, tied weights as
    an alias (the metadata is the old writer's, byte for byte)."""
    from gwenlake_hpc.stores.checkpoints.tensorfile import write_tensors

    torch.manual_seed(0)
    old = torch.nn.Linear(2, 3)
    emb = torch.randn(3, 2)
    path = tmp_path / "old.safetensors"
    write_tensors(path, {"model.emb.weight": emb, "model.head.bias": old.bias.detach()}, {"gwenlake_state": (
        '{"format": 1, "writer": "gwenlake_hpc 0.1.0", "structure": {"__dict__": [["model", {"__dict__": '
        '[["emb.weight", {"__tensor__": "model.emb.weight"}], ["head.weight", {"__tensor__": "model.head.weight"}], '
        '["head.bias", {"__tensor__": "model.head.bias"}]]}]]}, "aliases": {"model.head.weight": "model.emb.weight"}}')})

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(3, 2)
            self.head = torch.nn.Linear(2, 3)
            self.head.weight = self.emb.weight

    model = Small()
    assert load_state(path, model=model) == {}
    assert torch.equal(model.emb.weight, emb) and torch.equal(model.head.bias, old.bias)
    assert model.head.weight is model.emb.weight


def test_model_with_other_parts_keeps_prefixed_names_and_no_complete_owner_is_stored_whole(tmp_path):
    """model+optimizer (or extra) stays prefixed; views sharing a storage that none covers whole (save_model
    refuses those) are each stored from their own bytes and restored."""
    from safetensors.torch import load_file

    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            whole = torch.arange(8.0)
            self.register_buffer("a", whole[:5])
            self.register_buffer("b", whole[3:])

    model = Halves()
    path = save_state(tmp_path / "h.safetensors", model=model)
    assert sorted(load_file(str(path))) == ["a", "b"]
    back = Halves()
    back.a.zero_(), back.b.zero_()
    load_state(path, model=back)
    assert back.a.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and back.b.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]

    lin = torch.nn.Linear(2, 2)
    both = save_state(tmp_path / "both.safetensors", model=lin, extra={"epoch": 1})
    assert sorted(load_file(str(both))) == ["model.bias", "model.weight"]
