"""Tests of the data input pipeline: background prefetch of batches (more to come: worker datasets, streaming writes)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gwenlake_hpc.data import Catalog, Dataset
from gwenlake_hpc.errors import ConfigError


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
    # 210 rows, blocks of 7, windows of 3 blocks: ten windows of exactly 21 rows.
    ds = _make(catalog, rows=210)
    reads: list[tuple[int, int]] = []
    real = ds._read_slice

    def counting(col, start, stop, out=None):
        reads.append((start, stop))
        return real(col, start, stop, out)

    monkeypatch.setattr(ds, "_read_slice", counting)
    b = ds.batches(5, columns=["idx"], block_rows=7, buffer_blocks=3, prefetch=True)
    for k in [0, 20, 41]:
        reads.clear()
        it = b.epoch(2, start=k, seed=1)
        first = next(it)
        it.close()  # joins the thread: no read runs after this
        w = (k * 5) // 21
        plan = b._plan(2, 1)
        skipped_rows = {r for blk in plan.order[: w * 3].tolist() for r in range(blk * 7, blk * 7 + 7)}
        read_rows = {r for a, z in reads for r in range(a, z)}
        assert set(first["idx"].tolist()) <= read_rows
        assert not read_rows & skipped_rows, k
        # The window of the batch, plus at most the next one (batch 41 ends in the last window).
        assert 21 <= sum(z - a for a, z in reads) <= 42, k


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
