"""One model file from a DCP checkpoint folder, and write_full_model on one process (no process group).

The 2-rank FSDP2 case of write_full_model is tests/integration/test_consolidate.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from gwenlake_hpc import CheckpointError, load_state, save_state
from gwenlake_hpc.stores.checkpoints.consolidate import STATE_METADATA_KEY, consolidate_dcp, write_full_model
from gwenlake_hpc.stores.checkpoints.tensorfile import layout, write_layout


class Net(torch.nn.Module):
    """Tied weights, a buffer of int64, a bfloat16 layer: the cases the file layout orders and drops."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.BatchNorm1d(4)
        self.low = torch.nn.Linear(4, 3).to(torch.bfloat16)


def trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        h = net.norm(net.emb(torch.randint(0, 11, (6,))))
        (net.head(h).sum() + net.low(h.to(torch.bfloat16)).float().sum()).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def dcp_save(state, folder) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_write_full_model_of_a_plain_model_is_the_file_save_state_writes(tmp_path):
    net, _ = trained()
    save_state(tmp_path / "a.safetensors", model=net)
    write_full_model(tmp_path / "b.safetensors", net)
    # Byte for byte: same tensors, order, aliases and gwenlake_state document (the key state.py reads).
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as fh:
        assert STATE_METADATA_KEY in fh.metadata() and fh.metadata()["head.weight"] == "emb.weight"


def test_write_full_model_refuses_what_is_not_a_tensor_and_a_rank_not_in_the_job(tmp_path):
    with pytest.raises(CheckpointError, match="'step'.*not a tensor"):
        write_full_model(tmp_path / "m.safetensors", {"w": torch.ones(2), "step": 3})
    with pytest.raises(CheckpointError, match="rank_writes=1 is not a rank of this job"):
        write_full_model(tmp_path / "m.safetensors", {"w": torch.ones(2)}, rank_writes=1)
    assert not list(tmp_path.iterdir())


def test_consolidate_dcp_gives_the_model_part_of_the_folder(tmp_path):
    net, opt = trained()
    dcp_save({"model": net.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    out = consolidate_dcp(tmp_path / "ck", tmp_path / "model.safetensors")

    expected = net.state_dict()
    got = load_file(str(out))
    assert sorted(got) == sorted(expected)  # DCP stores tied weights under both names
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    fresh = Net()
    load_state(out, model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), expected.values()))
    loose = Net()
    load_model(loose, str(out), strict=False)
    assert torch.equal(loose.low.weight, net.low.weight)


def test_consolidate_dcp_of_a_bare_model_state_dict(tmp_path):
    net, _ = trained()
    state = {k: v for k, v in net.state_dict().items() if k != "head.weight"}
    dcp_save(state, tmp_path / "ck")
    out = consolidate_dcp(tmp_path / "ck", tmp_path / "model.safetensors", prefix=None)
    got = load_file(str(out))
    assert sorted(got) == sorted(state) and all(torch.equal(got[k], v) for k, v in state.items())
    fresh = Net()
    load_model(fresh, str(out))  # strict: head.weight is emb.weight's tied name, as save_model leaves it out
    assert torch.equal(fresh.head.weight, net.emb.weight)


def test_consolidate_dcp_wrong_prefix_names_it_and_the_prefixes_there_are(tmp_path):
    net, opt = trained()
    dcp_save({"model": net.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"no tensor under the prefix 'weights' .*start with: model, optim"):
        consolidate_dcp(tmp_path / "ck", tmp_path / "m.safetensors", prefix="weights")
    with pytest.raises(CheckpointError, match=r"'optim.param_groups.0.lr' is not a tensor"):
        consolidate_dcp(tmp_path / "ck", tmp_path / "m.safetensors", prefix="optim")
    assert not (tmp_path / "m.safetensors").exists()


def test_consolidate_dcp_missing_shard_file_names_the_tensor_and_writes_nothing(tmp_path):
    net, _ = trained()
    dcp_save({"model": net.state_dict()}, tmp_path / "ck")
    for shard in (tmp_path / "ck").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError, match=r"tensor 'model\.\S+' cannot be read"):
        consolidate_dcp(tmp_path / "ck", tmp_path / "m.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no file, no temporary left


def test_consolidate_dcp_of_a_folder_that_is_not_a_dcp_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(CheckpointError, match="no .metadata file"):
        consolidate_dcp(tmp_path / "ck", tmp_path / "m.safetensors")
    (tmp_path / "ck" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=".metadata cannot be read"):
        consolidate_dcp(tmp_path / "ck", tmp_path / "m.safetensors")


def test_write_layout_refuses_a_tensor_of_another_size_and_leaves_no_file(tmp_path):
    lay = layout({"a": torch.empty(3, 2, device="meta"), "b": torch.empty(4, device="meta")})
    with pytest.raises(CheckpointError, match="'a' has 8 bytes, its header says 24"):
        write_layout(tmp_path / "x.safetensors", lay, iter([torch.ones(2)]))
    with pytest.raises(CheckpointError, match="no tensor was given for 'b'"):
        write_layout(tmp_path / "x.safetensors", lay, iter([torch.ones(3, 2)]))
    assert not list(tmp_path.iterdir())
    write_layout(tmp_path / "x.safetensors", lay, iter([torch.ones(3, 2), torch.arange(4.0)]))
    got = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(got["a"], torch.ones(3, 2)) and torch.equal(got["b"], torch.arange(4.0))
