"""Sharded states (DCP folders) in one process without a process group: write into a checkpoint, seal, load into a
plain model and optimizer, verified against the manifest (the multi-rank runs are in tests/integration/test_sharded.py).
"""

import json
from pathlib import Path

import pytest
import torch

from gwenlake_hpc import load_state
from gwenlake_hpc.base.errors import DamagedFileError, StateMismatchError
from gwenlake_hpc.stores.checkpoints import MANIFEST, CheckpointStore
from gwenlake_hpc.stores.checkpoints.sharded import is_dcp_folder, save_sharded
from gwenlake_hpc.stores.checkpoints.state import _encode


def _trained(seed=0, hidden=16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _sealed_dcp_checkpoint(tmp_path, model, opt, extra):
    store = CheckpointStore(tmp_path / "checkpoints", "key")
    pending = store.begin(10)
    tensors = {}
    doc = {"format": 1, "structure": _encode({"extra": extra}, "", tensors)}
    path = save_sharded(pending.dir / "state.safetensors", model=model, optimizer=opt, doc=doc, tensors=tensors,
                        pending=pending)
    assert is_dcp_folder(path)
    return pending.commit({"step": 10}), store


def test_dcp_folder_round_trip_into_a_plain_model_without_a_process_group(tmp_path):
    model, opt = _trained()
    extra = {"epoch": 3, "blob": torch.arange(6.0)}
    ck, store = _sealed_dcp_checkpoint(tmp_path, model, opt, extra)
    files = json.loads((ck.path / MANIFEST).read_text())["files"]
    shards = {k: v for k, v in files.items() if k.startswith("state.safetensors/")}
    assert set(shards) == {"state.safetensors/.metadata", "state.safetensors/__0_0.distcp"}
    assert all(v["verify"] == "on_load" and len(v["digest"]) == 32 and v["size"] > 0 for v in shards.values())
    assert store.latest().path == ck.path

    fresh, fresh_opt = _trained(seed=5)
    got = load_state(ck.path / "state.safetensors", model=fresh, optimizer=fresh_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    want, have = opt.state_dict(), fresh_opt.state_dict()
    for i, s in want["state"].items():
        for name, t in s.items():
            assert torch.equal(have["state"][i][name], t), (i, name)
    assert got["epoch"] == 3 and torch.equal(got["blob"], extra["blob"])


def test_a_flipped_byte_in_a_shard_is_a_damaged_file_and_nothing_is_loaded(tmp_path):
    model, opt = _trained()
    ck, store = _sealed_dcp_checkpoint(tmp_path, model, opt, {})
    shard = ck.path / "state.safetensors" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert store.latest().path == ck.path  # same size: only the load hashes it
    fresh, fresh_opt = _trained(seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(DamagedFileError) as info:
        load_state(ck.path / "state.safetensors", model=fresh, optimizer=fresh_opt)
    assert info.value.checkpoint == ck.path and info.value.path == shard
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_shape_that_differs_names_the_tensor_and_both_shapes(tmp_path):
    model, opt = _trained()
    ck, _ = _sealed_dcp_checkpoint(tmp_path, model, opt, {})
    other, _ = _trained(hidden=12)
    with pytest.raises(StateMismatchError, match=r"'model\.0\.weight'.*\[12, 8\].*\[16, 8\]") as info:
        load_state(ck.path / "state.safetensors", model=other)
    assert info.value.exit_code == 2
    assert ck.path.is_dir()  # nothing deleted


def test_each_shard_file_is_hashed_once_however_many_tensors_it_holds(tmp_path, monkeypatch):
    """The benchmark found every rank's one `__<rank>_0.distcp` hashed once per tensor in it (63 times at 256 MiB):
    the loop blocked 11.4 s where dcp.save took 0.67 s."""
    from gwenlake_hpc.stores.checkpoints import sharded

    calls = []
    real = sharded.file_digest
    monkeypatch.setattr(sharded, "file_digest", lambda p, *a: calls.append(Path(p).name) or real(p, *a))

    class Recorder:
        asynchronous = False  # written in the block, as a synchronous checkpoint does

        def __init__(self):
            self.shards = {}
            self.dir = tmp_path
            self.calls = []

        def note_sharded(self, signature):
            self.calls.append(signature)

        def sharded_target(self, path):
            return Path(path)

        def record_shard(self, p, size, digest):
            self.shards[Path(p).name] = (size, digest)

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])  # 12 tensors in one file
    rec = Recorder()
    sharded.save_sharded(tmp_path / "state", model=model, optimizer=None, doc={}, tensors={}, pending=rec)
    assert sorted(calls) == sorted(set(calls)) and sorted(rec.shards) == sorted(calls), calls
    assert "__0_0.distcp" in calls and ".metadata" in calls
    assert rec.calls == ["state (model)"]  # what the Run's vote compares across ranks


def test_an_asynchronous_checkpoint_stages_the_state_and_writes_what_it_was_at_the_block(tmp_path):
    """Asynchronous: save_sharded only starts a host copy (nothing written yet); the optimizer step right after
    it changes the model; the sealed folder holds the state as it was at save_sharded."""
    from gwenlake_hpc.stores.checkpoints import BufferPool

    model, opt = _trained()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    store = CheckpointStore(tmp_path / "checkpoints", "key")
    pool = BufferPool()
    pending = store.begin(10, buffers=pool)
    path = save_sharded(pending.dir / "state.safetensors", model=model, optimizer=opt, doc={}, tensors={},
                        pending=pending)
    assert pending.deferred == 1 and not path.exists()  # staged only: the write is the seal's
    model(torch.randn(5, 8)).sum().backward()
    opt.step()  # waits for the copy (the guard), then changes every weight
    assert not torch.equal(model.state_dict()["0.weight"], at_save["0.weight"])
    ck = pending.commit({"step": 10})
    assert is_dcp_folder(ck.path / "state.safetensors") and pending.deferred == 0
    fresh, fresh_opt = _trained(seed=5)
    load_state(ck.path / "state.safetensors", model=fresh, optimizer=fresh_opt)
    for k, v in at_save.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    pool.close()


def test_an_optimizer_step_waits_for_the_staging_copy_in_flight():
    """The guard: while a staging copy runs (held here by a value whose copy waits for an event), any optimizer's
    step() waits; it goes on once the copy is done."""
    import threading

    from gwenlake_hpc.stores.checkpoints import BufferPool

    release = threading.Event()

    class Slow:
        def __deepcopy__(self, memo):
            release.wait(30)
            return Slow()

    pool = BufferPool()
    model, opt = _trained()
    future = pool.stage({"w": model[0].weight, "slow": Slow()})
    model(torch.randn(5, 8)).sum().backward()
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.5)  # held by the copy in flight
    release.set()
    assert stepped.wait(30) and future.done()
    stepper.join()
    pool.close()


def test_a_shard_the_manifest_does_not_list_is_a_damaged_file_and_nothing_is_loaded(tmp_path):
    """The adversarial pass's checkpoint whose manifest lacked a shard DCP's metadata names (rank 1's shard saved
    under another name): the load said FileNotFoundError on every resume; now the checkpoint counts as damaged
    (set aside by the Run, the resume goes to the previous one)."""
    model, opt = _trained()
    ck, _ = _sealed_dcp_checkpoint(tmp_path, model, opt, {})
    manifest = json.loads((ck.path / MANIFEST).read_text())
    del manifest["files"]["state.safetensors/__0_0.distcp"]
    (ck.path / MANIFEST).write_text(json.dumps(manifest))
    fresh, fresh_opt = _trained(seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(DamagedFileError, match="is not in checkpoint step-000000010's manifest") as info:
        load_state(ck.path / "state.safetensors", model=fresh, optimizer=fresh_opt)
    assert info.value.checkpoint == ck.path
    assert info.value.path == ck.path / "state.safetensors" / "__0_0.distcp"
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_an_optimizer_parameter_outside_the_model_is_refused_with_exit_2_naming_it():
    """get_state_dict keys a sharded model's optimizer state by the model's parameter names: a parameter the model
    does not hold could not be restored, so it is refused before anything is written (issue 41; the 2-rank FSDP1
    run is in tests/integration/test_sharded_fsdp1.py)."""
    from gwenlake_hpc.base.errors import ConfigError
    from gwenlake_hpc.stores.checkpoints.sharded import check_optimizer, is_sharded_model

    model, opt = _trained()
    assert not is_sharded_model(model)
    check_optimizer(model, opt, "save_state")  # the model's own parameters: nothing said
    stray = torch.nn.Parameter(torch.zeros(3, 2))
    opt.add_param_group({"params": [stray]})
    with pytest.raises(ConfigError, match=r"save_state: the optimizer's parameter 0 of group 1 \(shape \[3, 2\]\) "
                                          r"is not a parameter of the model") as info:
        check_optimizer(model, opt, "save_state")
    assert info.value.exit_code == 2
