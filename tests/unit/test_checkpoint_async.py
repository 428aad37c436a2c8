"""Streamed state files, asynchronous checkpoints, verification while loading, format versions (in process)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from gwenlake_hpc import CheckpointError, load_state, save_state
from gwenlake_hpc.stores.checkpoints import MANIFEST, CheckpointFormatError, CheckpointStore, DamagedFileError
from gwenlake_hpc.stores.checkpoints import partial as partial_mod
from gwenlake_hpc.stores.checkpoints.tensorfile import read_tensors, write_tensors
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker


def all_kinds():
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    return {
        "f32": torch.randn(3, 4), "f64": torch.randn(2, dtype=torch.float64),
        "bf16": torch.randn(7).to(torch.bfloat16), "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(5), "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([1, 255], dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3), "transposed": base.t(),
        "column": base[:, 1], "f8": torch.randn(4).to(torch.float8_e4m3fn),
    }


def test_streamed_file_is_plain_safetensors_byte_for_byte(tmp_path):
    tensors = {k: v for k, v in all_kinds().items()}
    meta = {"who": "test"}
    size, digest = write_tensors(tmp_path / "a.safetensors", tensors, meta)
    raw = (tmp_path / "a.safetensors").read_bytes()
    assert size == len(raw) and len(digest) == 32
    # The library's own serialiser gives the same bytes: same layout, same header.
    ref = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)
    assert json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]) == \
        json.loads(ref[8:8 + int.from_bytes(ref[:8], "little")])
    assert raw[8 + int.from_bytes(raw[:8], "little"):] == ref[8 + int.from_bytes(ref[:8], "little"):]
    loaded = load_file(str(tmp_path / "a.safetensors"))
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as fh:
        assert fh.metadata() == meta
    ours, our_meta = read_tensors(tmp_path / "a.safetensors")
    assert our_meta == meta
    for k, v in tensors.items():
        for got in (loaded[k], ours[k]):
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(got.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got,
                               v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


def test_reader_refuses_truncated_and_foreign_files(tmp_path):
    write_tensors(tmp_path / "a.safetensors", {"w": torch.ones(1000)})
    raw = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_tensors(tmp_path / "t.safetensors")
    (tmp_path / "n.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="impossible header length"):
        read_tensors(tmp_path / "n.safetensors")


def make_run(tmp_path, **kw):
    return Run(run_dir=tmp_path / "run", run_key="k", steps=kw.pop("steps", 50), epochs=None,
               eval_every=kw.pop("eval_every", 10), seed=0, tracker=NullTracker(), stop=StopRequest(),
               progress="off", **kw)


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_snapshot_holds_the_values_of_the_block_not_later_ones(tmp_path):
    run = make_run(tmp_path)
    assert run.checkpoint_async
    model, opt = model_and_opt()
    before = model.weight.detach().clone()
    for step, _ in run.steps():
        if step == 10:
            with run.checkpoint() as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
                assert not ck.path("state.safetensors").exists()  # only a snapshot so far
            with torch.no_grad():
                model.weight.add_(1.0)  # the next step changes the model at once
            ck_path = run.wait_for_checkpoint().path
            break
    after = torch.nn.Linear(64, 32)
    load_state(ck_path / "state.safetensors", model=after)
    assert torch.equal(after.weight, before)
    assert not torch.equal(after.weight, model.weight)
    manifest = json.loads((ck_path / MANIFEST).read_text())
    assert manifest["format"] == 2 and manifest["digest"] == "xxh3_128"
    assert manifest["files"]["state.safetensors"]["verify"] == "on_load"


def test_one_in_flight_and_buffers_reused(tmp_path, monkeypatch):
    gate = threading.Event()
    sealing = threading.Event()
    original = partial_mod.PendingCheckpoint.seal

    def slow_seal(self):
        sealing.set()
        assert gate.wait(60)
        return original(self)

    monkeypatch.setattr(partial_mod.PendingCheckpoint, "seal", slow_seal)
    run = make_run(tmp_path, steps=40)
    model, opt = model_and_opt()
    pointers = []
    second_entered = threading.Event()

    def train():
        for step, _ in run.steps():
            if run.at_eval:
                if step == 20:
                    second_entered.set()
                with run.checkpoint(keep=2) as ck:
                    save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
                pointers.append(run._checkpoints.buffers.buffers[0]._buf.data_ptr())

    t = threading.Thread(target=train)
    t.start()
    assert sealing.wait(60) and second_entered.wait(60)
    t.join(0.5)
    # Step 10's seal is held: the checkpoint of step 20 waits for it (one in flight), nothing else is sealed.
    assert t.is_alive() and len(pointers) == 1
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*"))
    gate.set()
    t.join(120)
    assert not t.is_alive()
    steps = [ck.step for ck in run.store.complete()]
    assert steps == [30, 40]  # keep=2, applied by the writer after each seal
    assert len(set(pointers)) == 1 and run._checkpoints.buffers.buffers[0].allocations == 1


def test_failed_background_write_fails_the_loop_and_keeps_the_previous(tmp_path, monkeypatch):
    run = make_run(tmp_path, steps=40)
    model, opt = model_and_opt()
    original = partial_mod.PendingCheckpoint._seal

    def failing(self):
        if self.step == 20:
            raise OSError(28, "No space left on device", str(self.dir / "state.safetensors"))
        return original(self)

    monkeypatch.setattr(partial_mod.PendingCheckpoint, "_seal", failing)
    with pytest.raises(CheckpointError) as err:
        for step, _ in run.steps():
            if run.at_eval:
                with run.checkpoint() as ck:
                    save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
    msg = str(err.value)
    assert "step 20" in msg and "errno 28" in msg and "state.safetensors" in msg and "step-000000010" in msg
    # raised at a step boundary after the failed write (the one right after step 20 when the background thread
    # failed first, a later one otherwise), at the next checkpoint (30) at the latest
    assert 20 <= run.step <= 30
    assert [ck.step for ck in run.store.complete()] == [10]
    assert not list((tmp_path / "run" / "checkpoints").glob(".partial-*"))


def test_sync_setting_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GWENLAKE_CHECKPOINT_ASYNC", "0")
    run = make_run(tmp_path, steps=10)
    assert not run.checkpoint_async
    model, opt = model_and_opt()
    for step, _ in run.steps():
        if run.at_eval:
            with run.checkpoint() as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
                assert ck.path("state.safetensors").stat().st_size > 64 * 32 * 4  # written inside the block
            assert run.latest_checkpoint.step == 10  # sealed before the block returned
    monkeypatch.setenv("GWENLAKE_CHECKPOINT_ASYNC", "maybe")
    with pytest.raises(Exception, match="GWENLAKE_CHECKPOINT_ASYNC='maybe'"):
        make_run(tmp_path / "other")


def write_checkpoints(tmp_path, steps=(10, 20)):
    run = make_run(tmp_path, steps=max(steps), eval_every=10)
    model, opt = model_and_opt()
    for step, _ in run.steps():
        with torch.no_grad():
            model.weight.add_(0.01)
        if step in steps:
            with run.checkpoint() as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
    return run.store


def test_digest_is_checked_while_loading_not_up_front(tmp_path):
    store = write_checkpoints(tmp_path)
    newest = store.latest()
    assert newest.step == 20
    f = newest.path / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit pattern in the data, size unchanged
    f.write_bytes(bytes(raw))
    assert store.latest().step == 20  # only sizes are checked up front for save_state's files
    with pytest.raises(DamagedFileError) as err:
        load_state(f, model=torch.nn.Linear(64, 32))
    assert err.value.checkpoint == newest.path and "xxh3_128" in str(err.value)
    # A file of another kind is still hashed in full up front.
    (store.latest().path / "gwenlake-run-state.json").write_text("{}")
    assert store.latest().step == 10


def test_newer_format_is_refused_with_its_writer(tmp_path):
    store = write_checkpoints(tmp_path, steps=(10,))
    ck = store.latest()
    state_file = ck.path / "state.safetensors"
    tensors, meta = read_tensors(state_file)
    doc = json.loads(meta["gwenlake_state"])
    doc.update(format=7, writer="gwenlake_hpc 9.9")
    other = tmp_path / "newer.safetensors"
    write_tensors(other, tensors, {"gwenlake_state": json.dumps(doc)})
    with pytest.raises(CheckpointFormatError, match="format 7, written by gwenlake_hpc 9.9") as err:
        load_state(other, model=torch.nn.Linear(64, 32))
    assert err.value.exit_code == 2
    manifest = json.loads((ck.path / MANIFEST).read_text())
    manifest.update(format=3, writer="gwenlake_hpc 9.9")
    (ck.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFormatError, match="reads formats up to 2"):
        CheckpointStore(ck.path.parent, "k").latest()


def test_format_1_manifest_with_sha256_still_loads(tmp_path):
    import hashlib

    store = write_checkpoints(tmp_path, steps=(10,))
    ck = store.latest()
    manifest = json.loads((ck.path / MANIFEST).read_text())
    files = {rel: {"size": info["size"], "sha256": hashlib.sha256((ck.path / rel).read_bytes()).hexdigest()}
             for rel, info in manifest["files"].items()}
    (ck.path / MANIFEST).write_text(json.dumps({"format": 1, "run_key": "k", "step": 10, "created": 0,
                                                "files": files, "metrics": {}}))
    assert store.latest().step == 10
    model = torch.nn.Linear(64, 32)
    load_state(ck.path / "state.safetensors", model=model)  # verified with sha256 while read
    (ck.path / "state.safetensors").write_bytes(b"\0" * files["state.safetensors"]["size"])
    assert store.latest() is None  # format 1 files are all hashed up front


def test_a_swallowed_write_error_still_fails_the_loop(tmp_path, monkeypatch):
    run = make_run(tmp_path, steps=60)
    model, opt = model_and_opt()
    original = partial_mod.PendingCheckpoint._seal

    def failing(self):
        if self.step == 20:
            raise OSError(27, "File too large", str(self.dir / "state.safetensors"))
        return original(self)

    monkeypatch.setattr(partial_mod.PendingCheckpoint, "_seal", failing)
    swallowed = []
    with pytest.raises(CheckpointError, match="step 20 could not be written"):
        for step, _ in run.steps():
            if run.at_eval:
                try:  # a user who hides checkpoint errors: the loop itself still fails
                    with run.checkpoint() as ck:
                        save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
                except CheckpointError as exc:
                    swallowed.append((step, str(exc)))
    assert run.step <= 31 and [ck.step for ck in run.store.complete()] == [10]


def test_old_checkpoint_that_cannot_be_deleted_is_only_a_warning(tmp_path, monkeypatch, caplog):
    run = make_run(tmp_path, steps=30)
    model, opt = model_and_opt()

    def stuck(*a, **k):
        raise PermissionError(1, "Operation not permitted", "step-000000010")

    monkeypatch.setattr(run.store, "retain", stuck)
    for step, _ in run.steps():
        if run.at_eval:
            with run.checkpoint(keep=1) as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
    assert run.latest_checkpoint.step == 30
    assert any("could not be deleted (keep=1)" in r.getMessage() for r in caplog.records)


def test_misuse_of_checkpoint_blocks_is_refused_clearly(tmp_path):
    run = make_run(tmp_path, steps=20)
    model, _ = model_and_opt()
    for step, _ in run.steps():
        if step == 10:
            with run.checkpoint() as ck:
                kept = ck.path("s.safetensors")
                save_state(kept, model=model)
                with pytest.raises(Exception, match="cannot be nested"):
                    with run.checkpoint():
                        pass
            with pytest.raises(Exception, match="after its `with run.checkpoint\\(\\)` block ended"):
                ck.path("late.bin")
            with pytest.raises(Exception, match="block has ended"):
                save_state(kept, model=model)
            with pytest.raises(Exception, match="already called at step 10"):
                with run.checkpoint():
                    pass
    ck = run.store.latest()
    assert ck.step == 10 and run.store.verify(ck, full=True) is None


def test_names_that_collide_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'extra.x.y'"):
        save_state(tmp_path / "a.safetensors", extra={"x.y": torch.ones(2), "x": {"y": torch.zeros(2)}})
    with pytest.raises(CheckpointError, match="'extra.d.0'"):
        save_state(tmp_path / "b.safetensors", extra={"d": {0: torch.ones(2), "0": torch.zeros(2)}})


def test_unknown_digest_algorithm_is_a_format_error(tmp_path):
    store = write_checkpoints(tmp_path, steps=(10,))
    ck = store.latest()
    manifest = json.loads((ck.path / MANIFEST).read_text())
    manifest["digest"] = "blake9"
    (ck.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFormatError, match="'blake9' is unknown") as err:
        store.latest()
    assert err.value.exit_code == 2
    manifest["files"] = None  # a hand-edited manifest that is not one: not a checkpoint
    (ck.path / MANIFEST).write_text(json.dumps(manifest))
    assert store.complete() == []


# -- host buffers allocated ahead of the first checkpoint, off the loop -----------------------------------------
def _train_counting_allocations(run, monkeypatch, prepare=False, steps_done=None):
    """Train ``run`` (Linear + Adam, a checkpoint every 10 steps); returns ([allocations inside each block],
    [names of the threads that allocated outside the blocks])."""
    from gwenlake_hpc.stores.checkpoints.tensorfile import HostBuffer

    inside, outside = [], []
    reserve = HostBuffer.reserve

    def counting(self, nbytes, pinned):
        before = self.allocations
        out = reserve(self, nbytes, pinned)
        if self.allocations != before:
            # The loop's own thread, in a block, is what blocks the training (a reservation still running when
            # a block begins is waited for there, but allocates in its own thread).
            if run._checkpoints._in_block and threading.current_thread() is threading.main_thread():
                inside[-1] += 1
            else:
                outside.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(HostBuffer, "reserve", counting)
    model, opt = model_and_opt()
    if run.resumed:
        load_state(run.resume_path / "state.safetensors", model=model, optimizer=opt)
    if prepare:
        run.prepare_checkpoint(model=model, optimizer=opt)  # before the loop: Adam has no state yet
    for step, _ in run.steps():
        opt.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        if run.at_eval:
            inside.append(0)
            with run.checkpoint() as ck:
                save_state(ck.path("state.safetensors"), model=model, optimizer=opt)
        if step == steps_done:
            break
    run.wait_for_checkpoint()
    return inside, outside


def test_prepare_checkpoint_allocates_the_first_buffer_in_the_background(tmp_path, monkeypatch):
    run = make_run(tmp_path, steps=40)
    inside, outside = _train_counting_allocations(run, monkeypatch, prepare=True)
    assert inside == [0, 0, 0, 0]  # not even the first checkpoint allocates in its block
    assert outside == ["gwenlake-host-buffers"]  # once, sized after the first step (Adam's state included)
    ck = run.latest_checkpoint
    size = (ck.path / "state.safetensors").stat().st_size
    assert run._checkpoints.buffers.buffers[0]._buf.numel() == size


def test_without_prepare_only_the_first_checkpoint_allocates_and_a_resume_sizes_it_from_the_checkpoint(
        tmp_path, monkeypatch):
    run = make_run(tmp_path, steps=40)
    inside, outside = _train_counting_allocations(run, monkeypatch, steps_done=25)
    assert inside == [1, 0] and outside == []  # a fresh run: the first block allocates, later ones never
    resumed = make_run(tmp_path, steps=40)
    assert resumed.start_step == 20
    inside, outside = _train_counting_allocations(resumed, monkeypatch)
    assert inside == [0, 0] and outside == ["gwenlake-host-buffers"]  # sized by step 20's state file
    before = load_file(str(resumed.latest_checkpoint.path / "state.safetensors"))
    assert before  # the snapshot written through the reserved buffer is a readable file


def test_a_synchronous_run_reserves_nothing(tmp_path, monkeypatch):
    run = make_run(tmp_path, steps=20, checkpoint_async=False)
    inside, outside = _train_counting_allocations(run, monkeypatch, prepare=True)
    assert inside == [0, 0] and outside == [] and run._checkpoints.buffers.buffers == []
