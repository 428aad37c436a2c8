"""Each start empties its Output folder (gwenlake_hpc/job/output_dir.py): nothing an unfinished start left
reaches a version, and nothing outside the folder is touched."""

from __future__ import annotations

from gwenlake_hpc.job.output_dir import clear_unfinished, output_dir


def test_clear_unfinished_removes_everything_and_follows_no_symlink(tmp_path):
    out = output_dir(tmp_path / "run", 0)
    (out / "sub").mkdir(parents=True)
    (out / ".model.safetensors.hzxsb9dl.tmp").write_bytes(b"\0" * 1000)
    (out / "notes.txt").write_text("half")
    (out / "sub" / "x.bin").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (out / "link").symlink_to(outside)
    assert clear_unfinished(out) == [".model.safetensors.hzxsb9dl.tmp", "link", "notes.txt", "sub"]
    assert out.is_dir() and list(out.iterdir()) == []
    assert (outside / "keep.txt").read_text() == "keep"
    assert clear_unfinished(out) == [] and clear_unfinished(tmp_path / "absent") == []


def test_output_dir_of_rank_0_is_committed_and_others_are_scratch(tmp_path):
    assert output_dir(tmp_path, 0) == tmp_path / "output"
    assert output_dir(tmp_path, 3) == tmp_path / ".ranks" / "rank-00003" / "output"
