"""Hydra launcher plugin: ``-m`` sweeps with ``launcher=slurm`` become one SLURM job array."""
