"""launcher.container without a cluster: checks before submission, the rendered step, the image's identity as the
batch script computes it (real bash), and what a start records. The runs on the local cluster are in
tests/cluster/test_container_slurm.py."""

from __future__ import annotations

import pytest

from helpers.oci_bundle import make_bundle
from helpers.project import files_under


@pytest.mark.slow
def test_dry_run_shows_the_container_step_and_bad_image_exits_2(project):
    runs_before = files_under(project.root / "runs")
    proc = project.run("+job=t", "launcher=slurm", "launcher.dry_run=true",
                       f"launcher.container.image={project.root}/none.sif", check=2)
    said = proc.stdout + proc.stderr
    assert "launcher.container.image" in said and "does not exist" in said
    assert files_under(project.root / "runs") == runs_before  # refused before anything was written
    bundle = make_bundle(project.root.parent / "bundle")
    proc = project.run("+job=t", "launcher=slurm", "launcher.dry_run=true", f"launcher.container.image={bundle}",
                       check=0)
    assert "--container=" in proc.stdout and "GWENLAKE_CONTAINER_DIGEST=sha256:" in proc.stdout
    assert "python3 -m gwenlake_hpc.launch.boot -u -m submitit.core._submit" in proc.stdout
    assert "gwenlake-requeue.py --rc" in proc.stdout
