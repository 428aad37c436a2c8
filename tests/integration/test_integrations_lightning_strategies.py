"""Issue 41's Lightning inputs in real processes: tests/project/lightning_mp_hooks.py (a tiny module, FSDP2 in
``configure_model`` under ``ModelParallelStrategy()`` on 2 gloo ranks, a plain ``DataLoader(shuffle=True)``,
validation every 5 steps, the user's ``ModelCheckpoint(monitor="val_loss", save_top_k=2, dirpath=...)``), job
steps=40, eval_every=10; and the distributed checkpoint folder's verification in one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning")

from helpers.integrations import history  # noqa: E402
from helpers.project import TESTS, git, make_test_project  # noqa: E402
from helpers.ranks import launch, model_of, version_in  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "t.model"


def _project(root: Path):
    p = make_test_project(root)
    shutil.copy(TESTS / "project" / "lightning_mp_hooks.py", root / "pl_mp.py")
    (root / "conf" / "job" / "plmp.yaml").write_text("target: pl_mp:fit\nsteps: 40\neval_every: 10\nseed: 0\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "lightning")
    return p


def _text(results):
    return "\n=====\n".join(so[-3000:] + se[-5000:] for _, so, se in results)


def _named(p: Path) -> list[tuple[int, float]]:
    """(step, score) of the model's named checkpoints."""
    out = []
    for info in (p / "runs" / MODEL / "named").glob("*/checkpoint.json"):
        meta = json.loads(info.read_text())["metadata"]
        assert meta["monitor"] == "val_loss"
        out.append((meta["step"], round(meta["score"], 6)))
    return sorted(out)


def test_model_parallel_sigterm_rerun_equals_the_uninterrupted_run(tmp_path):
    """Items 1-4 in one training: the SIGTERM during step 17 ends both ranks after step 17 (not 18), whose
    distributed checkpoint folder holds both ranks' shards, recorded with their digests; the rerun resumes from
    that folder (old code: exit 2, "holds no lightning.ckpt"), the plain DataLoader goes on in the interrupted
    epoch's order from its batch 18 (old code: epoch again from its start), and the weights, every step's loss,
    the scheduled validations, the ModelCheckpoint's best-2 files and its named checkpoints equal the
    uninterrupted run's."""
    straight = _project(tmp_path / "straight")
    ref = launch(straight, "+job=plmp", env={"GWL_TEST_PL_BEST": str(straight.root / "best")}, timeout=900)
    assert [r[0] for r in ref] == [0, 0], _text(ref)

    p = _project(tmp_path / "p")
    env = {"GWL_TEST_PL_BEST": str(p.root / "best")}
    first = launch(p, "+job=plmp", env={**env, "GWL_TEST_SIGTERM_AT": "17"}, timeout=900)
    assert [r[0] for r in first] == [75, 75], _text(first)
    assert all("loop ended after step 17" in so + se for _, so, se in first), _text(first)
    (run_dir,) = (p.root / "runs" / MODEL).glob("fit-*")
    assert sorted(c.name for c in (run_dir / "checkpoints").glob("step-*")) == ["step-000000010", "step-000000017"]
    ck = run_dir / "checkpoints" / "step-000000017"
    files = json.loads((ck / "MANIFEST.json").read_text())["files"]
    for rank in (0, 1):
        entry = files[f"lightning.ckpt/__{rank}_0.distcp"]
        assert entry["verify"] == "on_load" and len(entry["digest"]) == 32
        assert (ck / f"lightning.ckpt/__{rank}_0.distcp").stat().st_size == entry["size"]
    assert {"lightning.ckpt/.metadata", "lightning.ckpt/meta.pt"} <= set(files)
    # the scheduled validations only: none at the eviction's step (the old code validated at step 18)
    assert sorted(history(p, MODEL, "val_loss")) == [5, 10, 15]

    last = launch(p, "+job=plmp", env=env, timeout=900)
    assert [r[0] for r in last] == [0, 0], _text(last)
    assert all("resuming from step 17" in so + se for _, so, se in last), _text(last)

    a, b = model_of(straight, version_in(ref[0][1])), model_of(p, version_in(last[0][1]))
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = history(p, MODEL, "loss")
    assert sorted(losses) == list(range(1, 41))
    assert losses == history(straight, MODEL, "loss")
    vals = history(p, MODEL, "val_loss")
    assert sorted(vals) == list(range(5, 41, 5)) and vals == history(straight, MODEL, "val_loss")
    # the ModelCheckpoint: its best 2 by val_loss in its dirpath and as named checkpoints with the score
    best = sorted(f.name for f in (p.root / "best").iterdir())
    assert best == sorted(f.name for f in (straight.root / "best").iterdir()) and len(best) == 2, best
    two_best = sorted(sorted(vals.items(), key=lambda kv: kv[1])[:2])
    assert _named(p.root) == [(s, round(v, 6)) for s, v in two_best] == _named(straight.root)


def _fake_run(tmp_path: Path):
    """A sealed checkpoint whose ``lightning.ckpt`` folder has the layout FSDPStrategy(state_dict_type="sharded")
    and ModelParallelStrategy write (``.metadata``, ``__0_0.distcp``, ``meta.pt``), through the run's own store."""
    from gwenlake_hpc.integrations.lightning_ckpt import record_folder
    from gwenlake_hpc.runtime.run_checkpoints import CheckpointWriter
    from gwenlake_hpc.stores.checkpoints import CheckpointStore

    store = CheckpointStore(tmp_path / "checkpoints", "run-key")
    pending = store.begin(7)
    folder = pending.path("lightning.ckpt/.metadata").parent
    (folder / ".metadata").write_bytes(b"m" * 100)
    (folder / "__0_0.distcp").write_bytes(b"s" * 1000)
    (folder / "meta.pt").write_bytes(b"p" * 10)
    record_folder(CheckpointWriter(pending), folder, 0)
    sealed = pending.commit({"step": 7})
    dist = SimpleNamespace(enabled=False)
    return SimpleNamespace(resume_path=sealed.path, rank=0, world_size=1, dist=dist), sealed


def test_a_sharded_checkpoint_folder_is_recorded_and_verified_before_lightning_reads_it(tmp_path):
    """FSDPStrategy(state_dict_type="sharded") cannot run on the CPU (Lightning refuses strategy="fsdp" there):
    its folder's path, with a folder of the same layout. The shard is recorded with its digest (verify on_load)
    and checked before the load; a flipped byte or a file added after the seal is a DamagedFileError naming it."""
    from gwenlake_hpc.base.errors import DamagedFileError
    from gwenlake_hpc.integrations.lightning_ckpt import verify_folder

    run, sealed = _fake_run(tmp_path)
    entry = sealed.manifest["files"]["lightning.ckpt/__0_0.distcp"]
    assert entry["verify"] == "on_load" and entry["size"] == 1000
    folder = sealed.path / "lightning.ckpt"
    verify_folder(run, folder)  # intact
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[500] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match="__0_0.distcp does not match"):
        verify_folder(run, folder)
    data[500] ^= 1
    shard.write_bytes(bytes(data))
    (folder / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(DamagedFileError, match="not in"):
        verify_folder(run, folder)


def test_a_plain_random_sampler_with_a_worker_resumes_in_its_order(tmp_path):
    """Item 4 in one process: ``DataLoader(shuffle=True, num_workers=1)`` keeps its ``RandomSampler`` (its seed
    drawn from the global RNG at each epoch); SIGTERM during step 37, mid-epoch 1 (25 batches an epoch). The
    rerun draws epoch 1's order from the RNG states recorded at its start and skips its 12 trained batches as
    index lists: the weights and every step's loss equal the uninterrupted run's (old code: the epoch again from
    its first batch, in another order)."""
    env = {"GWL_TEST_PL_STRATEGY": "single", "GWL_TEST_PL_WORKERS": "1"}
    straight = _project(tmp_path / "straight")
    ref = straight.run("+job=plmp", env=env, check=0, timeout=600)
    p = _project(tmp_path / "p")
    first = p.run("+job=plmp", env={**env, "GWL_TEST_SIGTERM_AT": "37"}, check=75, timeout=600)
    assert "loop ended after step 37" in first.stdout + first.stderr, first.stderr
    last = p.run("+job=plmp", env=env, check=0, timeout=600)
    assert "resuming from step 37" in last.stdout + last.stderr, last.stderr
    a, b = model_of(straight, version_in(ref.stdout)), model_of(p, version_in(last.stdout))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = history(p, MODEL, "loss")
    assert sorted(losses) == list(range(1, 41)) and losses == history(straight, MODEL, "loss")
