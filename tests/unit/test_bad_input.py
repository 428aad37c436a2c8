"""Bad input: a cluster file with only the connection keys, composed in process (the cases that go through real
processes are in ``tests/integration/test_bad_input_e2e.py``; the whole table of bad settings runs in process in
``tests/unit/test_config_errors.py``)."""

from __future__ import annotations


import pytest
from helpers.bad_input import USER_CLUSTER_FILE


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
