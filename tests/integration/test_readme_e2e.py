"""The README's main-job command, as a new user runs it: a clean copy of the project, a new virtualenv."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from helpers.project import git, REPO


def readme_command(heading: str) -> str:
    text = (REPO / "README.md").read_text()
    after = text[text.index(heading):]
    return re.search(r"```bash\n(.+?)\n```", after, re.S).group(1).strip()


@pytest.mark.slow
def test_readme_main_job_in_clean_venv(tmp_path):
    command = readme_command("Train the main job")
    assert "python -m gwenlake_hpc +job=churn" in command
    clean = tmp_path / "clean"
    clean.mkdir()
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        src, dst = REPO / rel, clean / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            dst.chmod(src.stat().st_mode)
    git(clean, "init", "-q", "-b", "main")
    git(clean, "add", "-A")
    git(clean, "commit", "-q", "-m", "fresh clone")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    proc = subprocess.run(["bash", "-c", command], cwd=clean, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"model crm\.churn version [0-9a-f]{40}", last), last
    version = last.split()[-1]
    metrics = json.loads(git(clean, "show", f"{version}:crm/churn/metrics.json"))
    assert metrics["test_auc"] >= 0.82
    assert git(clean, "rev-parse", "models/crm.churn") == version
    assert (clean / ".venv" / "bin" / "python").exists()

    # The short fit of the README, a second job: trees on the same split, a version of the same model.
    short = readme_command("The same data as a short fit")
    assert "+job=churn_short" in short
    proc = subprocess.run(["bash", "-c", short], cwd=clean, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trees = proc.stdout.strip().splitlines()[-1].split()[-1]
    tree_metrics = json.loads(git(clean, "show", f"{trees}:crm/churn/metrics.json"))
    print(f"churn test_auc: MLP {metrics['test_auc']:.4f}, gradient-boosted trees {tree_metrics['test_auc']:.4f}")
    assert tree_metrics["test_auc"] >= 0.82 and git(clean, "rev-parse", "models/crm.churn") == trees
    assert "model.joblib" in git(clean, "ls-tree", "--name-only", trees, "crm/churn/")
