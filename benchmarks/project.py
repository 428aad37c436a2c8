"""A throw-away project for the benchmarks that run real jobs: the repository's ``conf/``, one trainer file, one
job config naming it, committed to a fresh git repository (the version commit needs one). Imported by
``bench_goodput`` and ``bench_hang`` from their own folder (on ``sys.path`` when a benchmark runs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_project(root: Path, job: str, module: str, trainer: str, ignored: tuple[str, ...] = ()) -> Path:
    """Write ``root`` as a project whose ``+job=<job>`` runs ``<module>.py:fit`` (``trainer``, its source) and
    commit it; ``ignored``: more .gitignore lines than ``runs/``. Returns ``root``."""
    shutil.copytree(REPO / "conf", root / "conf")
    (root / "conf" / "job" / f"{job}.yaml").write_text(f"target: {module}.py:fit\n")
    (root / f"{module}.py").write_text(trainer)
    (root / ".gitignore").write_text("".join(f"{line}\n" for line in ("runs/", *ignored)))
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q", "-b", "main"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "code"], cwd=root, check=True)
    return root
