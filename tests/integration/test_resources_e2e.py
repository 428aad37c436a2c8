"""What ``@train`` declares for the cluster, through real ``python -m gwenlake_hpc`` dry-run submissions (the
parsing of the declarations is tested in process in ``tests/unit/test_resources.py``)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_declared_resources_become_sbatch_lines_that_launcher_settings_override(project):
    base = ("job.target=trainer.py:fit_declared", "launcher=slurm", "launcher.dry_run=true")
    env = {"GWL_TEST_TOKEN": "s3cr3t-value"}
    script = project.run(*base, env=env, check=0).stdout
    lines = set(script.splitlines())
    assert {"#SBATCH --cpus-per-task=2", "#SBATCH --mem=500M", "#SBATCH --gres=gpu:1"} <= lines, script
    assert "export GWL_DECLARED='from the decorator'" in lines
    assert "--max-retries 5 " in script
    assert "s3cr3t-value" not in script and "/slurm/secrets-<random>.env" in script
    over = project.run(*base, "launcher.cpus_per_task=1", "launcher.mem_gb=2", "launcher.gpus_per_node=2",
                       "launcher.max_retries=0", "+launcher.env.GWL_DECLARED=mine", env=env, check=0).stdout
    lines = set(over.splitlines())
    assert {"#SBATCH --cpus-per-task=1", "#SBATCH --mem=2048M", "#SBATCH --gpus-per-node=2"} <= lines, over
    assert not any(line.startswith("#SBATCH --gres") for line in lines)
    assert "export GWL_DECLARED=mine" in lines and "--max-retries 0 " in over
    missing = project.run(*base)  # the declared secret is not in the environment
    assert missing.returncode == 2 and "GWL_TEST_TOKEN" in missing.stdout + missing.stderr
    # a launcher file that does not name its schema (no defaults list) takes the declared resources too
    (project.root / "conf" / "launcher" / "mine.yaml").write_text("name: slurm\ndry_run: true\n")
    mine = project.run("job.target=trainer.py:fit_declared", "launcher=mine", env=env, check=0).stdout
    assert {"#SBATCH --cpus-per-task=2", "#SBATCH --mem=500M", "#SBATCH --gres=gpu:1"} <= set(mine.splitlines()), mine
