"""The data position as a global sample count: a run stopped on N ranks and resumed on M ranks over real
gwenlake Batches (HDF5) reads every sample of every epoch once, when the global batch size is the same."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from gwenlake_hpc.data import Catalog
from gwenlake_hpc.runtime.feed import PlanStream, resolve_total

ROWS, GLOBAL = 96, 8  # 12 global batches an epoch
TOTAL = 40  # steps: 3 epochs and 4 steps


@pytest.fixture
def dataset(tmp_path):
    catalog = Catalog(tmp_path / "data")
    catalog.write("t.rows", {"idx": np.arange(ROWS, dtype=np.int64)})
    return catalog.open("t.rows")


def ranks(dataset, world, start, stop, saved=None, batch=None):
    """Run ``world`` ranks from step ``start`` to ``stop``: ([(epoch, ids read by all ranks at that step)],
    rank 0's position after ``stop``)."""
    b = batch or GLOBAL // world
    batches = dataset.batches(b, block_rows=16, buffer_blocks=2)
    _, per_epoch = resolve_total(batches, TOTAL, None, world)
    streams = [PlanStream(batches, per_epoch, start, rank=r, world_size=world, seed=7,
                          saved=json.loads(json.dumps(saved)) if saved else None) for r in range(world)]
    steps = []
    for _ in range(start, stop):
        read = [next(s) for s in streams]
        assert len({e for e, _ in read}) == 1  # the ranks agree on the epoch
        assert all(len(b_["idx"]) == b for _, b_ in read)
        steps.append((read[0][0], [i for _, b_ in read for i in b_["idx"].tolist()]))
    position = streams[0].position()
    assert all(s.position() == position for s in streams)  # the same global position on every rank
    for s in streams:
        s.close()
    return steps, position


def by_epoch(steps):
    out: dict[int, list[int]] = {}
    for epoch, ids in steps:
        out.setdefault(epoch, []).extend(ids)
    return out


@pytest.mark.parametrize("was,now", [(2, 1), (1, 2), (2, 4), (4, 2)])
@pytest.mark.parametrize("stop", [5, 12, 17])
def test_resume_on_another_number_of_ranks_reads_every_sample_once(dataset, was, now, stop):
    full, _ = ranks(dataset, was, 0, TOTAL)
    first, position = ranks(dataset, was, 0, stop)
    assert position["samples"] == stop * GLOBAL and position["global_batch_size"] == GLOBAL
    assert position["epoch"] == stop // 12
    assert sum(z - a for a, z in position["remaining"]) == ROWS - (stop % 12) * GLOBAL
    second, end = ranks(dataset, now, stop, TOTAL, saved=position)
    assert end["samples"] == TOTAL * GLOBAL and end["skipped"] == 0
    assert first == full[:stop]  # before the stop: the uninterrupted run
    resumed, uninterrupted = by_epoch(first + second), by_epoch(full)
    assert resumed.keys() == uninterrupted.keys() == {0, 1, 2, 3}
    for epoch in (0, 1, 2):  # whole epochs: every sample once, no gap, no duplicate
        assert sorted(resumed[epoch]) == list(range(ROWS)), epoch
    assert len(resumed[3]) == len(uninterrupted[3]) == 4 * GLOBAL
    if stop % 12:  # the interrupted epoch: the same samples as the uninterrupted run's epoch, in its order
        epoch = stop // 12
        assert sorted(resumed[epoch]) == sorted(uninterrupted[epoch])
    # The epochs after the interrupted one are those of an uninterrupted run on the new number of ranks.
    after = by_epoch(ranks(dataset, now, 0, TOTAL)[0])
    for epoch in range(stop // 12 + 1, 4):
        assert resumed[epoch] == after[epoch], epoch


def test_same_number_of_ranks_continues_the_same_batches(dataset):
    full, _ = ranks(dataset, 2, 0, TOTAL)
    first, position = ranks(dataset, 2, 0, 17)
    second, _ = ranks(dataset, 2, 17, TOTAL, saved=position)
    assert first + second == full
    # And after a change of ranks, a resume on the same ranks continues that run's own layout exactly.
    a, p1 = ranks(dataset, 2, 0, 7)
    b, p2 = ranks(dataset, 4, 7, 9, saved=p1)
    c, _ = ranks(dataset, 4, 9, TOTAL, saved=p2)
    d, _ = ranks(dataset, 4, 7, TOTAL, saved=p1)
    assert b + c == d


def test_chained_changes_of_ranks(dataset):
    a, p1 = ranks(dataset, 2, 0, 15)
    b, p2 = ranks(dataset, 4, 15, 19, saved=p1)
    c, p3 = ranks(dataset, 1, 19, 22, saved=p2)
    d, end = ranks(dataset, 2, 22, TOTAL, saved=p3)
    epochs = by_epoch(a + b + c + d)
    for epoch in (0, 1, 2):
        assert sorted(epochs[epoch]) == list(range(ROWS)), epoch
    assert end["samples"] == TOTAL * GLOBAL


def test_another_global_batch_size_skips_the_rest_of_the_epoch_with_a_warning(dataset, caplog):
    _, position = ranks(dataset, 2, 0, 17)  # epoch 1 has 7 global batches of 8 left: 56 samples
    with caplog.at_level(logging.WARNING, logger="gwenlake_hpc.run"):
        second, end = ranks(dataset, 1, 17, 30, saved=position, batch=6)
    assert "changed from 8 (2 rank(s) x 4) to 6 (1 x 6)" in caplog.text
    assert "of the 56 samples epoch 1 has left, 54 are read in 9 steps and the last 2 are skipped" in caplog.text
    assert [e for e, _ in second[:9]] == [1] * 9 and second[9][0] == 2  # epoch 2 begins after step 26
    read_in_1 = [i for _, ids in second[:9] for i in ids]
    assert len(set(read_in_1)) == 54
    assert not set(read_in_1) & set(by_epoch(ranks(dataset, 2, 0, 17)[0])[1])  # nothing read twice
    assert end["skipped"] == 2 and end["samples"] == 17 * 8 + 13 * 6


def test_spans_is_epoch_from_a_position(dataset):
    batches = dataset.batches(5, block_rows=16, buffer_blocks=2)
    want = [b["idx"].tolist() for b in batches.epoch(3, start=4, seed=2)]
    got = [b["idx"].tolist() for b in batches.spans(3, [(20, ROWS)], seed=2)]
    assert got == want
    order = [i for b in batches.epoch(3, seed=2) for i in b["idx"].tolist()]
    joined = [i for b in batches.spans(3, [(3, 9), (40, 47)], seed=2) for i in b["idx"].tolist()]
    assert joined == order[3:9] + order[40:47]
    assert [len(b["idx"]) for b in batches.spans(3, [(3, 9), (40, 47)], seed=2)] == [5, 5, 3]
