"""Our sbatch template against submitit's, for the same settings (submitit's private renderer is used here only,
to check that the dry run shows what submitit submits)."""

from __future__ import annotations

from omegaconf import OmegaConf
from submitit.slurm.slurm import _make_sbatch_string

from gwenlake_hpc.job.config import SlurmLauncherConfig
from gwenlake_hpc.launch.sbatch_script import render_sbatch
from gwenlake_hpc.launch.slurm import sbatch_parameters


def test_our_template_is_submitits_line_for_line():
    for kw in ({}, {"partition": "high", "gres": "gpu:2", "mem_gb": 1.5, "cpus_per_task": 4, "account": "a b",
                    "additional_parameters": {"mail-type": "END", "nodelist": "n1"}}, {"nodes": 2,
                                                                                        "tasks_per_node": 2}):
        lc = OmegaConf.merge(OmegaConf.structured(SlurmLauncherConfig), kw)
        params = sbatch_parameters(lc, job_name="gwenlake:t.model:fit-1")
        setup, teardown = ["export A='x y'", "trap '' TERM"], ["echo done"]
        command = "/usr/bin/python -m gwenlake_hpc.launch.boot -u -m submitit.core._submit /runs/x/slurm/%j"
        ours = render_sbatch(command, "/runs/x/slurm/%j", params, setup=setup, teardown=teardown)
        theirs = _make_sbatch_string(command=command, folder="/runs/x/slurm/%j", setup=setup, teardown=teardown,
                                     **params)
        assert ours == theirs
        assert "#SBATCH --signal=USR2@" in ours and "#SBATCH --requeue" in ours
        srun_args = ["--container=/runs/x/slurm/oci-bundle"]  # launcher.container with runtime=oci
        ours = render_sbatch(command, "/runs/x/slurm/%j", params, setup=setup, teardown=teardown, srun_args=srun_args)
        theirs = _make_sbatch_string(command=command, folder="/runs/x/slurm/%j", setup=setup, teardown=teardown,
                                     srun_args=srun_args, **params)
        assert ours == theirs and "--container=/runs/x/slurm/oci-bundle /usr/bin/python" in ours
