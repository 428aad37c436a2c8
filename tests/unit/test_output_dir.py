"""The Output's rule (gwenlake_hpc/job/output_dir.py): what an unfinished start left there and nobody touched
since is removed before the commit; what this start wrote stays; nothing outside the folder is touched."""

from __future__ import annotations

import os

from gwenlake_hpc.job.output_dir import drop_unfinished, entries, output_dir


def test_what_an_unfinished_start_left_goes_and_what_this_start_wrote_stays(tmp_path):
    out = output_dir(tmp_path / "run", 0)
    (out / "sub").mkdir(parents=True)
    (out / "old").mkdir()
    (out / ".model.safetensors.hzxsb9dl.tmp").write_bytes(b"\0" * 1000)
    (out / "notes.txt").write_text("half")
    (out / "old" / "x.bin").write_bytes(b"x")
    (out / "model.safetensors").write_bytes(b"old model")
    (out / "sub" / "kept.txt").write_text("old")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (out / "link").symlink_to(outside)
    before = entries(out)
    # this start: a new model renamed into place, a file rewritten in place, a new file
    (out / ".model.new").write_bytes(b"new model")
    os.replace(out / ".model.new", out / "model.safetensors")
    (out / "sub" / "kept.txt").write_text("new, longer")
    (out / "model.json").write_text("{}")
    removed = drop_unfinished(out, before)
    assert removed == [".model.safetensors.hzxsb9dl.tmp", "link", "notes.txt", "old/", "old/x.bin"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "model.json", "model.safetensors", "sub", "sub/kept.txt"]
    assert (out / "model.safetensors").read_bytes() == b"new model"
    assert (outside / "keep.txt").read_text() == "keep"
    assert entries(tmp_path / "absent") == {}


def test_output_dir_of_rank_0_is_committed_and_others_are_scratch(tmp_path):
    assert output_dir(tmp_path, 0) == tmp_path / "output"
    assert output_dir(tmp_path, 3) == tmp_path / ".ranks" / "rank-00003" / "output"
