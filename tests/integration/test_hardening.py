"""Hardening: what teammates on a shared filesystem see, and how a job ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_files_follow_the_umask_so_teammates_can_read_them(project):
    """Datasets, run records, checkpoints, tracking state and exported models get the mode a plain open() gives
    (0644 files, 0755 folders with umask 022), not mkstemp's 0600."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    code = ("import numpy as np; from gwenlake_hpc.data import Catalog; "
            "Catalog('data').write('t.more', {'x': np.zeros((4, 4), np.float32), 'y': np.zeros(4, np.float32)})")
    for cmd in ([sys.executable, "-c", code], [sys.executable, "-m", "gwenlake_hpc", "+job=t", "job.steps=20"]):
        done = subprocess.run(cmd, cwd=project.root, env=env, capture_output=True, text=True, timeout=600,
                              preexec_fn=lambda: os.umask(0o022))
        assert done.returncode == 0, done.stderr[-2000:]
    version = done.stdout.strip().splitlines()[-1].split()[-1]
    export = subprocess.run([sys.executable, "-c", f"from gwenlake_hpc import load_model; "
                             f"print(load_model('t.model', '{version}').path)"], cwd=project.root, env=env,
                            capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.umask(0o022))
    assert export.returncode == 0, export.stderr[-2000:]
    roots = [project.root / "runs", project.root / "data", project.root / export.stdout.strip().splitlines()[-1]]
    seen = {"file": 0, "dir": 0}
    wrong = []
    for root in roots:
        for p in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(p.lstat().st_mode)
            if p.is_symlink():
                continue
            kind = "dir" if p.is_dir() else "file"
            seen[kind] += 1
            if mode != (0o755 if kind == "dir" else 0o644):
                wrong.append(f"{oct(mode)} {p.relative_to(project.root)}")
    assert not wrong, wrong
    assert seen["file"] > 10 and seen["dir"] > 3


@pytest.mark.slow
def test_a_handler_installed_by_the_training_does_not_swallow_an_eviction(project):
    """At step 12 the training installs its own SIGTERM handler; SIGTERM at step 25 still stops the loop at a step
    boundary with a checkpoint (exit 75), theirs is called too, and the rerun resumes and finishes."""
    evicted = project.run("+job=t", env={"GWL_TEST_OWN_HANDLER": "12", "GWL_TEST_SIGTERM_AT": "25"}, check=75)
    log = evicted.stdout + evicted.stderr
    assert "the handler of SIGTERM was replaced (by " in log and "trainer.fit.<locals>.own)" in log, log
    assert log.count("the handler of SIGTERM was replaced") == 1
    assert "loop ended after step 26" in log, log
    assert (project.root / "own_handler_calls").read_text() == f"{int(signal.SIGTERM)}\n"
    resumed = project.run("+job=t", check=0)
    assert "resuming from step 26" in resumed.stdout + resumed.stderr


def _popen_job(project, *args, env=None):
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", *args], cwd=project.root, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_while_starting_is_an_eviction_and_after_the_commit_is_ignored(project):
    # During start-up (Hydra, torch and the trainer loading): the start ends at once with exit 75, nothing trained
    # (issue 40: a start blocked there would otherwise wait for SIGKILL).
    proc = _popen_job(project, "+job=t")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, (out + err)[-3000:]
    assert re.search(r"stop requested \(SIGTERM\) (during the start-up|before the training loop began)", out + err), \
        (out + err)[-3000:]
    assert "Traceback" not in out + err and "loop ended after step" not in out + err, (out + err)[-3000:]

    # After the version line: the commit is done, SIGTERMs until the process is gone change nothing (exit 0).
    proc = _popen_job(project, "+job=t")
    line = ""
    while not line.startswith("model t.model version"):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()[-3000:]
    sent = 0
    while proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
            sent += 1
        time.sleep(0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == 0 and sent > 0, (proc.returncode, sent)


@pytest.mark.slow
def test_a_start_killed_between_its_commit_and_its_record_commits_no_second_version(project):
    """The state a SIGKILL leaves right after the version commit: the branch has the version, run.json does not.
    The rerun finds the version by its run key and final step and commits nothing new."""
    import json

    from gwenlake_hpc.stores.versioning import list_versions

    first = project.run("+job=t", "job.steps=30", check=0)
    version = first.stdout.strip().splitlines()[-1].split()[-1]
    run_dir = next((project.root / "runs" / "t.model").iterdir())
    assert f"no checkpoint of this run in {run_dir / 'checkpoints'}: training from step 0" in first.stderr + first.stdout
    info_path = next((project.root / "runs" / "t.model").iterdir()) / "run.json"
    info = json.loads(info_path.read_text())
    info["completed"], info["completions"] = None, []
    info_path.write_text(json.dumps(info))
    again = project.run("+job=t", "job.steps=30", check=0)
    assert again.stdout.strip().splitlines()[-1] == f"model t.model version {version}"
    assert "committed by an earlier start that ended before recording it" in again.stdout + again.stderr
    versions = list_versions(project.root, "t.model")
    assert [v["version"] for v in versions] == [version]
    info = json.loads(info_path.read_text())
    assert versions[0]["run"] == f"{info['run_key']}/{info['uid']}@30"
    # A longer run of the same key is a new version.
    longer = project.run("+job=t", "job.steps=40", check=0)
    assert longer.stdout.strip().splitlines()[-1] != f"model t.model version {version}"
    assert len(list_versions(project.root, "t.model")) == 2


@pytest.mark.slow
def test_a_function_that_saves_no_model_or_returns_a_str_commits_nothing(project):
    from gwenlake_hpc.stores.versioning import list_versions

    none = project.run("+job=t", "job.steps=20", env={"GWL_TEST_BAD": "nooutput"})
    log = none.stdout + none.stderr
    assert none.returncode == 1, log
    assert "wrote no file into its Output: nothing is committed" in log and "output.file(NAME)" in log
    text = project.run("+job=t", "job.steps=20", env={"GWL_TEST_BAD": "str"})
    log = text.stdout + text.stderr
    assert text.returncode == 2, log
    assert "returned str 'done': return a dict of numbers" in log and "Traceback" not in log
    assert list_versions(project.root, "t.model") == []
    fixed = project.run("+job=t", "job.steps=20", check=0)  # the function fixed: resumes from step 20, commits
    assert "resuming from step 20" in fixed.stdout + fixed.stderr
    assert len(list_versions(project.root, "t.model")) == 1
