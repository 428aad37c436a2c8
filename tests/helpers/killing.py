"""A job killed at a moment no training function can choose: once the function returned, its last checkpoint
sealed, before the commit (see kill_before_commit/sitecustomize.py)."""

from __future__ import annotations

import os
from pathlib import Path

DIR = Path(__file__).resolve().parent / "kill_before_commit"


def kill_before_commit_env() -> dict[str, str]:
    """The environment of a job that SIGKILLs itself after its function returned, before the commit."""
    path = os.pathsep.join(p for p in (str(DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "GWL_TEST_SIGKILL_BEFORE_COMMIT": "1"}
