"""gwenlake-train, sub-commands dispatched before Hydra, data import."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pandas as pd

import pytest
from helpers.cli import GWENLAKE_TRAIN, train_cmd


@pytest.mark.slow
def test_train_steps_interrupt_and_resume(project):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GWL_TEST_SLEEP": "0.01"}
    proc = subprocess.Popen([GWENLAKE_TRAIN, "--steps", "500", "fit", "job.tracking=false"], cwd=project.root,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(project.root.glob("runs/t.model/*/checkpoints/step-000000030")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, out + err
    again = train_cmd(project, "fit", "--steps", "500", "job.tracking=false")  # an override after a flag
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming from step" in again.stdout + again.stderr
    assert again.stdout.strip().splitlines()[-1].startswith("model t.model version ")


@pytest.mark.slow
def test_data_import_csv_then_show_and_train_on_it(project):
    csv = project.root / "rows.csv"
    pd.DataFrame({"a": [1.5, 2.5, 3.5], "label": ["x", "y", "x"]}).to_csv(csv, index=False)
    proc = project.run("data", "import", str(csv), "t.imported", "--data-root", "data", check=0)
    assert "3 rows" in proc.stdout and "a, label" in proc.stdout
    again = project.run("data", "import", str(csv), "t.imported")
    assert again.returncode == 2 and "--force" in again.stderr  # an existing dataset is never replaced silently
    project.run("data", "import", str(csv), "t.imported", "--force", check=0)
    show = project.run("data", "show", "t.imported", check=0)
    assert "label: str" in show.stdout
    bad = project.run("data", "import", str(csv), "../escape")
    assert bad.returncode == 2 and "group.name" in bad.stderr


@pytest.mark.slow
def test_a_misused_decorator_is_reported_as_the_cause(project):
    """@train on a function without `run`, or without an Output: exit 2 naming what to change, by target or by
    name, never "has no attribute"."""
    (project.root / "bad.py").write_text(
        "from gwenlake_hpc import Input, Output, train\n\n"
        "@train(data=Input('t.rows'), output=Output('t.bad'), steps=10)\n"
        "def norun(data, output):\n    return None\n")
    (project.root / "bad2.py").write_text(
        "from gwenlake_hpc import Input, train\n\n"
        "@train(data=Input('t.rows'), steps=10)\n"
        "def noout(data, run):\n    return None\n")
    for args, needle in ((["bad.py:norun"], "the function has no parameter for run; add it to the signature"),
                         (["norun"], "the function has no parameter for run; add it to the signature"),
                         (["bad2.py:noout"], "declare exactly one Output (found 0)")):
        proc = train_cmd(project, *args, "job.tracking=false")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert needle in proc.stderr and "has no attribute" not in proc.stderr.splitlines()[-1], proc.stderr
        assert "Traceback" not in proc.stderr
    job = project.run("+job=t", "job.target=bad.py:norun")
    assert job.returncode == 2 and "importing bad.py failed: @train on norun" in job.stdout + job.stderr


@pytest.mark.slow
def test_models_list_and_commit_by_hand(project):
    project.run("+job=t", "job.tracking=false", check=0)
    d = project.root / "handmade"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"\x00\x01")
    proc = project.run("models", "commit", str(d), "t.model", "-m", "hand-tuned", check=0)
    sha = proc.stdout.split()[-1]
    listed = project.run("models", "list", "t.model", check=0).stdout.splitlines()
    assert len(listed) == 2 and listed[0].startswith(sha) and "hand-tuned" in listed[0]
