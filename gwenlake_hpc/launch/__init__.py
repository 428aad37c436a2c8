"""Launchers: where a job runs. ``local`` runs it in this process; ``slurm`` submits it through submitit."""
