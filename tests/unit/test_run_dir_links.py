"""Symbolic links in a run directory (issue 40 item 13c): refused before a start writes anything, files a start
appends to opened without following a link; a runs root reached through a link stays fine. The whole job (a
rerun after an eviction) is ``tests/integration/test_run_dir_links_e2e.py``."""

from __future__ import annotations

import pytest

from gwenlake_hpc.base.errors import ConfigError
from gwenlake_hpc.base.fsutil import RUN_DIR_ENTRIES, open_append, refuse_symlinks


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "runs" / "t.model" / "fit-0123456789abcdef"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".lock").write_text("pid 1 on host\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    return run, outside


@pytest.mark.parametrize("name", [".lock", "ledger", "tracking", "output", "checkpoints", "run.json", ".ranks"])
def test_an_entry_of_the_run_directory_that_is_a_link_is_refused_naming_it(run_dir, name):
    run, outside = run_dir
    link = run / name
    if link.is_dir():
        link.rmdir()
    else:
        link.unlink(missing_ok=True)
    link.symlink_to(outside)
    with pytest.raises(ConfigError) as err:
        refuse_symlinks(run)
    assert str(err.value).startswith(f"{link} in the run directory is a symbolic link (to {outside}): a start "
                                      "would write into that folder outside the run. Remove the link (rm ")
    assert list(outside.iterdir()) == []


def test_the_run_directory_itself_a_link_is_refused_but_a_linked_runs_root_is_fine(run_dir, tmp_path):
    run, outside = run_dir
    moved = outside / "run"
    run.rename(moved)
    run.symlink_to(moved)
    with pytest.raises(ConfigError, match=r"the run directory .*fit-0123456789abcdef is a symbolic link \(to "
                                          r".*outside/run\): .* point paths.runs_root at the real folder"):
        refuse_symlinks(run)
    run.unlink()
    moved.rename(run)
    # /scratch -> the real disk: the runs root and a model's folder may be reached through links
    (tmp_path / "scratch").symlink_to(tmp_path / "runs")
    refuse_symlinks(tmp_path / "scratch" / "t.model" / run.name)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "t.model").symlink_to(run.parent)
    refuse_symlinks(tmp_path / "models" / "t.model" / run.name)
    refuse_symlinks(tmp_path / "runs" / "t.model" / "not-made-yet")  # a new run: nothing to check yet


def test_every_entry_a_start_writes_is_checked():
    assert {".lock", "ledger", "tracking", "output", "checkpoints", "run.json", ".fence", ".lease"} <= \
        set(RUN_DIR_ENTRIES)


def test_a_file_a_start_appends_to_is_never_written_through_a_link(tmp_path):
    from gwenlake_hpc.runtime.ledger import StartLedger

    target = tmp_path / "outside.txt"
    target.write_text("theirs\n")
    ledger = tmp_path / "run" / "ledger"
    ledger.mkdir(parents=True)
    (ledger / "start-0000.jsonl").symlink_to(target)
    with pytest.raises(ConfigError, match=r"start-0000.jsonl is a symbolic link: it is not written through"):
        StartLedger(ledger / "start-0000.jsonl", 0)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        open_append(ledger / "start-0000.jsonl", read=True)
    assert target.read_text() == "theirs\n"
    with open_append(ledger / "start-0001.jsonl") as fh:  # a plain file: made, appended to
        fh.write("one\n")
    with open_append(ledger / "start-0001.jsonl", read=True) as fh:
        fh.write("two\n")
        fh.seek(0)
        assert fh.read() == "one\ntwo\n"


def test_a_link_planted_after_the_plan_is_refused_as_the_lock_is_taken(run_dir):
    from gwenlake_hpc.job.run_lock import RunLock

    run, outside = run_dir
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(outside / "lock")
    with pytest.raises(ConfigError, match=r"\.lock in the run directory is a symbolic link"):
        RunLock(run, wait_s=0)
    assert list(outside.iterdir()) == []
