"""Tests of gwenlake_hpc.data on real HDF5/CSV/Parquet files in tmp_path."""

from __future__ import annotations

import json
import logging

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from gwenlake_hpc.data import (
    Catalog,
    Dataset,
    content_revision,
    dataset_path,
    import_table,
)
from gwenlake_hpc.base.errors import ConfigError, DataError


def _idx_order(batches: list[dict]) -> np.ndarray:
    return np.concatenate([b["idx"].numpy() for b in batches]) if batches else np.zeros(0, np.int64)


def _assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for col in g:
            if isinstance(g[col], torch.Tensor):
                assert torch.equal(g[col], w[col]), col
            else:
                assert np.array_equal(g[col], w[col]), col


@pytest.fixture
def catalog(tmp_path):
    return Catalog(tmp_path / "data")


def _make(catalog: Catalog, name: str = "crm.x", rows: int = 200) -> Dataset:
    idx = np.arange(rows, dtype=np.int64)
    catalog.write(
        name,
        {
            "idx": idx,
            "feat": np.stack([idx * 1.0, idx * 2.0], axis=1).astype(np.float32),
            "label": (idx % 3).astype(np.uint8),
            "text": np.array([f"row-{i}" for i in idx]),
        },
    )
    return catalog.open(name)


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["crm.churn-train", "a.b", "A1.x_y-z", "0.9", "grp.Name_2"])
def test_good_names_resolve_under_group_dir(tmp_path, name):
    group, short = name.split(".")
    assert dataset_path(tmp_path, name) == tmp_path / group / f"{short}.h5"


@pytest.mark.parametrize(
    "name", ["../x", "a/b.c", "a.b.c", "a.", ".a", "", "a", "a..b", "-a.b", "a._b", "a b.c", "a.b/c", "..", "a.b.h5"]
)
def test_bad_names_rejected(tmp_path, name):
    with pytest.raises(DataError) as err:
        dataset_path(tmp_path, name)
    assert repr(name) in str(err.value)
    assert "group.name" in str(err.value)


def test_bad_name_rejected_by_catalog_and_write(catalog):
    with pytest.raises(DataError, match="group.name"):
        catalog.open("../etc.passwd")
    with pytest.raises(DataError, match="group.name"):
        catalog.write("a.b.c", {"x": np.arange(3)})
    assert not catalog.data_root.exists()


# --------------------------------------------------------------------------- write / open


def test_write_then_open(catalog):
    feat = np.arange(20, dtype=np.float32).reshape(10, 2)
    rev = catalog.write(
        "crm.churn-train",
        {"idx": np.arange(10), "feat": feat, "name": np.array(["é", "日本", "", "x"] * 2 + ["a", "b"])},
        attrs={"origin": "unit test"},
    )
    assert catalog.exists("crm.churn-train")
    assert not catalog.exists("crm.other")
    assert catalog.names() == ["crm.churn-train"]
    with catalog.open("crm.churn-train") as ds:
        assert ds.name == "crm.churn-train"
        assert ds.path == catalog.data_root / "crm" / "churn-train.h5"
        assert ds.rows == 10 and len(ds) == 10
        assert ds.columns == ["idx", "feat", "name"]
        assert ds.revision == rev
        assert len(rev) == 64 and int(rev, 16) >= 0
        assert ds.attrs == {"origin": "unit test"}
        assert ds.schema == {"idx": ("<i8", ()), "feat": ("<f4", (2,)), "name": ("str", ())}
        data = ds.read()
        np.testing.assert_array_equal(data["idx"], np.arange(10))
        np.testing.assert_array_equal(data["feat"], feat)
        assert data["name"].tolist() == ["é", "日本", "", "x"] * 2 + ["a", "b"]
        part = ds.read(columns=["feat"], start=3, stop=5)
        assert list(part) == ["feat"]
        np.testing.assert_array_equal(part["feat"], feat[3:5])
        np.testing.assert_array_equal(ds.read(["idx"], start=8, stop=100)["idx"], [8, 9])
        np.testing.assert_array_equal(ds.read(["idx"], start=-2)["idx"], [8, 9])
        with h5py.File(ds.path, "r", locking=False) as f:  # same flag as the open Dataset
            assert f.attrs["gwenlake_format"] == 1
            assert json.loads(f.attrs["columns"]) == ["idx", "feat", "name"]
            assert h5py.check_string_dtype(f["name"].dtype).encoding == "utf-8"
    # Closed by the context manager.
    with pytest.raises(Exception):
        ds.read(["idx"])


def test_revision_deterministic_and_content_sensitive(catalog):
    cols = {"a": np.arange(50, dtype=np.int64), "s": np.array([f"v{i}" for i in range(50)])}
    r1 = catalog.write("g.one", cols)
    r2 = catalog.write("g.two", {k: v.copy() for k, v in cols.items()})
    assert r1 == r2 == content_revision(cols)
    # Rewriting the same name gives the same revision.
    assert catalog.write("g.one", cols) == r1

    changed = {"a": cols["a"].copy(), "s": cols["s"].copy()}
    changed["a"][17] = -1
    assert content_revision(changed) != r1
    changed_s = {"a": cols["a"], "s": cols["s"].copy()}
    changed_s["s"][3] = "v3 "
    assert content_revision(changed_s) != r1
    # Dtype, column order and column name are part of the content.
    assert content_revision({"a": cols["a"].astype(np.int32), "s": cols["s"]}) != r1
    assert content_revision({"s": cols["s"], "a": cols["a"]}) != r1
    assert content_revision({"b": cols["a"], "s": cols["s"]}) != r1
    # Byte order is normalized: a big-endian array hashes like its little-endian twin.
    assert content_revision({"a": cols["a"].astype(">i8"), "s": cols["s"]}) == r1
    # String framing: ["ab", "c"] and ["a", "bc"] differ.
    assert content_revision({"s": np.array(["ab", "c"])}) != content_revision({"s": np.array(["a", "bc"])})


def test_missing_revision_attr_is_computed_with_warning(tmp_path, caplog):
    cols = {"a": np.arange(10, dtype=np.int64), "f": np.ones((10, 3), np.float64), "s": np.array(list("abcdefghij"))}
    path = tmp_path / "raw" / "x.h5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        f["a"] = cols["a"]
        f["f"] = cols["f"]
        f.create_dataset("s", data=cols["s"].astype(object), dtype=h5py.string_dtype("utf-8"))
        f.attrs["columns"] = json.dumps(["a", "f", "s"])
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.data"):
        ds = Dataset(path)
    assert ds.name == "raw.x"
    assert ds.revision == content_revision(cols)
    assert any("revision" in r.getMessage() for r in caplog.records)
    ds.close()


def test_write_is_atomic_and_leaves_no_temp_files(catalog, monkeypatch):
    old = catalog.write("g.atomic", {"a": np.arange(5)})
    real = h5py.Group.create_dataset
    calls = []

    def failing(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", failing)
    with pytest.raises(OSError, match="disk full"):
        catalog.write("g.atomic", {"a": np.arange(7), "b": np.arange(7)})
    monkeypatch.undo()
    # The old file is intact and no temp file is left behind.
    assert sorted(p.name for p in (catalog.data_root / "g").iterdir()) == ["atomic.h5"]
    with catalog.open("g.atomic") as ds:
        assert ds.revision == old and ds.rows == 5


def test_write_rejects_ragged_and_bad_columns(catalog):
    with pytest.raises(DataError) as err:
        catalog.write("g.r", {"a": np.arange(100), "b": np.arange(99)})
    msg = str(err.value)
    assert "'a': 100" in msg and "'b': 99" in msg
    with pytest.raises(DataError, match="at least one column"):
        catalog.write("g.r", {})
    with pytest.raises(DataError, match="'o'.*NoneType"):
        catalog.write("g.r", {"o": np.array(["x", None], dtype=object)})
    with pytest.raises(DataError, match="'t'.*datetime64"):
        catalog.write("g.r", {"t": np.array(["2024-01-01"], dtype="datetime64[D]")})
    with pytest.raises(DataError, match="scalar"):
        catalog.write("g.r", {"a": np.int64(3)})
    with pytest.raises(DataError, match="column name"):
        catalog.write("g.r", {"a/b": np.arange(3)})
    with pytest.raises(DataError, match="reserved"):
        catalog.write("g.r", {"a": np.arange(3)}, attrs={"revision": "x"})
    with pytest.raises(DataError, match="'n' must be a str"):
        catalog.write("g.r", {"a": np.arange(3)}, attrs={"n": 3})
    assert not catalog.exists("g.r")


def test_ragged_file_on_open_names_both_columns(tmp_path):
    path = tmp_path / "crm" / "x.h5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(100)
        f["b"] = np.arange(99)
        f.attrs["columns"] = json.dumps(["a", "b"])
    with pytest.raises(DataError) as err:
        Catalog(tmp_path).open("crm.x")
    assert str(err.value) == (
        "dataset crm.x: column 'b' has 99 rows but 'a' has 100;"
        " rewrite it with `python -m gwenlake_hpc data import`"
    )


def test_missing_dataset_names_path_and_import_command(catalog):
    with pytest.raises(DataError) as err:
        catalog.open("crm.churn-train")
    msg = str(err.value)
    assert "dataset 'crm.churn-train' not found" in msg
    assert str(catalog.data_root / "crm" / "churn-train.h5") in msg
    assert "`python -m gwenlake_hpc data import FILE crm.churn-train`" in msg
    assert f"paths.data_root={catalog.data_root}" in msg


def test_not_hdf5_file(tmp_path):
    path = tmp_path / "crm" / "bad.h5"
    path.parent.mkdir()
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="crm.bad.*not a readable HDF5 file"):
        Catalog(tmp_path).open("crm.bad")


def test_file_without_columns(tmp_path):
    path = tmp_path / "g" / "empty.h5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        f.create_group("nested")
    with pytest.raises(DataError, match="no columns"):
        Dataset(path)


# --------------------------------------------------------------------------- batches


def test_batches_len_and_values(catalog):
    ds = _make(catalog, rows=200)
    assert len(ds.batches(32)) == 7
    assert len(ds.batches(32, drop_last=True)) == 6
    assert len(ds.batches(50, drop_last=True)) == 4
    assert len(ds.batches(500)) == 1
    assert len(ds.batches(500, drop_last=True)) == 0
    out = list(ds.batches(32, block_rows=16, buffer_blocks=2).epoch(0, seed=1))
    assert [len(b["idx"]) for b in out] == [32] * 6 + [8]
    for b in out:
        idx = b["idx"].numpy()
        assert b["idx"].dtype == torch.int64
        assert b["feat"].dtype == torch.float32 and b["feat"].shape == (len(idx), 2)
        # Columns of a batch stay aligned row by row.
        np.testing.assert_array_equal(b["feat"].numpy()[:, 1], idx * 2.0)
        np.testing.assert_array_equal(b["label"].numpy(), idx % 3)
        assert isinstance(b["text"], np.ndarray)
        assert b["text"].tolist() == [f"row-{i}" for i in idx]


@pytest.mark.parametrize(
    "rows,block_rows,buffer_blocks", [(200, 1024, 64), (200, 7, 3), (1000, 10, 4), (203, 16, 1), (1, 7, 3)]
)
def test_shuffled_epoch_is_a_permutation(catalog, rows, block_rows, buffer_blocks):
    ds = _make(catalog, rows=rows)
    b = ds.batches(5, block_rows=block_rows, buffer_blocks=buffer_blocks)
    order = _idx_order(list(b.epoch(0, seed=0)))
    assert sorted(order.tolist()) == list(range(rows))


def test_shuffle_order_depends_on_seed_and_epoch_only(catalog):
    ds = _make(catalog, rows=200)
    b = ds.batches(5, block_rows=7, buffer_blocks=3)
    e0 = _idx_order(list(b.epoch(0, seed=0)))
    assert np.array_equal(e0, _idx_order(list(b.epoch(0, seed=0))))
    assert np.array_equal(e0, _idx_order(list(b)))  # __iter__ is epoch 0, seed 0
    # A fresh Batches on a reopened file gives the same order.
    ds2 = catalog.open("crm.x")
    assert np.array_equal(e0, _idx_order(list(ds2.batches(5, block_rows=7, buffer_blocks=3).epoch(0, seed=0))))
    assert not np.array_equal(e0, _idx_order(list(b.epoch(1, seed=0))))
    assert not np.array_equal(e0, _idx_order(list(b.epoch(0, seed=1))))
    assert not np.array_equal(e0, np.arange(200))


def test_small_dataset_is_fully_shuffled(catalog):
    # rows <= window: one window, rows from anywhere can be neighbours.
    ds = _make(catalog, rows=100)
    order = _idx_order(list(ds.batches(10).epoch(0, seed=0)))
    assert sorted(order.tolist()) == list(range(100))
    assert np.abs(np.diff(order)).max() > 50


def test_block_shuffle_keeps_blocks_in_one_window(catalog):
    # Rows of one block always land in the same window of block_rows * buffer_blocks positions.
    ds = _make(catalog, rows=210)
    order = _idx_order(list(ds.batches(5, block_rows=7, buffer_blocks=3).epoch(2, seed=4)))
    window_of_row = np.empty(210, np.int64)
    window_of_row[order] = np.arange(210) // 21
    assert all(len(set(window_of_row[blk * 7 : blk * 7 + 7])) == 1 for blk in range(30))


def test_no_shuffle_is_sequential(catalog):
    ds = _make(catalog, rows=200)
    b = ds.batches(7, shuffle=False, block_rows=7, buffer_blocks=3)
    out = list(b.epoch(3, seed=9))
    assert np.array_equal(_idx_order(out), np.arange(200))
    assert [len(x["idx"]) for x in out] == [7] * 28 + [4]
    out = list(ds.batches(7, shuffle=False, drop_last=True).epoch(0))
    assert np.array_equal(_idx_order(out), np.arange(196))


def test_drop_last_drops_the_tail(catalog):
    ds = _make(catalog, rows=200)
    b = ds.batches(30, drop_last=True, block_rows=7, buffer_blocks=3)
    out = list(b.epoch(0, seed=2))
    assert len(out) == len(b) == 6
    assert all(len(x["idx"]) == 30 for x in out)
    full = _idx_order(list(ds.batches(30, block_rows=7, buffer_blocks=3).epoch(0, seed=2)))
    # drop_last keeps the same order and drops the last 20 positions.
    assert np.array_equal(_idx_order(out), full[:180])


def test_batch_larger_than_window(catalog):
    ds = _make(catalog, rows=200)
    b = ds.batches(64, block_rows=7, buffer_blocks=2)  # window of 14 rows
    out = list(b.epoch(1, seed=5))
    assert [len(x["idx"]) for x in out] == [64, 64, 64, 8]
    assert sorted(_idx_order(out).tolist()) == list(range(200))
    _assert_same_batches(list(b.epoch(1, start=2, seed=5)), out[2:])


@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False)])
def test_resume_equals_suffix_of_full_epoch(catalog, shuffle, drop_last):
    ds = _make(catalog, rows=200)
    b = ds.batches(5, shuffle=shuffle, drop_last=drop_last, block_rows=7, buffer_blocks=3)
    for epoch, seed in [(0, 0), (3, 11)]:
        full = list(b.epoch(epoch, seed=seed))
        assert len(full) == len(b) == 40
        # Every start, including batches straddling two windows (window = 21 rows).
        for k in range(len(b) + 1):
            _assert_same_batches(list(b.epoch(epoch, start=k, seed=seed)), full[k:])


def test_resume_does_not_read_skipped_batches(catalog, monkeypatch):
    # 210 rows, blocks of 7, windows of 3 blocks: ten windows of exactly 21 rows.
    ds = _make(catalog, rows=210)
    reads: list[tuple[str, int, int]] = []
    real = ds._read_slice

    def counting(col, start, stop, out=None):
        reads.append((col, start, stop))
        return real(col, start, stop, out)

    monkeypatch.setattr(ds, "_read_slice", counting)
    bs, window = 5, 21
    # Without prefetch, so the reads are exactly those of the batches taken (with it, see test_data_pipeline).
    b = ds.batches(bs, columns=["idx"], block_rows=7, buffer_blocks=3, prefetch=False)

    def first_batch_rows(k: int) -> int:
        reads.clear()
        it = b.epoch(2, start=k, seed=1)
        next(it)
        return sum(stop - start for _, start, stop in reads)

    for k in [0, 1, 20, 30, 40, 41]:
        straddles = (k * bs) // window != ((k + 1) * bs - 1) // window
        rows_read = first_batch_rows(k)
        assert rows_read == (2 * window if straddles else window), k
        if not straddles:
            assert rows_read <= window + bs
    # Every read is a contiguous slice of at most one block run inside a window.
    assert all(stop - start <= window for _, start, stop in reads)
    # A whole epoch reads every row exactly once.
    reads.clear()
    list(b.epoch(0, seed=0))
    assert sum(stop - start for _, start, stop in reads) == 210


def test_batches_columns_selection_and_errors(catalog):
    ds = _make(catalog, rows=20)
    out = list(ds.batches(8, columns=["label", "idx"]).epoch(0))
    assert all(list(x) == ["label", "idx"] for x in out)
    np.testing.assert_array_equal(
        np.concatenate([x["label"].numpy() for x in out]), _idx_order(out) % 3
    )
    with pytest.raises(DataError) as err:
        ds.batches(8, columns=["idx", "nope"])
    assert "'nope'" in str(err.value)
    assert "['idx', 'feat', 'label', 'text']" in str(err.value)
    with pytest.raises(DataError, match="nope"):
        ds.read(columns=["nope"])
    for bad in [0, -1, 1.5, True]:
        with pytest.raises(ConfigError, match="batch_size"):
            ds.batches(bad)
    with pytest.raises(ConfigError, match="block_rows"):
        ds.batches(4, block_rows=0)
    with pytest.raises(ConfigError, match="buffer_blocks"):
        ds.batches(4, buffer_blocks=0)
    b = ds.batches(8)
    assert list(b.epoch(0, start=len(b))) == []
    with pytest.raises(ConfigError, match="start=4"):
        b.epoch(0, start=4)
    with pytest.raises(ConfigError, match="seed"):
        b.epoch(0, seed=-1)
    with pytest.raises(ConfigError, match="epoch"):
        b.epoch(-1)
    assert len(b) == 3 and [len(x["idx"]) for x in b.epoch(0)] == [8, 8, 4]  # 20 rows, the last batch kept
    assert (b.batch_size, b.shuffle, b.drop_last, b.columns) == (8, True, False, ["idx", "feat", "label", "text"])


# --------------------------------------------------------------------------- import


def _frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": np.arange(6, dtype=np.int64),
            "score": np.linspace(0.0, 1.0, 6),
            "flag": [True, False, True, True, False, False],
            "city": ["Paris", "Brest", "Zürich", "東京", "", "a,b"],
        }
    )


@pytest.mark.parametrize("ext", [".csv", ".parquet", ".pq"])
def test_import_table_round_trip(catalog, tmp_path, ext):
    df = _frame()
    src = tmp_path / f"table{ext}"
    if ext == ".csv":
        df.to_csv(src, index=False)
    else:
        df.to_parquet(src, index=False)
    rev = catalog.import_table(src, "crm.table")
    with catalog.open("crm.table") as ds:
        assert ds.revision == rev
        assert ds.columns == ["id", "score", "flag", "city"]
        assert ds.schema == {
            "id": ("<i8", ()),
            "score": ("<f8", ()),
            "flag": ("|u1", ()),
            "city": ("str", ()),
        }
        assert ds.attrs["source"] == str(src.resolve())
        data = ds.read()
    np.testing.assert_array_equal(data["id"], df["id"].to_numpy())
    np.testing.assert_allclose(data["score"], df["score"].to_numpy())
    np.testing.assert_array_equal(data["flag"], [1, 0, 1, 1, 0, 0])
    # CSV reads the empty cell as missing; it comes back as ''.
    assert data["city"].tolist() == ["Paris", "Brest", "Zürich", "東京", "", "a,b"]


def test_import_table_column_selection(catalog, tmp_path):
    src = tmp_path / "t.csv"
    _frame().to_csv(src, index=False)
    import_table(src, catalog.data_root, "crm.sel", columns=["city", "id"])
    with catalog.open("crm.sel") as ds:
        assert ds.columns == ["city", "id"]
        assert ds.read(["city"])["city"].tolist()[:2] == ["Paris", "Brest"]
    with pytest.raises(DataError) as err:
        catalog.import_table(src, "crm.sel2", columns=["id", "zip"])
    assert "'zip'" in str(err.value) and "available columns" in str(err.value)
    assert not catalog.exists("crm.sel2")


def test_import_table_nullable_int_parquet(catalog, tmp_path):
    src = tmp_path / "n.parquet"
    pd.DataFrame({"n": pd.array([1, None, 3], dtype="Int64")}).to_parquet(src)
    catalog.import_table(src, "g.n")
    with catalog.open("g.n") as ds:
        got = ds.read()["n"]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [1.0, np.nan, 3.0])


def test_import_table_errors(catalog, tmp_path):
    with pytest.raises(DataError, match="not found"):
        catalog.import_table(tmp_path / "absent.csv", "g.t")
    src = tmp_path / "t.json"
    src.write_text("{}")
    with pytest.raises(DataError, match="unknown extension '.json'"):
        catalog.import_table(src, "g.t")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match="bad.parquet"):
        catalog.import_table(bad, "g.t")
    good = tmp_path / "ok.csv"
    _frame().to_csv(good, index=False)
    with pytest.raises(DataError, match="group.name"):
        catalog.import_table(good, "nodot")
    assert not catalog.exists("g.t")
