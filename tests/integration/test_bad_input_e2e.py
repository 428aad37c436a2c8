"""Bad input: a clear error naming the field, exit status 2, and nothing deleted (through real processes; the
whole table of bad settings runs in process in ``tests/unit/test_config_errors.py``)."""

from __future__ import annotations


import h5py
import numpy as np
import pytest
from helpers.bad_input import ledger_files, snapshot, train_t


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """One trained project for the whole table: every case must leave it as it was (each case checks that)."""
    from helpers.project import make_test_project

    return train_t(make_test_project(tmp_path_factory.mktemp("bad-input") / "project"))


# The whole table runs in process in tests/unit/test_config_errors.py (fast tier); these go through a real
# `python -m gwenlake_hpc` process: Hydra's own errors, the sweep launcher, a value with a newline in argv.
@pytest.mark.parametrize("args, needle", [
    (["+job=nope"], "job/nope"),
    (["+job=t", "job.bogus=1"], "bogus"),
    (["+job=t", "job.steps=0"], "job.steps=0: must be a whole number >= 1"),  # would commit an untrained model
    (["+job=t", "job.resume=never", "job.steps=90"], "job.resume=never"),
    (["+job=t", "job.model=modèle"], "job.model='modèle'"),  # Hydra's lexer refuses it unquoted: say how
    (["+job=t", "paths.runs_root='ru\nns'"], "holds control characters"),
    (["+job=t", "launcher=slurm", "launcher.timeout_min=0"], "launcher.timeout_min=0"),
    (["-m", "+job=t", "launcher=slurm", "job.params.lr=0.1,fast"], "could not be converted to Float"),
    (["+job=t", "tracking.uri=http://"], "names no host"),
])
@pytest.mark.slow
def test_config_errors_exit_2_and_delete_nothing(trained_once, args, needle):
    trained = trained_once
    before = snapshot(trained.root)
    starts = (next((trained.root / "runs" / "t.model").iterdir()) / "run.json").read_text()
    ledgers = ledger_files(trained.root)
    assert ledgers  # the training before wrote its start's
    proc = trained.run(*args, "job.tracking=false" if "tracking.uri" not in " ".join(args) else "job.tracking=true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert snapshot(trained.root) == before
    assert (next((trained.root / "runs" / "t.model").iterdir()) / "run.json").read_text() == starts  # no start
    assert ledger_files(trained.root) == ledgers


@pytest.mark.slow
def test_missing_column(trained):
    before = snapshot(trained.root)
    proc = trained.run("+job=t", "job.tracking=false", "job.steps=70", env={"GWL_TEST_BAD": "column"})
    assert proc.returncode == 2
    assert "nope" in proc.stderr + proc.stdout
    assert snapshot(trained.root) == before


@pytest.mark.slow
def test_missing_dataset(trained):
    before = snapshot(trained.root)
    proc = trained.run("+job=t", "paths.data_root=elsewhere", "job.tracking=false")
    assert proc.returncode == 2
    assert "t.rows" in proc.stderr + proc.stdout and "data import" in proc.stderr + proc.stdout
    assert snapshot(trained.root) == before


@pytest.mark.slow
def test_ragged_dataset(project):
    path = project.root / "data" / "t" / "rows.h5"
    with h5py.File(path, "a") as f:
        del f["y"]
        f["y"] = np.zeros(150, dtype=np.float32)
    proc = project.run("+job=t", "job.tracking=false")
    assert proc.returncode == 2
    assert "150" in proc.stderr + proc.stdout and "200" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_output_path_escape(project):
    proc = project.run("+job=t", "job.tracking=false", env={"GWL_TEST_BAD": "escape"})
    assert proc.returncode == 2
    assert "escapes" in proc.stderr + proc.stdout
    assert not list(project.root.rglob("escaped.txt"))
    # the final checkpoint is kept: a corrected rerun trains nothing and commits
    again = project.run("+job=t", "job.tracking=false", check=0)
    assert "resuming from step 60" in again.stdout + again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ['{"run_key": "t", "starts": [{"host"', '{"starts": "oops"}'])
def test_a_damaged_run_json_is_exit_2_and_the_run_is_left_as_it_was(project, damage):
    """The adversarial pass's inputs: a truncated run.json and one whose starts are not a list were tracebacks
    (JSONDecodeError, AttributeError)."""
    proc = project.run("+job=t", "job.steps=5", "job.tracking=false", env={"GWL_TEST_SIGKILL_AT": "4"})
    (run,) = (project.root / "runs" / "t.model").iterdir()
    (run / "run.json").write_text(damage)
    before = snapshot(project.root)
    proc = project.run("+job=t", "job.steps=5", "job.tracking=false")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert f"{run / 'run.json'} is damaged" in out and "Traceback" not in out, out
    assert snapshot(project.root) == before and (run / "run.json").read_text() == damage
