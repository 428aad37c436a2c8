"""Multi-task runs without a cluster: ``python -m gwenlake_hpc`` as several ranks with torchrun's environment
(gloo on the CPU), and reading what they committed."""

from __future__ import annotations

import os
import subprocess
import sys

from safetensors.torch import load_file

from helpers.mlflow_server import free_port


def start_ranks(project, *args, world=2, env=None):
    """Start ``python -m gwenlake_hpc ARGS`` as ``world`` ranks (torchrun's environment); returns the processes
    by rank (text pipes)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "GWENLAKE_DIST_TIMEOUT_S": "60", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "gwenlake_hpc", *args], cwd=project.root, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def launch(project, *args, world=2, env=None, timeout=240):
    """Run ``python -m gwenlake_hpc ARGS`` as ``world`` ranks; returns [(rc, stdout, stderr)] by rank."""
    procs = start_ranks(project, *args, world=world, env=env)
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        out.append((p.returncode, so, se))
    return out


def model_of(project, version):
    """The tensors of ``version``'s ``t/model/model.safetensors`` (also left in ``<project>/m.safetensors``)."""
    path = project.root / "m.safetensors"
    path.write_bytes(subprocess.run(["git", "show", f"{version}:t/model/model.safetensors"], cwd=project.root,
                                    capture_output=True, check=True).stdout)
    # load_file maps the file: the next call rewrites it in place, and the tensors would then show its bytes
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def version_in(stdout):
    line = next(line for line in stdout.splitlines() if line.startswith("model t.model version "))
    return line.split()[-1]
