"""Tests of the data input pipeline: batch prefetch, DataLoader workers, streaming writes and chunked imports."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import pandas as pd
import pytest
import torch

from gwenlake_hpc import Input, Output, train
from gwenlake_hpc.data import Catalog, Dataset, IterableBatches, content_revision
from gwenlake_hpc.base.errors import ConfigError, DataError


@pytest.fixture
def catalog(tmp_path):
    return Catalog(tmp_path / "data")


def _make(catalog: Catalog, name: str = "crm.x", rows: int = 200) -> Dataset:
    idx = np.arange(rows, dtype=np.int64)
    catalog.write(name, {
        "idx": idx,
        "feat": np.stack([idx * 1.0, idx * 2.0], axis=1).astype(np.float32),
        "text": np.array([f"row-{i}" for i in idx]),
    })
    return catalog.open(name)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gwenlake-prefetch")]


def _assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for col in g:
            if isinstance(g[col], torch.Tensor):
                assert g[col].dtype == w[col].dtype and torch.equal(g[col], w[col]), col
            else:
                assert np.array_equal(g[col], w[col]), col


# --------------------------------------------------------------------------- prefetch


@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False)])
def test_prefetch_gives_the_same_batches_and_resume_positions(catalog, shuffle, drop_last):
    ds = _make(catalog, rows=200)
    kw = dict(shuffle=shuffle, drop_last=drop_last, block_rows=7, buffer_blocks=3)
    on, off = ds.batches(5, prefetch=True, **kw), ds.batches(5, prefetch=False, **kw)
    assert (on.prefetch, off.prefetch) == (True, False)
    for epoch, seed in [(0, 0), (3, 11)]:
        full = list(off.epoch(epoch, seed=seed))
        assert len(full) == 40
        _assert_same_batches(list(on.epoch(epoch, seed=seed)), full)
        # Resumes at every batch, including those straddling two windows (window = 21 rows).
        for k in range(0, len(on) + 1, 3):
            _assert_same_batches(list(on.epoch(epoch, start=k, seed=seed)), full[k:])
    assert _prefetch_threads() == []
    ds.close()


def test_prefetch_thread_is_joined_when_done_closed_or_dropped(catalog):
    ds = _make(catalog, rows=210)
    b = ds.batches(5, block_rows=7, buffer_blocks=3, prefetch=True)
    it = b.epoch(0)
    assert _prefetch_threads() == []  # nothing starts before the first batch
    next(it)
    assert len(_prefetch_threads()) == 1
    it.close()
    assert _prefetch_threads() == []
    it = b.epoch(1, start=7)
    next(it)
    del it  # abandoned (run.steps stops taking batches mid-epoch): the generator's finalizer joins the thread
    assert _prefetch_threads() == []
    assert sum(len(x["idx"]) for x in b.epoch(2)) == 210
    assert _prefetch_threads() == []
    ds.close()


def test_prefetch_reads_at_most_one_window_ahead_and_never_the_skipped_ones(catalog, monkeypatch):
    # 210 rows, blocks of 7, windows of 3 blocks: ten windows of exactly 21 rows; batches of 5.
    ds = _make(catalog, rows=210)
    reads: list[tuple[int, int]] = []
    real = ds._read_slice

    def counting(col, start, stop, out=None):
        reads.append((start, stop))
        return real(col, start, stop, out)

    monkeypatch.setattr(ds, "_read_slice", counting)
    b = ds.batches(5, columns=["idx"], block_rows=7, buffer_blocks=3, prefetch=True)
    plan = b._plan(2, 1)

    def window_rows(w: int) -> set[int]:
        return {r for blk in plan.order[w * 3 : (w + 1) * 3].tolist() for r in range(blk * 7, min(blk * 7 + 7, 210))}

    ahead = 5  # ceil(21 / 5) batches: one window of rows
    for k in [0, 20, 38, 41]:
        reads.clear()
        it = b.epoch(2, start=k, seed=1)
        first = next(it)
        it.close()  # joins the thread: no read runs after this
        read_rows = {r for a, z in reads for r in range(a, z)}
        assert sum(z - a for a, z in reads) == len(read_rows)  # no row read twice
        assert set(first["idx"].tolist()) <= read_rows
        # Only the windows of the positions of the batch taken and of the batches made ahead of it.
        first_w, last_w = (k * 5) // 21, (min((k + 1 + ahead) * 5, 210) - 1) // 21
        allowed = set().union(*(window_rows(w) for w in range(first_w, last_w + 1)))
        assert read_rows <= allowed, k
        assert read_rows >= window_rows(first_w), k
        assert not read_rows & set().union(*(window_rows(w) for w in range(first_w))), k  # skipped: never read


def test_prefetch_error_is_raised_in_the_consumer(catalog, monkeypatch):
    ds = _make(catalog, rows=210)
    real = ds._read_slice
    calls = []

    def failing(col, start, stop, out=None):
        calls.append(threading.current_thread().name)
        if len(calls) > 3:  # windows of one block each: the fourth window fails
            raise OSError("disk gone (simulated)")
        return real(col, start, stop, out)

    monkeypatch.setattr(ds, "_read_slice", failing)
    b = ds.batches(7, columns=["idx"], block_rows=7, buffer_blocks=1, shuffle=False, prefetch=True)
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for batch in b.epoch(0):
            got.append(batch["idx"].tolist())
    assert got == [list(range(0, 7)), list(range(7, 14)), list(range(14, 21))]
    assert all(name.startswith("gwenlake-prefetch") for name in calls)  # the reads ran in the thread
    assert _prefetch_threads() == []


def test_prefetch_switch_from_the_environment(catalog, monkeypatch):
    ds = _make(catalog, rows=20)
    monkeypatch.delenv("GWENLAKE_PREFETCH", raising=False)
    assert ds.batches(4).prefetch is True
    monkeypatch.setenv("GWENLAKE_PREFETCH", "0")
    assert ds.batches(4).prefetch is False
    assert ds.batches(4, prefetch=True).prefetch is True  # the argument wins
    monkeypatch.setenv("GWENLAKE_PREFETCH", "off")
    b = ds.batches(4)
    assert b.prefetch is False
    next(b.epoch(0))
    assert _prefetch_threads() == []  # off: read in the calling thread
    monkeypatch.setenv("GWENLAKE_PREFETCH", "maybe")
    with pytest.raises(ConfigError, match="GWENLAKE_PREFETCH='maybe'"):
        ds.batches(4)
    ds.close()


# --------------------------------------------------------------------------- IterableBatches (DataLoader workers)


def test_iterable_batches_pickle_and_shard_over_two_workers(catalog):
    ds = _make(catalog, rows=203)
    stream = IterableBatches(ds, 10, block_rows=7, buffer_blocks=3, seed=4, epoch=1)
    ds.close()  # the stream holds no handle: the file is reopened in each worker
    copy = pickle.loads(pickle.dumps(stream))
    assert (copy.path, copy.name, len(copy)) == (stream.path, "crm.x", 21)
    with Dataset(stream.path) as ref:
        want = list(ref.batches(10, block_rows=7, buffer_blocks=3, prefetch=False).epoch(1, seed=4))
    assert [b["idx"].tolist() for b in stream] == [b["idx"].tolist() for b in want]  # no workers: Batches.epoch

    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    got = list(loader)
    # Worker 0 yields batches 0..9, worker 1 batches 10..20; the loader alternates them.
    order = [0, 10, 1, 11, 2, 12, 3, 13, 4, 14, 5, 15, 6, 16, 7, 17, 8, 18, 9, 19, 20]
    assert [b["idx"].tolist() for b in got] == [want[i]["idx"].tolist() for i in order]
    assert sorted(np.concatenate([b["idx"].numpy() for b in got]).tolist()) == list(range(203))
    assert got[1]["feat"].dtype == torch.float32 and got[1]["feat"].shape == (10, 2)
    assert list(got[1]["text"]) == [f"row-{i}" for i in got[1]["idx"].tolist()]
    stream.set_epoch(2)
    again = [b["idx"].tolist() for b in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)]
    assert again != [b["idx"].tolist() for b in got]  # a new epoch, a new order
    assert sorted(i for b in again for i in b) == list(range(203))


def test_iterable_batches_checks_arguments_in_the_main_process(catalog):
    ds = _make(catalog, rows=20)
    with pytest.raises(DataError, match="nope"):
        IterableBatches(ds, 4, columns=["nope"])
    with pytest.raises(ConfigError, match="batch_size"):
        IterableBatches(ds.path, 0)
    with pytest.raises(ConfigError, match="seed"):
        IterableBatches(ds.path, 4, seed=-1)
    with pytest.raises(ConfigError, match="epoch must be an integer >= 0, got -1"):
        IterableBatches(ds.path, 4).set_epoch(-1)
    ds.close()


@train(data=Input("t.stream"), output=Output("t.stream"), epochs=3, eval_every=4)
def _fit_stream(data, output, run, config):
    """Records (step, epoch, row ids) of each batch of IterableBatches, in a 2-worker DataLoader or directly."""
    stream = IterableBatches(data, 4, block_rows=4, buffer_blocks=2, seed=run.seed)
    seen = []
    batches = stream if config["direct"] else torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    for step, batch in run.steps(batches):
        seen.append((step, run.epoch, batch["idx"].tolist()))
        if run.at_eval:
            with run.checkpoint(keep=1):
                pass
        if step == config["stop_at"]:
            break
    return seen


def test_run_steps_sets_the_epoch_of_iterable_batches_in_dataloader_workers(catalog, tmp_path):
    ds = _make(catalog, "t.stream", rows=24)  # 6 batches of 4 an epoch, 3 epochs
    # With 2 workers, worker 0 yields batches 0-2 of the epoch's order, worker 1 batches 3-5, alternated.
    plan = ds.batches(4, block_rows=4, buffer_blocks=2, prefetch=False)
    want = {e: [b["idx"].tolist() for b in plan.epoch(e, seed=5)] for e in range(3)}
    interleaved = [(1 + e * 6 + i, e, want[e][j]) for e in range(3) for i, j in enumerate([0, 3, 1, 4, 2, 5])]
    full = _fit_stream.local({"stop_at": 0, "direct": False}, seed=5, data=ds)
    assert full == interleaved
    assert len({tuple(map(tuple, want[e])) for e in range(3)}) == 3  # each epoch its own order

    # Stopped after step 9 (epoch 1, batch 3): the resume lands in epoch 1 after the checkpoint of step 8.
    first = _fit_stream.local({"stop_at": 9, "direct": False}, seed=5, data=ds, run_dir=tmp_path / "r")
    second = _fit_stream.local({"stop_at": 0, "direct": False}, seed=5, data=ds, run_dir=tmp_path / "r")
    assert first == full[:9] and second == full[8:]

    # Without a DataLoader, the stream itself is a plain iterable whose epoch run.steps sets.
    direct = _fit_stream.local({"stop_at": 0, "direct": True}, seed=5, data=ds)
    assert direct == [(1 + e * 6 + i, e, want[e][i]) for e in range(3) for i in range(6)]
    ds.close()


# --------------------------------------------------------------------------- streaming writer


def _columns(rows: int, offset: int = 0) -> dict[str, np.ndarray]:
    idx = np.arange(offset, offset + rows, dtype=np.int64)
    return {
        "idx": idx,
        "feat": np.stack([idx * 0.5, -idx * 1.0, idx % 7], axis=1).astype(np.float32),
        "flag": idx % 2 == 0,
        "text": np.array([f"ligne-{i}-é" for i in idx], dtype=object),
    }


def test_writer_in_chunks_gives_the_revision_of_a_whole_write(catalog):
    whole = _columns(1000)
    rev_whole = catalog.write("g.whole", whole, attrs={"origin": "test"})
    assert rev_whole == content_revision(whole)
    with catalog.writer("g.chunks", attrs={"origin": "test"}) as w:
        for a, z in [(0, 1), (1, 1), (1, 400), (400, 999), (999, 1000)]:  # uneven, one empty
            w.append({c: v[a:z] for c, v in whole.items()})
        assert w.rows == 1000 and not catalog.exists("g.chunks")  # not visible before the end
    assert w.revision == rev_whole
    with catalog.open("g.chunks") as ds:
        assert ds.revision == rev_whole and ds.rows == 1000 and ds.attrs == {"origin": "test"}
        assert ds.schema == {"idx": ("<i8", ()), "feat": ("<f4", (3,)), "flag": ("|b1", ()), "text": ("str", ())}
        assert ds._compute_revision() == rev_whole  # recomputed from the stored content
        got = ds.read()
    for col, want in whole.items():
        np.testing.assert_array_equal(got[col], want)
    assert sorted(p.name for p in (catalog.data_root / "g").iterdir()) == ["chunks.h5", "whole.h5"]
    # Changing one value changes the revision.
    changed = {c: v.copy() for c, v in whole.items()}
    changed["feat"][700, 2] = 99
    with catalog.writer("g.changed") as w:
        w.append({c: v[:500] for c, v in changed.items()})
        w.append({c: v[500:] for c, v in changed.items()})
    assert w.revision == content_revision(changed) != rev_whole


def test_writer_failures_publish_nothing_and_keep_the_old_version(catalog):
    old = catalog.write("g.w", {"a": np.arange(3)})
    with pytest.raises(DataError, match=r"column 'idx' is <f8 \[\] instead of <i8 \[\]"):
        with catalog.writer("g.w") as w:
            w.append(_columns(10))
            w.append({**_columns(10, 10), "idx": np.arange(10, 20) * 1.0})
    with pytest.raises(DataError, match=r"columns \['idx', 'feat'\] instead of"):
        with catalog.writer("g.w") as w:
            w.append(_columns(10))
            w.append({c: v for c, v in _columns(10).items() if c in ("idx", "feat")})
    with pytest.raises(RuntimeError, match="boom"):
        with catalog.writer("g.w") as w:
            w.append(_columns(10))
            raise RuntimeError("boom")
    with pytest.raises(DataError, match="at least one column"):
        with catalog.writer("g.w"):
            pass
    with pytest.raises(DataError, match="reserved"):
        catalog.writer("g.w", attrs={"revision": "x"})
    assert sorted(p.name for p in (catalog.data_root / "g").iterdir()) == ["w.h5"]  # no temp file left
    with catalog.open("g.w") as ds:
        assert ds.revision == old and ds.rows == 3
    assert catalog.names() == ["g.w"]


def test_writer_killed_midway_leaves_no_dataset_visible(catalog, tmp_path):
    old = catalog.write("g.k", {"a": np.arange(3)})
    script = tmp_path / "kill.py"
    script.write_text(
        "import os, signal, sys\n"
        "import numpy as np\n"
        "from gwenlake_hpc.data import Catalog\n"
        "w = Catalog(sys.argv[1]).writer('g.k')\n"
        "w.append({'a': np.arange(1000)})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(catalog.data_root)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in (catalog.data_root / "g").iterdir())
    assert len(left) == 2 and left[1] == "k.h5" and left[0].startswith(".k.") and left[0].endswith(".h5.tmp")
    assert catalog.names() == ["g.k"]
    with catalog.open("g.k") as ds:
        assert ds.revision == old and ds.rows == 3


# --------------------------------------------------------------------------- chunked import


def test_chunked_csv_import_widens_across_chunks_and_matches_a_whole_read(catalog, tmp_path):
    src = tmp_path / "t.csv"
    src.write_text(
        "n,code,x,city\n"
        "1,007,1,Paris\n"
        "2,008,2,\n"
        "3,009,2.5,Brest\n"
        ",abc,4,東京\n"      # a missing int and text in the third chunk of two rows
        "5,010,5,a b\n"
    )
    rev = catalog.import_table(src, "g.csv", chunk_rows=2)
    assert catalog.import_table(src, "g.csv1", chunk_rows=1) == rev
    assert catalog.import_table(src, "g.csvall") == rev  # one chunk
    with catalog.open("g.csv") as ds:
        assert ds.schema == {"n": ("<f8", ()), "code": ("str", ()), "x": ("<f8", ()), "city": ("str", ())}
        got = ds.read()
    np.testing.assert_array_equal(got["n"], [1, 2, 3, np.nan, 5])
    assert got["code"].tolist() == ["007", "008", "009", "abc", "010"]  # each cell as written
    np.testing.assert_array_equal(got["x"], [1, 2, 2.5, 4, 5])
    assert got["city"].tolist() == ["Paris", "", "Brest", "東京", "a b"]
    assert rev == content_revision({
        "n": np.array([1, 2, 3, np.nan, 5]), "code": np.array(["007", "008", "009", "abc", "010"]),
        "x": np.array([1, 2, 2.5, 4, 5.0]), "city": np.array(["Paris", "", "Brest", "東京", "a b"]),
    })


def test_chunked_parquet_import_matches_a_whole_read(catalog, tmp_path):
    n = 1000
    frame = pd.DataFrame({
        "id": np.arange(n, dtype=np.int32),
        "score": np.linspace(0, 1, n, dtype=np.float32),
        "maybe": pd.array([None if i == 900 else i for i in range(n)], dtype="Int64"),  # a null in a late chunk
        "name": [f"n{i}" for i in range(n)],
        "ok": [i % 3 == 0 for i in range(n)],
    })
    src = tmp_path / "t.parquet"
    frame.to_parquet(src, index=False, row_group_size=128)
    rev = catalog.import_table(src, "g.pq", chunk_rows=100)
    assert catalog.import_table(src, "g.pqall", chunk_rows=10**6) == rev
    with catalog.open("g.pq") as ds:
        assert ds.schema == {"id": ("<i4", ()), "score": ("<f4", ()), "maybe": ("<f8", ()), "name": ("str", ()),
                             "ok": ("|u1", ())}
        got = ds.read()
    maybe = np.arange(n, dtype=np.float64)
    maybe[900] = np.nan
    np.testing.assert_array_equal(got["maybe"], maybe)
    assert rev == content_revision({
        "id": np.arange(n, dtype=np.int32), "score": np.linspace(0, 1, n, dtype=np.float32), "maybe": maybe,
        "name": np.array([f"n{i}" for i in range(n)]), "ok": (np.arange(n) % 3 == 0).astype(np.uint8),
    })


def test_data_import_command_streams_the_file(catalog, tmp_path):
    src = tmp_path / "t.csv"
    pd.DataFrame({"a": np.arange(10), "b": [f"x{i}" for i in range(10)]}).to_csv(src, index=False)
    from gwenlake_hpc.cli.dispatch import run_subcommand

    assert run_subcommand(["data", "import", str(src), "g.cli", "--data-root", str(catalog.data_root)]) == 0
    with catalog.open("g.cli") as ds:
        assert ds.rows == 10 and ds.read(["b"])["b"].tolist()[-1] == "x9"
        assert ds.revision == content_revision({"a": np.arange(10), "b": np.array([f"x{i}" for i in range(10)])})


def test_importing_the_catalog_does_not_import_torch():
    code = ("import sys, gwenlake_hpc.data as d; assert 'torch' not in sys.modules, 'torch imported'; "
            "d.IterableBatches; assert 'torch' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
