"""Running the ``gwenlake-train`` entry point (installed beside this interpreter) in a test project."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GWENLAKE_TRAIN = str(Path(sys.executable).with_name("gwenlake-train"))


def train_cmd(project, *args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    return subprocess.run([GWENLAKE_TRAIN, *args], cwd=project.root, env=env, capture_output=True, text=True,
                          timeout=300, **kw)
