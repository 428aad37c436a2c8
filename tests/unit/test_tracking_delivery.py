"""The spool of the delivery process (no process: its files alone; the delivery process itself, killed and
restarted, is tested in tests/integration/test_tracking_delivery_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gwenlake_hpc.stores.tracking.delivery import spool as spool_mod
from gwenlake_hpc.stores.tracking.delivery.spool import SpoolReader, SpoolWriter, encode, points_of, read_all, segment_paths


# ------------------------------------------------------------------------------------------
# the spool


def test_spool_segments_locks_rotation_and_torn_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "ROTATE_BYTES", 4000)
    writer = SpoolWriter(tmp_path)
    points = [("loss", 1.0 / s, s, 1_700_000_000_000 + s) for s in range(1, 301)]
    for i in range(0, 300, 10):
        writer.append(encode(points[i:i + 10]))
    writer.append(encode([{"tags": {"k": "v"}}, ("nan", float("nan"), 1, 5), ("inf", float("-inf"), 1, 5)]))
    segments = segment_paths(tmp_path)
    assert len(segments) > 3 and segments == sorted(segments)
    entries = read_all(tmp_path)
    assert points_of(entries)[:300] == points
    assert {"tags": {"k": "v"}} in entries
    nan, inf = points_of(entries)[300:]
    assert nan[1] != nan[1] and inf[1] == float("-inf")

    reader = SpoolReader(tmp_path)
    for path in segments:
        while True:
            got, end = reader.read(path, 50)
            if end == reader.offsets.get(path, 0):
                break
            reader.advance(path, end)
    # The writer is alive: its current segment stays; the ones it rotated away from go.
    assert [reader.try_remove(p) for p in segments] == [True] * (len(segments) - 1) + [False]
    assert segment_paths(tmp_path) == [writer.path]
    writer.append(b'{"key": "loss", "val')  # killed in the middle of a line
    writer.close()
    assert reader.try_remove(writer.path) is True and reader.malformed == 1
    assert segment_paths(tmp_path) == []

    again = SpoolWriter(tmp_path)  # a later start numbers on from nothing left
    assert again.path.name == "00000001.jsonl"
    again.close()
