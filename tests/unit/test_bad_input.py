"""Bad input: a clear error naming the field, exit status 2, and nothing deleted (through real processes; the
whole table of bad settings runs in process in ``tests/unit/test_config_errors.py``)."""

from __future__ import annotations


import h5py
import numpy as np
import pytest
from helpers.bad_input import snapshot, USER_CLUSTER_FILE


def test_missing_dataset(trained):
    before = snapshot(trained.root)
    proc = trained.run("+job=t", "paths.data_root=elsewhere", "job.tracking=false")
    assert proc.returncode == 2
    assert "t.rows" in proc.stderr + proc.stdout and "data import" in proc.stderr + proc.stdout
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


@pytest.mark.parametrize("schema_line", [False, True], ids=["no-schema-line", "schema-line"])
def test_a_cluster_file_with_only_the_connection_keys_takes_the_launcher_defaults(project, schema_line):
    from hydra import compose, initialize_config_dir

    from gwenlake_hpc.job.config import SlurmLauncherConfig, register
    from gwenlake_hpc.job.config_typed import typed_cluster
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
