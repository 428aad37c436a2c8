"""The tests' user projects: a temporary project (conf/, tests/project's trainer, a git repository, a dataset)
and the churn example's project; ``Project.run`` runs ``python -m gwenlake_hpc`` in one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]  # tests/: its project/ and project_mlflow/ are copied by the tests
REPO = TESTS.parent


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@localhost", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def files_under(folder: Path) -> list[str]:
    """Every file and folder under ``folder``, as sorted relative paths; [] where ``folder`` does not exist.

    Compared before and after a command to show that it wrote nothing there."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@dataclass
class Project:
    """A user's project: cwd of the jobs, its own git repository (also the model repository)."""

    root: Path

    def run(self, *args, env=None, timeout=300, check=None):
        """Run ``python -m gwenlake_hpc ARGS`` in the project; returns CompletedProcess (text)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        full_env.pop("GWENLAKE_CONF", None)
        proc = subprocess.run([sys.executable, "-m", "gwenlake_hpc", *args], cwd=self.root, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        if check is not None and proc.returncode != check:
            raise AssertionError(f"exit {proc.returncode} != {check}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
        return proc

    def popen(self, *args, env=None):
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", *args], cwd=self.root, env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def git(self, *args):
        return git(self.root, *args)


#: Written into a test's project by a test that makes a training hang on purpose (issue 24): the suite's check
#: for false alarms of the hang watchdog (tests/conftest.py) skips that project's hangs.
HANG_EXPECTED = ".hang-expected"


def expect_hangs(project: Project) -> None:
    """``project``'s runs hang on purpose (see :data:`HANG_EXPECTED`)."""
    (project.root / HANG_EXPECTED).touch()


def make_test_project(root: Path) -> Project:
    """The tests' user project (conf/, tests/project's trainer and job t, dataset t.rows) at ``root``."""
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copy(TESTS / "project" / "conf" / "job" / "t.yaml", root / "conf" / "job" / "t.yaml")
    shutil.copy(TESTS / "project" / "trainer.py", root / "trainer.py")
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "code")

    from gwenlake_hpc.data import Catalog

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32) + 0.1 * rng.normal(size=200)).astype(np.float32)
    Catalog(root / "data").write("t.rows", {"x": x, "y": y})
    return Project(root)


def make_churn_project(root: Path, message: str = "code") -> Project:
    """A user's project holding the churn example (conf/, examples/), committed in its own git repository."""
    root.mkdir(parents=True)
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (root / ".gitignore").write_text("runs/\ndata/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return Project(root)
