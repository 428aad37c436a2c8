"""Bad input: a clear error naming the field, exit status 2, and nothing deleted (through real processes; the
whole table of bad settings runs in process in ``tests/test_config_errors.py``)."""

from __future__ import annotations

import hashlib

import h5py
import numpy as np
import pytest


def snapshot(root):
    """sha256 of every file under runs/ and the model branch: what must survive a bad command."""
    out = {}
    for p in sorted((root / "runs").rglob("*")):
        # run.json records each start; checkpoints and outputs are what must not change
        if p.is_file() and p.name not in ("mlflow.db", "run.json", ".lock"):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _train(project):
    project.run("+job=t", "job.tracking=false", check=0)
    (project.root / "afile").write_text("a plain file where a folder is expected\n")
    (project.root / "loop1").symlink_to("loop2")
    (project.root / "loop2").symlink_to("loop1")
    return project


@pytest.fixture
def trained(project):
    return _train(project)


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """One trained project for the whole table: every case must leave it as it was (each case checks that)."""
    from helpers.project import make_test_project

    return _train(make_test_project(tmp_path_factory.mktemp("bad-input") / "project"))


# The whole table runs in process in tests/test_config_errors.py (fast tier); these go through a real
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
    proc = trained.run(*args, "job.tracking=false" if "tracking.uri" not in " ".join(args) else "job.tracking=true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert snapshot(trained.root) == before
    assert (next((trained.root / "runs" / "t.model").iterdir()) / "run.json").read_text() == starts  # no start


def test_missing_dataset(trained):
    before = snapshot(trained.root)
    proc = trained.run("+job=t", "paths.data_root=elsewhere", "job.tracking=false")
    assert proc.returncode == 2
    assert "t.rows" in proc.stderr + proc.stdout and "data import" in proc.stderr + proc.stdout
    assert snapshot(trained.root) == before


@pytest.mark.slow
def test_missing_column(trained):
    before = snapshot(trained.root)
    proc = trained.run("+job=t", "job.tracking=false", "job.steps=70", env={"GWL_TEST_BAD": "column"})
    assert proc.returncode == 2
    assert "nope" in proc.stderr + proc.stdout
    assert snapshot(trained.root) == before


def test_ragged_dataset(project):
    path = project.root / "data" / "t" / "rows.h5"
    with h5py.File(path, "a") as f:
        del f["y"]
        f["y"] = np.zeros(150, dtype=np.float32)
    proc = project.run("+job=t", "job.tracking=false")
    assert proc.returncode == 2
    assert "150" in proc.stderr + proc.stdout and "200" in proc.stderr + proc.stdout


def test_output_path_escape(project):
    proc = project.run("+job=t", "job.tracking=false", env={"GWL_TEST_BAD": "escape"})
    assert proc.returncode == 2
    assert "escapes" in proc.stderr + proc.stdout
    assert not list(project.root.rglob("escaped.txt"))
    # the final checkpoint is kept: a corrected rerun trains nothing and commits
    again = project.run("+job=t", "job.tracking=false", check=0)
    assert "resuming from step 60" in again.stdout + again.stderr


#: What a user writes from the README's list of keys: the connection keys, no defaults list naming the schema.
USER_CLUSTER_FILE = ("host: login.example.org\nport: 2222\nuser: me\nkey_file: ~/.ssh/id_ed25519\n"
                     "known_hosts: ~/.ssh/known_hosts\nremote_dir: /shared/me/project\npython: python3\n")


@pytest.mark.parametrize("schema_line", [False, True], ids=["no-schema-line", "schema-line"])
def test_a_cluster_file_with_only_the_connection_keys_takes_the_launcher_defaults(project, schema_line):
    from hydra import compose, initialize_config_dir

    from gwenlake_hpc.job.config import SlurmLauncherConfig, register, typed_cluster
    from gwenlake_hpc.launch.remote import effective_launcher

    head = "defaults:\n  - cluster_schema\n  - _self_\n" if schema_line else ""
    (project.root / "conf" / "cluster" / "mini.yaml").write_text(head + USER_CLUSTER_FILE)
    register()
    with initialize_config_dir(config_dir=str(project.root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+job=t", "cluster=mini"])
        lc = effective_launcher(cfg, [])
        defaults = SlurmLauncherConfig()
        assert (lc.timeout_min, lc.signal_delay_s, lc.max_retries, lc.partition) == (
            defaults.timeout_min, defaults.signal_delay_s, defaults.max_retries, defaults.partition)
        cc = typed_cluster(cfg.cluster)
        assert (cc.host, cc.port, cc.user, cc.remote_dir, cc.allow_dirty, cc.setup) == (
            "login.example.org", 2222, "me", "/shared/me/project", False, [])
        # the README's command lines set cluster.launcher keys the file does not list
        over = compose("config", overrides=["+job=t", "cluster=mini", "cluster.launcher.partition=gpu",
                                            "cluster.launcher.wait=true"])
    assert (effective_launcher(over, []).partition, effective_launcher(over, []).wait) == ("gpu", True)
