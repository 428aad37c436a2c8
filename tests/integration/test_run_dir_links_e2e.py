"""Symbolic links planted in a run directory after an eviction (issue 40 item 13c, the inputs tried by hand): the
rerun exited 0 and wrote the lock, the ledger, the spool, the model and a whole checkpoint into the folder outside.
Now it exits 2 naming the link, before writing anything, and resumes once the link is gone."""

from __future__ import annotations

import hashlib
import shutil

import pytest


def _contents(folder):
    """Every file and folder under ``folder`` with a digest of each file's bytes (what a start may have written)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def test_a_rerun_refuses_links_planted_in_its_run_directory_and_writes_nothing_through_them(project, tmp_path):
    project.run("+job=t", env={"GWL_TEST_SIGTERM_AT": "25"}, check=75)
    (run_dir,) = [p.parent for p in (project.root / "runs").glob("*/*/run.json")]
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in (".lock", "ledger", "tracking", "output", "checkpoints", None):
        link = run_dir / name if name else run_dir  # None: the run directory itself
        target = outside / (name or "run")
        if link.exists():
            shutil.move(link, target)  # the folder (or the lock) moved out, a link left in its place
        else:
            target.mkdir()  # output/: none yet after an eviction
        link.symlink_to(target)
        before, run_before = _contents(outside), _contents(run_dir) if name else None
        done = project.run("+job=t")
        said = done.stdout + done.stderr
        assert done.returncode == 2, said
        assert "Traceback" not in said, said
        if name:
            assert f"{link} in the run directory is a symbolic link (to {target}): a start would write into that " \
                   "folder outside the run. Remove the link" in said, said
            assert _contents(run_dir) == run_before
        else:
            assert f"the run directory {link} is a symbolic link (to {target})" in said, said
        assert _contents(outside) == before  # nothing written through the link
        link.unlink()
        shutil.move(target, link)
    # A runs root reached through a link is fine: only the run directory and what is inside it are checked.
    real_root = tmp_path / "real-runs"
    shutil.move(project.root / "runs", real_root)
    (project.root / "runs").symlink_to(real_root)
    resumed = project.run("+job=t", check=0)
    assert "resuming from step 26" in resumed.stdout + resumed.stderr
    assert not list(outside.rglob("*"))  # every moved entry went back
